"""Request input checks: the request id, the prompt (text or token ids) and the per-request limits
that depend on the engine. Each bad input is a ValueError (TypeError for a non-str request id)
naming the request, raised before anything is queued or allocated."""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from pagedllm.sampling_params import MAX_INT64, MIN_INT64, SamplingParams
from pagedllm.tokenizer import Tokenizer

PromptType = str | dict | Sequence[int]
# Unicode composition (a tokenizer's NFC / NFKC normalizer) joins at most 4 code points into one
MAX_COMPOSED = 4


def is_int(value: Any) -> bool:
    """A Python or numpy integer; never a bool (`True` as a count or id is a mistake)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def check_request_id(request_id: Any, what: str) -> None:
    if not isinstance(request_id, str):
        raise TypeError(f"{what} must be a str, got {type(request_id).__name__} {request_id!r}")


class InputProcessor:
    """Checks one request's inputs against the engine (vocabulary, `max_num_seqs`, tokenizer)
    and turns its prompt into token ids."""

    def __init__(
        self,
        tokenizer: Tokenizer | None,
        *,
        vocab_size: int,
        max_num_seqs: int,
        max_model_len: int | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len  # what truncate_prompt_tokens=-1 keeps

    def process(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        arrival_time: Any,
        priority: Any,
    ) -> tuple[str | None, list[int], SamplingParams]:
        """(prompt text or None, prompt token ids, the parameters the engine runs it with) of a
        request whose inputs are all valid. The prompt is truncated to its last
        `truncate_prompt_tokens` tokens (the text is kept as given, as vLLM does); `bad_words`
        are tokenized."""
        if not isinstance(params, SamplingParams):
            raise ValueError(
                f"request {request_id!r}: params must be SamplingParams, "
                f"got {type(params).__name__}"
            )
        self.check_limits(request_id, params, arrival_time, priority)
        params = self.tokenize_bad_words(request_id, params)
        text, token_ids = self.tokenize(request_id, prompt)
        token_ids = self.truncate(token_ids, params.truncate_prompt_tokens)
        self.check_prompt(request_id, token_ids)
        return text, token_ids, params

    def truncate(self, token_ids: list[int], keep: int | None) -> list[int]:
        """The last `keep` prompt tokens (-1: the last `max_model_len`; None: all)."""
        if keep == -1:
            keep = self.max_model_len
        return token_ids[-keep:] if keep is not None and len(token_ids) > keep else token_ids

    def tokenize_bad_words(self, request_id: str, params: SamplingParams) -> SamplingParams:
        if not params.bad_words:
            return params
        if self.tokenizer is None:
            raise ValueError(
                f"request {request_id!r}: bad_words need a tokenizer (the engine was built "
                f"with skip_tokenizer_init=True)"
            )
        tokenizer = self.tokenizer
        params = params.with_bad_words_tokenized(
            lambda word: tokenizer.encode(word, add_special_tokens=False)
        )
        for word in params.bad_words_token_ids:
            self._check_token_ids(request_id, "bad_words", word)
        return params

    def _check_token_ids(self, request_id: str, name: str, ids) -> None:
        vocab = self.vocab_size
        bad = next((t for t in ids if t >= vocab), None)
        if bad is not None:
            raise ValueError(
                f"request {request_id!r}: {name}: token id {bad} is outside the vocabulary "
                f"[0, {vocab})"
            )

    @functools.cached_property
    def max_token_chars(self) -> int | None:
        """The most characters one token's text can span: its vocabulary's longest entry (a
        byte-level or SentencePiece entry is at least as long as its text). None without a
        tokenizer."""
        tokenizer = self.tokenizer
        if tokenizer is None:
            return None
        backend = getattr(tokenizer, "backend", None)
        if backend is not None:
            return max(map(len, backend.get_vocab()), default=1)
        ids = range(tokenizer.vocab_size)
        return max((len(tokenizer.decode([i], skip_special_tokens=False)) for i in ids), default=1)

    def min_prompt_tokens(self, text: str) -> int:
        """A lower bound on the tokens `text` encodes to, known without tokenizing it, so that
        a text that cannot fit is refused by its size alone (0 without a tokenizer). It holds
        for normalizers that at most compose characters (NFC / NFKC, as the Llama and Qwen
        tokenizers use), not for ones that delete text."""
        per_token = self.max_token_chars
        if not per_token:
            return 0
        return len(text) // (per_token * MAX_COMPOSED)

    def check_limits(
        self, request_id: str, params: SamplingParams, arrival_time: Any, priority: Any
    ) -> None:
        """Per-request bounds that depend on the engine, checked before anything is queued."""
        max_seqs = self.max_num_seqs
        for name in ("n", "best_of"):
            value = getattr(params, name)
            if value is not None and value > max_seqs:
                raise ValueError(
                    f"request {request_id!r}: {name}={value} exceeds max_num_seqs="
                    f"{max_seqs} (the most sequences one request may have)"
                )
        vocab = self.vocab_size
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name, None)
            if value is not None and value > vocab:
                raise ValueError(
                    f"request {request_id!r}: {name}={value} exceeds the vocabulary size {vocab}"
                )
        self._check_token_ids(request_id, "logit_bias", params.logit_bias or ())
        self._check_token_ids(request_id, "allowed_token_ids", params.allowed_token_ids or ())
        if not is_int(priority) or not MIN_INT64 <= priority <= MAX_INT64:
            raise ValueError(
                f"request {request_id!r}: priority must be an int in "
                f"[{MIN_INT64}, {MAX_INT64}], got {priority!r}"
            )
        if arrival_time is not None and not (
            (is_int(arrival_time) or isinstance(arrival_time, float))
            and math.isfinite(arrival_time)
        ):
            raise ValueError(
                f"request {request_id!r}: arrival_time must be None or a finite "
                f"number of seconds, got {arrival_time!r}"
            )

    def tokenize(self, request_id: str, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(
                    f"request {request_id!r}: text prompts need a tokenizer "
                    f"(the engine was built with skip_tokenizer_init=True)"
                )
            _check_text(request_id, "prompt", prompt)
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" not in prompt:
                raise ValueError(f"request {request_id!r}: a dict prompt needs 'prompt_token_ids'")
            text = prompt.get("prompt")
            if text is not None:
                if not isinstance(text, str):
                    raise ValueError(
                        f"request {request_id!r}: 'prompt' must be None or a str, "
                        f"got {type(text).__name__}"
                    )
                _check_text(request_id, "prompt", text)
            return text, _token_id_list(request_id, prompt["prompt_token_ids"])
        if isinstance(prompt, (list, tuple, np.ndarray)):
            return None, _token_id_list(request_id, prompt)
        raise ValueError(f"request {request_id!r}: unsupported prompt type {type(prompt).__name__}")

    def check_prompt(self, request_id: str, token_ids: list[int]) -> None:
        if not token_ids:
            raise ValueError(f"request {request_id!r}: empty prompt")
        vocab = self.vocab_size
        if min(token_ids) < 0 or max(token_ids) >= vocab:  # C-level passes; locate only if bad
            i, bad = next((i, t) for i, t in enumerate(token_ids) if not 0 <= t < vocab)
            raise ValueError(
                f"request {request_id!r}: prompt token id {bad} (position {i}) is "
                f"outside the vocabulary [0, {vocab})"
            )


def _check_text(request_id: str, name: str, text: str) -> None:
    """Text must encode as UTF-8 (no lone surrogates); ASCII text (the usual case) is free."""
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(
                f"request {request_id!r}: {name} is not valid Unicode text: lone "
                f"surrogate {text[e.start]!r} at position {e.start}"
            ) from None


def _token_id_list(request_id: str, ids: Any) -> list[int]:
    """Prompt token ids as a list of Python ints: a list / tuple of ints (or numpy integers) or
    a 1-D integer numpy array / torch tensor. Anything else (floats, bools, strings, None) is a
    ValueError naming the request and the offending position: never truncated or coerced."""
    if isinstance(ids, np.ndarray):
        if ids.ndim != 1 or (ids.size and ids.dtype.kind not in "iu"):
            raise ValueError(
                f"request {request_id!r}: prompt_token_ids must be a 1-D integer "
                f"array, got a {ids.ndim}-D {ids.dtype} array"
            )
        return ids.tolist()
    if isinstance(ids, torch.Tensor):
        dtype = ids.dtype
        if ids.dim() != 1 or (
            ids.numel() and (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)
        ):
            raise ValueError(
                f"request {request_id!r}: prompt_token_ids must be a 1-D integer "
                f"tensor, got a {ids.dim()}-D {dtype} tensor"
            )
        return ids.tolist()
    if not isinstance(ids, (list, tuple, range)):
        raise ValueError(
            f"request {request_id!r}: prompt_token_ids must be a list of ints or an "
            f"integer numpy array, got {type(ids).__name__} {ids!r:.80}"
        )
    if set(map(type, ids)) <= {int}:  # the usual case, one C-level pass
        return list(ids)
    for i, t in enumerate(ids):
        if not is_int(t):
            raise ValueError(
                f"request {request_id!r}: prompt_token_ids[{i}] must be an int, got "
                f"{type(t).__name__} {t!r:.80}"
            )
    return [int(t) for t in ids]
