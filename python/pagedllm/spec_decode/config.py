"""`SpeculativeConfig`: what `LLM(..., speculative_config={...})` and `--speculative-config JSON`
accept (vLLM's keys), checked when the engine is built so a bad configuration fails before any
model is loaded."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from pagedllm._core import ngram_lookup_bounds

# vLLM's method names
SPEC_METHODS = ("ngram", "draft_model")
_KEYS = {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "model"}


@dataclass(frozen=True)
class SpeculativeConfig:
    """A checked speculative-decoding configuration.

    `ngram`: prompt lookup over each sequence's own prompt + output; `prompt_lookup_max` /
    `prompt_lookup_min` bound the suffix length looked up (one given: the other takes its value;
    neither: the proposer's defaults, 4 and 1; `_core.ngram_lookup_bounds` owns the rule).
    `draft_model`: a smaller checkpoint `model` with the target's vocabulary.
    """

    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    model: str | None = None

    @classmethod
    def from_dict(cls, value: Mapping | SpeculativeConfig | None) -> SpeculativeConfig | None:
        """Parses `value` (None: speculation off); ValueError naming the bad key or value."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if not isinstance(value, Mapping):
            raise ValueError(
                f"speculative_config must be a dict, got {type(value).__name__} {value!r}"
            )
        unknown = sorted(set(value) - _KEYS)
        if unknown:
            raise ValueError(
                f"speculative_config: unknown key(s) {unknown}; accepted: {sorted(_KEYS)}"
            )
        method = value.get("method")
        if method is None:
            # vLLM's older spelling: the method given as the model
            method = "ngram" if value.get("model") in ("ngram", "[ngram]") else "draft_model"
        if method not in SPEC_METHODS:
            raise ValueError(
                f"speculative_config: method must be one of {list(SPEC_METHODS)}, got {method!r}"
            )
        k = value.get("num_speculative_tokens")
        _count("num_speculative_tokens", k)
        if method == "ngram":
            given = {key: value.get(key) for key in ("prompt_lookup_max", "prompt_lookup_min")}
            for key, bound in given.items():
                if bound is not None and (not isinstance(bound, int) or isinstance(bound, bool)):
                    raise ValueError(f"speculative_config: {key} must be an integer, got {bound!r}")
            try:
                # the defaults and the rule of the bounds are the Rust proposer's
                lookup_max, lookup_min = ngram_lookup_bounds(**given)
            except ValueError as e:
                raise ValueError(f"speculative_config: {e}") from None
            return cls("ngram", k, lookup_max, lookup_min)
        model = value.get("model")
        if not isinstance(model, str) or not model:
            raise ValueError(
                f"speculative_config: method 'draft_model' needs 'model' (a checkpoint folder), "
                f"got {model!r}"
            )
        for key in ("prompt_lookup_max", "prompt_lookup_min"):
            if value.get(key) is not None:
                raise ValueError(f"speculative_config: {key} applies to method 'ngram' only")
        return cls("draft_model", k, model=model)

    def check_draft_vocab(self, target_vocab_size: int, draft_vocab_size: int) -> None:
        """A draft model must share the target's vocabulary: its tokens are the target's ids."""
        if draft_vocab_size != target_vocab_size:
            raise ValueError(
                f"speculative_config: the draft model {self.model!r} has a vocabulary of "
                f"{draft_vocab_size} tokens, the target {target_vocab_size}; they must match"
            )


def _count(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"speculative_config: {name} must be an integer >= 1, got {value!r}")
