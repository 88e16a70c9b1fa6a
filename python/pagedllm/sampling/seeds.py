"""Per-sample seeds: a seeded sample draws its noise from a generator seeded with a hash of
(seed, index of the sequence in its request, number of tokens generated so far). That makes its
tokens independent of the rest of the batch and of its row, needs no per-sequence state in the
engine, and repeats exactly after a preemption that recomputes the sequence."""

from __future__ import annotations

_MASK_64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    """One round of SplitMix64: a cheap, well-mixed 64-bit hash."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK_64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK_64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK_64
    return x ^ (x >> 31)


def sample_seed(seed: int, seq_index: int, num_generated: int) -> int:
    """Seed of the noise for one token of one seeded sequence (63 bits: torch's range)."""
    h = _splitmix64(seed & _MASK_64)
    h = _splitmix64(h ^ (seq_index & _MASK_64))
    return _splitmix64(h ^ (num_generated & _MASK_64)) >> 1
