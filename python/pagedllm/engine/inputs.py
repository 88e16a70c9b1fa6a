"""Request inputs: the prompt (text or token ids) turned into token ids, and the checks that
depend on the model (vocabulary, tokenizer). Each bad input is a ValueError naming the request,
raised before anything is queued or allocated.

The request rules that do not depend on the model (the request id, strictly integer token ids,
an empty prompt, `n` / `best_of` against `max_num_seqs`, `min_tokens` against `max_tokens`,
priority, arrival time, LoRA only when enabled) are the Rust core's:
`Scheduler.validate_request` checks them, here never restated.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import numpy as np

from pagedllm.sampling_params import SamplingParams
from pagedllm.tokenizer import Tokenizer

PromptType = str | dict | Sequence[int]
# Unicode composition (a tokenizer's NFC / NFKC normalizer) joins at most 4 code points into one
MAX_COMPOSED = 4


class InputProcessor:
    """Checks one request's inputs against the model (vocabulary, tokenizer) and turns its
    prompt into token ids."""

    def __init__(
        self, tokenizer: Tokenizer | None, *, vocab_size: int, max_model_len: int | None = None
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len  # what truncate_prompt_tokens=-1 keeps

    def process(self, request_id: str, prompt: PromptType, params: SamplingParams) -> tuple:
        """(prompt text or None, prompt token ids as given, the parameters the engine runs it
        with). The ids are a list of ints for a text prompt, else what the caller passed, for
        `Scheduler.validate_request` to read strictly; `bad_words` are tokenized."""
        if not isinstance(params, SamplingParams):
            raise ValueError(
                f"request {request_id!r}: params must be SamplingParams, "
                f"got {type(params).__name__}"
            )
        self.check_limits(request_id, params)
        params = self.tokenize_bad_words(request_id, params)
        text, token_ids = self.tokenize(request_id, prompt)
        return text, token_ids, params

    def truncate(self, token_ids: list[int], keep: int | None) -> list[int]:
        """The last `keep` prompt tokens (-1: the last `max_model_len`; None: all); the text is
        kept as given, as vLLM does."""
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

    def check_limits(self, request_id: str, params: SamplingParams) -> None:
        """Per-request bounds that depend on the model, checked before anything is queued."""
        vocab = self.vocab_size
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name, None)
            if value is not None and value > vocab:
                raise ValueError(
                    f"request {request_id!r}: {name}={value} exceeds the vocabulary size {vocab}"
                )
        self._check_token_ids(request_id, "logit_bias", params.logit_bias or ())
        self._check_token_ids(request_id, "allowed_token_ids", params.allowed_token_ids or ())

    def tokenize(self, request_id: str, prompt: PromptType) -> tuple[str | None, Any]:
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
            return text, prompt["prompt_token_ids"]
        if isinstance(prompt, (list, tuple, np.ndarray)):
            return None, prompt
        raise ValueError(f"request {request_id!r}: unsupported prompt type {type(prompt).__name__}")

    def check_prompt(self, request_id: str, token_ids: list[int]) -> None:
        """Prompt token ids (ints, as `Scheduler.validate_request` returns them) inside the
        vocabulary."""
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
