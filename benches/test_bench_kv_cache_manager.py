"""Memory-manager microbenchmarks through the Python bindings (pytest-benchmark).

Run: python -m pytest benches/test_bench_kv_cache_manager.py --benchmark-columns=median,iqr,rounds
Each benchmarked call includes the Python -> Rust crossing and the list conversions, i.e. what a
Python caller pays; the `rust_hash_*` cases time the block hash inside Rust alone.
"""

from __future__ import annotations

import hashlib
import pickle

import pytest

from pagedllm import KVCacheManager, _core

HASH_ITERATIONS = 100_000


def manager(
    block_size: int, num_gpu_blocks: int = 4096, num_cpu_blocks: int = 4096
) -> KVCacheManager:
    return KVCacheManager(
        num_gpu_blocks=num_gpu_blocks,
        block_size=block_size,
        num_cpu_blocks=num_cpu_blocks,
        watermark=0.0,
    )


@pytest.mark.parametrize("block_size", [16])
def test_allocate_free_1024_tokens(benchmark, block_size):
    m = manager(block_size)
    tokens = list(range(1024))

    def allocate_free():
        m.allocate(1, tokens)
        m.free(1)

    benchmark(allocate_free)
    m.check_invariants()


def test_fork_and_copy_on_write_append(benchmark):
    m = manager(16)
    m.allocate(1, list(range(1000)))  # last block partly filled, so the child's append copies it

    def fork_append():
        m.fork(1, 2)
        copies = m.append_slots(2, 1000, 1001)
        m.free(2)
        return copies

    copies = benchmark(fork_append)
    assert len(copies) == 1
    m.check_invariants()


@pytest.mark.parametrize("outcome", ["hit", "miss"])
def test_prefix_lookup_2048_tokens(benchmark, outcome):
    m = manager(16)
    prompt = list(range(2048))
    m.allocate(1, prompt)
    m.cache_full_blocks(1, prompt, 2048)
    query = prompt if outcome == "hit" else [99_999] + prompt[1:]
    hit = benchmark(m.lookup, query)
    assert hit.num_cached_tokens == (2032 if outcome == "hit" else 0)
    assert len(hit.hashes) == 128


@pytest.mark.parametrize("block_size", [16, 256])
def test_swap_out_and_in_1024_tokens(benchmark, block_size):
    m = manager(block_size, num_gpu_blocks=1024, num_cpu_blocks=1024)
    m.allocate(1, list(range(1024)))

    def swap_round_trip():
        out = m.swap_out([1])
        back = m.swap_in([1])
        return out, back

    out, back = benchmark(swap_round_trip)
    assert len(out) == len(back) == 1024 // block_size
    m.check_invariants()


@pytest.mark.parametrize("block_size", [16, 256])
def test_rust_hash_block(benchmark, block_size):
    """`HASH_ITERATIONS` chained hashes inside Rust per call; ns per block = median / iterations."""
    benchmark(_core._time_hash_block, block_size, HASH_ITERATIONS)
    benchmark.extra_info["ns_per_block"] = benchmark.stats.stats.median * 1e9 / HASH_ITERATIONS


@pytest.mark.parametrize("block_size", [16, 256])
def test_python_call_hash_block(benchmark, block_size):
    """One `hash_block` call from Python: the hash plus the call and list conversion."""
    tokens = list(range(block_size))
    benchmark(_core.hash_block, _core.ROOT_HASH, tokens)


def python_hash_block(parent: bytes, tokens: list[int], extra_key=None) -> bytes:
    # The pure-Python anchor: sha256 over the pickled (parent, tokens, extra) triple.
    return hashlib.sha256(pickle.dumps((parent, tuple(tokens), extra_key))).digest()


@pytest.mark.parametrize("block_size", [16, 256])
def test_pure_python_anchor_hash_block(benchmark, block_size):
    tokens = list(range(block_size))
    benchmark(python_hash_block, b"\0" * 32, tokens)
