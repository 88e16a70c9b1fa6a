"""`SpeculativeConfig`: what `LLM(..., speculative_config={...})` and `--speculative-config JSON`
accept (vLLM's keys), checked when the engine is built so a bad configuration fails before any
model is loaded."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

# vLLM's method names
SPEC_METHODS = ("ngram", "draft_model")
_KEYS = {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "model"}


@dataclass(frozen=True)
class SpeculativeConfig:
    """A checked speculative-decoding configuration.

    `ngram`: prompt lookup over each sequence's own prompt + output; `prompt_lookup_max` /
    `prompt_lookup_min` bound the suffix length looked up (one given: the other takes its value;
    neither: 4 and 1). `draft_model`: a smaller checkpoint `model` with the target's vocabulary.
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
            lookup_max, lookup_min = value.get("prompt_lookup_max"), value.get("prompt_lookup_min")
            if lookup_max is None and lookup_min is None:
                lookup_max, lookup_min = 4, 1
            lookup_max = lookup_min if lookup_max is None else lookup_max
            lookup_min = lookup_max if lookup_min is None else lookup_min
            _count("prompt_lookup_max", lookup_max)
            _count("prompt_lookup_min", lookup_min)
            if lookup_min > lookup_max:
                raise ValueError(
                    f"speculative_config: prompt_lookup_min ({lookup_min}) must be <= "
                    f"prompt_lookup_max ({lookup_max})"
                )
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
