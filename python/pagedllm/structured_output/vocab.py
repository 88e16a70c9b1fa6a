"""The engine's tokenizer as llguidance sees it (`LLTokenizer`): built once per engine.

- the byte tokenizer of `pagedllm/tiny-random`: its token byte strings (256 bytes, then the
  specials) through llguidance's generic `TokenizerWrapper`;
- a `tokenizer.json` tokenizer: its serialized form, which llguidance loads with the same
  `tokenizers` library;
- a `transformers` fast tokenizer: llguidance's own adapter (`llguidance.hf`). Slow
  (Python-only) tokenizers are refused with a clear error.
"""

from __future__ import annotations

from collections.abc import Sequence

import llguidance

from pagedllm.tokenizer import AutoTokenizerAdapter, ByteTokenizer, HFTokenizer, Tokenizer


class _ByteVocab:
    """What `llguidance.TokenizerWrapper` reads from a tokenizer, for `ByteTokenizer`."""

    def __init__(self, tokenizer: ByteTokenizer) -> None:
        self.eos_token_id = tokenizer.eos_token_id
        self.bos_token_id = tokenizer.bos_token_id
        specials = tokenizer.special_tokens
        self.tokens = [bytes([i]) for i in range(256)] + [
            specials[i].encode() for i in range(256, tokenizer.vocab_size)
        ]
        self.special_token_ids = sorted(specials)

    def __call__(self, text: bytes | str) -> list[int]:
        return list(text.encode("utf-8") if isinstance(text, str) else text)


def ll_tokenizer(
    tokenizer: Tokenizer, vocab_size: int, eos_token_ids: Sequence[int]
) -> llguidance.LLTokenizer:
    """`tokenizer` for llguidance; `vocab_size` is the model's (its logits' width), every id of
    `eos_token_ids` ends a constrained output."""
    eos = list(eos_token_ids) or None
    if isinstance(tokenizer, ByteTokenizer):
        wrapper = llguidance.TokenizerWrapper(_ByteVocab(tokenizer))
        return llguidance.LLTokenizer(wrapper, n_vocab=vocab_size, eos_token=eos)
    if isinstance(tokenizer, HFTokenizer):
        return llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=vocab_size, eos_token=eos)
    if isinstance(tokenizer, AutoTokenizerAdapter) and tokenizer.backend.is_fast:
        from llguidance.hf import from_tokenizer  # imports transformers: only when needed

        return from_tokenizer(tokenizer.backend, n_vocab=vocab_size, eos_token=eos)
    raise ValueError(
        f"structured output needs a tokenizer.json or a fast transformers tokenizer; "
        f"{type(tokenizer).__name__} is not supported"
    )
