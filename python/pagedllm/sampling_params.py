"""`SamplingParams`: how to sample one request (vLLM's names and defaults).

Pure Python on purpose: importing it must not import torch.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from pagedllm.structured_output.params import StructuredOutputsParams

# Below this temperature sampling is greedy (argmax); dividing by it would overflow anyway.
SAMPLING_EPS = 1e-5

# Integer fields end up in Rust (usize / i64 counts, u32 token ids) or torch (int64): the
# limits of those types, checked here so a huge value is a ValueError naming the field, not a
# bare OverflowError (or an allocation failure) later.
MIN_INT64, MAX_INT64 = -(2**63), 2**63 - 1
MAX_TOKEN_ID = 2**32 - 1


def _fail(name: str, value: Any, rule: str) -> None:
    raise ValueError(f"SamplingParams.{name} {rule}, got {value!r}")


def _is_int(value: Any) -> bool:
    # bool is an int subclass, but `seed=True` or `n=True` is a mistake, not a number.
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    return (_is_int(value) or isinstance(value, float)) and not math.isnan(value)


def _check_int(name: str, value: Any, low: int, high: int = MAX_INT64) -> None:
    if not _is_int(value) or value < low:
        _fail(name, value, f"must be an int >= {low}")
    if value > high:
        _fail(name, value, f"must be <= {high}")


def _check_real(name: str, value: Any, low: float, high: float, *, low_open: bool = False) -> None:
    ok = _is_real(value) and (low < value if low_open else low <= value) and value <= high
    if not ok:
        bracket = "(" if low_open else "["
        _fail(name, value, f"must be a number in {bracket}{low}, {high}]")


def _normalize_stop(stop: Any) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, (list, tuple)) or not all(isinstance(s, str) and s for s in stops):
        _fail("stop", stop, "must be None, a non-empty str or a list of non-empty str")
    return list(stops)


def _normalize_stop_token_ids(ids: Any) -> list[int]:
    if ids is None:
        return []
    if not isinstance(ids, (list, tuple)) or not all(
        _is_int(i) and 0 <= i <= MAX_TOKEN_ID for i in ids
    ):
        _fail(
            "stop_token_ids",
            ids,
            f"must be None or a list of token ids (ints in [0, {MAX_TOKEN_ID}])",
        )
    return list(ids)


def _normalize_logit_bias(bias: Any) -> dict[int, float] | None:
    if bias is None:
        return None
    if not isinstance(bias, dict):
        _fail("logit_bias", bias, "must be None or a dict of token id -> bias")
    for token, value in bias.items():
        if not (_is_int(token) and 0 <= token <= MAX_TOKEN_ID):
            _fail("logit_bias", token, f"keys must be token ids (ints in [0, {MAX_TOKEN_ID}])")
        if not _is_real(value) or math.isinf(value):
            _fail("logit_bias", value, f"values must be finite numbers (token {token})")
    return {int(t): float(v) for t, v in bias.items()}


def _normalize_allowed_token_ids(ids: Any) -> list[int] | None:
    if ids is None:
        return None
    if (
        not isinstance(ids, (list, tuple))
        or not ids
        or not all(_is_int(i) and 0 <= i <= MAX_TOKEN_ID for i in ids)
    ):
        _fail(
            "allowed_token_ids",
            ids,
            f"must be None or a non-empty list of token ids (ints in [0, {MAX_TOKEN_ID}])",
        )
    return list(dict.fromkeys(ids))


def _normalize_bad_words(words: Any) -> list[str] | None:
    if words is None:
        return None
    if not isinstance(words, (list, tuple)) or not all(
        isinstance(w, str) and w.strip() for w in words
    ):
        _fail("bad_words", words, "must be None or a list of non-blank strings")
    return list(words)


@dataclass
class SamplingParams:
    """Sampling parameters of one request; validated at construction (`ValueError` names the field).

    Integer fields are bounded by the types that hold them: counts (`n`, `best_of`,
    `max_tokens`, `min_tokens`, `logprobs`, `top_k`) by 2**63 - 1, `stop_token_ids` by 2**32 - 1,
    `seed` to 64 bits. Limits that depend on the engine (`n` / `best_of` <= `max_num_seqs`,
    `logprobs` <= the vocabulary size) are checked by `LLMEngine.add_request`.

    `temperature` below `SAMPLING_EPS` (e.g. 0) means greedy. `top_k` of -1 or 0 means no top-k.
    `stop` is normalized to a list of strings and `stop_token_ids` to a list of ints.
    `best_of` (default `n`) is how many samples are drawn; the `n` with the highest cumulative
    logprob are returned. `logprobs=N` returns, per generated token, the sampled token and the N
    most likely ones, scored by the model's raw distribution (see `pagedllm.sampling.logprobs`).
    `structured_outputs` constrains the output to a JSON schema, regex, choice list or grammar
    (`StructuredOutputsParams`); it takes no `min_tokens`, as the constraint decides where the
    output ends.

    Token-level controls (vLLM's): `logit_bias` adds a bias to the logit of each token id given
    (the OpenAI server clips biases to [-100, 100]); `allowed_token_ids` lets only those ids be
    sampled (EOS only if listed); `bad_words` bans each word: its last token is masked whenever
    the output ends with the word's other tokens, for the word's tokenization with and without a
    leading space. None of these changes the reported `logprobs` (the raw distribution).
    `prompt_logprobs=N` returns, per prompt token after the first, its logprob and the N most
    likely tokens at that position (`RequestOutput.prompt_logprobs`, None first, as vLLM).
    `truncate_prompt_tokens=k` keeps only the last k prompt tokens (-1: the last
    `max_model_len`). Ids are checked against the vocabulary by `LLMEngine.add_request`.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    best_of: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputsParams | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    prompt_logprobs: int | None = None
    truncate_prompt_tokens: int | None = None
    # `bad_words` tokenized by the engine (`with_bad_words_tokenized`), as vLLM keeps them
    _bad_words_token_ids: list[list[int]] | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._check_counts()
        self._check_distribution()
        self._check_penalties()
        self._check_flags()
        self._check_structured_outputs()
        self.stop = _normalize_stop(self.stop)
        self.stop_token_ids = _normalize_stop_token_ids(self.stop_token_ids)
        self.logit_bias = _normalize_logit_bias(self.logit_bias)
        self.allowed_token_ids = _normalize_allowed_token_ids(self.allowed_token_ids)
        self.bad_words = _normalize_bad_words(self.bad_words)

    def _check_counts(self) -> None:
        _check_int("n", self.n, 1)
        if self.best_of is not None:
            _check_int("best_of", self.best_of, self.n)
        _check_int("max_tokens", self.max_tokens, 1)
        _check_int("min_tokens", self.min_tokens, 0)
        if self.min_tokens > self.max_tokens:
            _fail("min_tokens", self.min_tokens, f"must be <= max_tokens ({self.max_tokens})")
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, 0)
        if self.prompt_logprobs is not None:
            _check_int("prompt_logprobs", self.prompt_logprobs, 0)
        k = self.truncate_prompt_tokens
        if k is not None and not (_is_int(k) and (k == -1 or 1 <= k <= MAX_INT64)):
            _fail("truncate_prompt_tokens", k, f"must be None, -1 or an int in [1, {MAX_INT64}]")
        if self.seed is not None and not (_is_int(self.seed) and MIN_INT64 <= self.seed < 2**64):
            _fail("seed", self.seed, f"must be None or an int in [{MIN_INT64}, {2**64 - 1}]")

    def _check_distribution(self) -> None:
        _check_real("temperature", self.temperature, 0.0, math.inf)
        if math.isinf(self.temperature):
            _fail("temperature", self.temperature, "must be finite")
        _check_real("top_p", self.top_p, 0.0, 1.0, low_open=True)
        _check_int("top_k", self.top_k, -1)
        _check_real("min_p", self.min_p, 0.0, 1.0)

    def _check_penalties(self) -> None:
        _check_real("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_real("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _check_real("repetition_penalty", self.repetition_penalty, 0.0, math.inf, low_open=True)
        if math.isinf(self.repetition_penalty):
            _fail("repetition_penalty", self.repetition_penalty, "must be finite")

    def _check_flags(self) -> None:
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                _fail(name, getattr(self, name), "must be a bool")

    def _check_structured_outputs(self) -> None:
        so = self.structured_outputs
        if so is not None and not isinstance(so, StructuredOutputsParams):
            raise TypeError(
                f"SamplingParams.structured_outputs must be a StructuredOutputsParams or None, "
                f"got {type(so).__name__}"
            )
        if so is not None and self.min_tokens:
            # the grammar decides where the output ends (only EOS may follow a complete one),
            # and whether its outputs reach min_tokens is unknown ("yes" never does)
            _fail(
                "min_tokens",
                self.min_tokens,
                "must be 0 with structured_outputs (the constraint decides where the output ends)",
            )

    # --- derived views used by the engine and the sampler -------------------------------------

    @property
    def is_greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    @property
    def num_samples(self) -> int:
        """Sequences to generate (best_of when given, else n)."""
        return self.best_of if self.best_of is not None else self.n

    @property
    def uses_top_k(self) -> bool:
        return self.top_k > 0

    @property
    def uses_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    @property
    def bad_words_token_ids(self) -> list[list[int]]:
        """`bad_words` as token-id sequences (empty until the engine tokenized them)."""
        return self._bad_words_token_ids or []

    def with_bad_words_tokenized(self, encode: Callable[[str], list[int]]) -> SamplingParams:
        """A copy whose `bad_words` are tokenized with `encode` (no special tokens), vLLM's way:
        each word as given (leading space stripped) and, when it tokenizes differently, with
        one leading space, so the word is banned at the start of the text and inside it."""
        if not self.bad_words:
            return self
        sequences: list[list[int]] = []
        for word in self.bad_words:
            plain = encode(word.lstrip())
            spaced = encode(" " + word.lstrip())
            sequences.append(plain)
            if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
                sequences.append(spaced)
        return dataclasses.replace(self, _bad_words_token_ids=sequences)

    def all_stop_token_ids(self, eos_token_ids: int | Iterable[int] | None) -> list[int]:
        """Token ids that end the sequence: stop_token_ids, plus the EOS id (or every one of a
        checkpoint's EOS ids, as Llama 3 has several) unless `ignore_eos`; no id twice.

        The one definition of the stop-token set: the engine builds it once per request and the
        scheduler's stop rule, the output text and the sampler's `min_tokens` mask all use it.
        """
        ids = list(dict.fromkeys(self.stop_token_ids or []))
        if eos_token_ids is None or self.ignore_eos:
            return ids
        eos_ids = [eos_token_ids] if isinstance(eos_token_ids, int) else eos_token_ids
        return ids + [t for t in dict.fromkeys(eos_ids) if t not in ids]


@dataclass
class BeamSearchParams:
    """Beam search of one prompt (vLLM's `BeamSearchParams`, for `LLM.beam_search`); validated
    at construction (`ValueError` names the field).

    `beam_width` beams are kept per step, each extended by its `2 * beam_width` most likely
    tokens; an EOS candidate ends a hypothesis (unless `ignore_eos`). After `max_tokens` steps
    the `beam_width` best of the finished hypotheses and the running beams are returned, scored
    `cum_logprob / len(prompt + output) ** length_penalty` (an EOS at the end not counted), as
    vLLM scores them. Beam search ranks by the model's raw log-probabilities: `temperature`
    must be 0 (vLLM's default; other values are refused rather than ignored).
    """

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        for name in ("beam_width", "max_tokens"):
            value = getattr(self, name)
            if not _is_int(value) or not 1 <= value <= MAX_INT64:
                raise ValueError(f"BeamSearchParams.{name} must be an int >= 1, got {value!r}")
        for name in ("ignore_eos", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(
                    f"BeamSearchParams.{name} must be a bool, got {getattr(self, name)!r}"
                )
        if not _is_real(self.temperature) or self.temperature != 0:
            raise ValueError(
                "BeamSearchParams.temperature must be 0 (beam search ranks beams by the "
                f"model's raw log-probabilities; it does not sample), got {self.temperature!r}"
            )
        if not _is_real(self.length_penalty) or math.isinf(self.length_penalty):
            raise ValueError(
                f"BeamSearchParams.length_penalty must be a finite number, got "
                f"{self.length_penalty!r}"
            )
