"""`ForeignHashes`: another engine's KV events (a vLLM server's) in this router's block hashes.

A vLLM replica names its blocks by its own hash function (SHA-256 by default, published as its
low 64 bits), which the router cannot compute for a prompt. Its `BlockStored` events carry what
the hash was made from, though: the parent block's hash and the blocks' token ids. So each
stored block is re-hashed with pagedllm's chained hash, continuing from the parent's re-hash,
and a table remembers foreign hash -> own hash until no medium holds the block (an offload
tier's stored event carries no tokens: it is translated through the table); the index then
holds own hashes only, the same ones `Router.route` computes from a prompt.

The table and the re-hashing are Rust's (`router/foreign.rs`); `subscriber.index_records`
translates a batch through it. Left out (never matched, so never routed to by mistake): blocks
whose parent was not seen (stored before the router subscribed, or in a lost batch), blocks of
another block size, and blocks whose hash covers more than the tokens (a LoRA adapter, images,
a cache salt), which a prompt's hash here would not include.
"""

from __future__ import annotations

from pagedllm._core import ForeignHashes, foreign_key

__all__ = ["ForeignHashes", "foreign_key"]
