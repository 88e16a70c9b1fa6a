"""`ForeignHashes`: another engine's KV events (a vLLM server's) in this router's block hashes.

A vLLM replica names its blocks by its own hash function (SHA-256 by default, published as its
low 64 bits), which the router cannot compute for a prompt. Its `BlockStored` events carry what
the hash was made from, though: the parent block's hash and the blocks' token ids. So each
stored block is re-hashed here with pagedllm's chained hash, continuing from the parent's
re-hash, and a table remembers foreign hash -> own hash until the block is removed; the index
then holds own hashes only, the same ones `Router.route` computes from a prompt.

Left out (never matched, so never routed to by mistake): blocks whose parent was not seen (stored
before the router subscribed, or in a lost batch), blocks of another block size, and blocks whose
hash covers more than the tokens (a LoRA adapter, images, a cache salt), which a prompt's hash
here would not include.
"""

from __future__ import annotations

from pagedllm._core import ROOT_HASH, hash_block_chain

_LOW_64 = (1 << 64) - 1


def foreign_key(block_hash: int | bytes) -> int:
    """A published hash as a table key: an integer as is, bytes as their low 64 bits (what vLLM
    publishes instead with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1, its default)."""
    if isinstance(block_hash, bytes):
        return int.from_bytes(block_hash, "big") & _LOW_64
    return block_hash & _LOW_64


class ForeignHashes:
    """One replica's foreign hash -> own hash table (its size is that replica's cached blocks).

    A batch's changes are staged and kept only if the index applied the batch (`commit`), so a
    batch refused as a gap and replayed later is translated again from the same table."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.own: dict[int, int] = {}
        self._staged: dict[int, int | None] = {}  # None: removed in this batch
        self._cleared = False

    def stored(self, event: dict) -> list[int]:
        """A `BlockStored`'s fields by name (`subscriber.event_fields`) -> its blocks' own
        hashes, [] when they cannot be had (see the module's note)."""
        hashes, parent = event.get("block_hashes") or [], event.get("parent_block_hash")
        tokens, block_size = event.get("token_ids") or [], event.get("block_size")
        if block_size != self.block_size or event.get("lora_id") is not None:
            return []
        if event.get("lora_name") or any(event.get("extra_keys") or []):
            return []
        if not hashes or len(tokens) != len(hashes) * block_size:
            return []
        own_parent = ROOT_HASH if parent is None else self._get(foreign_key(parent))
        if own_parent is None:
            return []
        own = hash_block_chain(tokens, block_size, parent_hash=own_parent)
        for foreign, mine in zip(hashes, own):
            self._staged[foreign_key(foreign)] = mine
        return own

    def removed(self, hashes: list) -> list[int]:
        """A `BlockRemoved`'s hashes -> the own hashes of those the table knew."""
        out = []
        for h in hashes:
            key = foreign_key(h)
            mine = self._get(key)
            if mine is not None:
                out.append(mine)
                self._staged[key] = None
        return out

    def cleared(self) -> None:
        """An `AllBlocksCleared`."""
        self._staged.clear()
        self._cleared = True

    def reset(self) -> None:
        """Forgets every block at once, staged or kept (the replica starts over)."""
        self.own.clear()
        self.rollback()

    def commit(self) -> None:
        """Keeps the staged batch's changes (the index applied it)."""
        if self._cleared:
            self.own.clear()
        for key, mine in self._staged.items():
            if mine is None:
                self.own.pop(key, None)
            else:
                self.own[key] = mine
        self.rollback()

    def rollback(self) -> None:
        """Drops the staged batch's changes (the index did not apply it)."""
        self._staged.clear()
        self._cleared = False

    def _get(self, key: int) -> int | None:
        if key in self._staged:
            return self._staged[key]
        return None if self._cleared else self.own.get(key)
