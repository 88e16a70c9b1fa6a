"""Randomized stateful test: Hypothesis drives KVCacheManager and a pure-Python reference model
side by side and compares every observable (tables, ref counts, free/cached blocks and their
eviction order, prefix-cache registrations and counters) plus check_invariants() after each step.

The model names blocks by the manager's ids. Which never-used free block an allocation takes is
the manager's choice (the model checks it was free and uncached); everything else, including
which cached block gets evicted, the model predicts.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
    run_state_machine_as_test,
)

from pagedllm import AllocStatus, KVCacheManager, PagedLLMError

MIN_OPERATIONS = 10_000

seq_ids = st.integers(0, 5)
extra_keys = st.sampled_from([0, 0, 0, 1])


@st.composite
def prompts(draw) -> list[int]:
    """Prompts of a few families that share leading tokens, so prefix hits are common."""
    family = draw(st.integers(0, 1))
    shared = draw(st.integers(0, 16))
    tail = draw(st.lists(st.integers(0, 5), max_size=6))
    tokens = [(family * 7 + i) % 11 for i in range(shared)] + tail
    return tokens or [family]


@dataclass
class SeqModel:
    tokens: list[int]
    extra_key: int
    table: list[int]
    swapped: bool = False
    num_registered: int = 0


@dataclass
class RefModel:
    """Pure-Python reference of the memory manager's observable behaviour."""

    block_size: int
    num_gpu: int
    num_cpu: int
    watermark_blocks: int
    caching: bool
    gpu_ref: list[int] = field(init=False)
    gpu_key: list = field(init=False)
    cache: dict = field(default_factory=dict)
    uncached_free: set = field(init=False)
    lru: list[int] = field(default_factory=list)  # cached blocks, evicted from the front
    cpu_ref: list[int] = field(init=False)
    cpu_free: set = field(init=False)
    seqs: dict[int, SeqModel] = field(default_factory=dict)
    queries: int = 0
    hits: int = 0
    misses: int = 0
    evictions: int = 0

    def __post_init__(self):
        self.gpu_ref = [0] * self.num_gpu
        self.gpu_key = [None] * self.num_gpu
        self.uncached_free = set(range(self.num_gpu))
        self.cpu_ref = [0] * self.num_cpu
        self.cpu_free = set(range(self.num_cpu))

    # -- helpers ------------------------------------------------------------------------------
    def num_free_gpu(self) -> int:
        return len(self.uncached_free) + len(self.lru)

    def blocks_for(self, slots: int) -> int:
        return -(-slots // self.block_size)

    def key(self, tokens: list[int], i: int, extra_key: int):
        # The whole prefix is the key: what the chained hash stands for, without collisions.
        return (extra_key, tuple(tokens[: (i + 1) * self.block_size]))

    def eligible(self, tokens: list[int]) -> int:
        return max(len(tokens) - 1, 0) // self.block_size

    def find(self, tokens: list[int], extra_key: int) -> list[int]:
        if not self.caching:
            return []
        hit = []
        for i in range(self.eligible(tokens)):
            block = self.cache.get(self.key(tokens, i, extra_key))
            if block is None:
                break
            hit.append(block)
        return hit

    def take_fresh(self, block: int) -> None:
        """The manager took `block` for new contents: it must be a never-used/uncached free
        block, or, when there is none, the head of the eviction queue."""
        if self.uncached_free:
            assert block in self.uncached_free, f"took block {block}, not an uncached free one"
            self.uncached_free.remove(block)
        else:
            assert self.lru and self.lru[0] == block, f"evicted {block}, expected {self.lru[:1]}"
            self.lru.pop(0)
            del self.cache[self.gpu_key[block]]
            self.gpu_key[block] = None
            self.evictions += 1
        self.gpu_ref[block] = 1

    def incref_gpu(self, block: int) -> None:
        if self.gpu_ref[block] == 0:
            self.lru.remove(block)  # revived by a prefix hit
        self.gpu_ref[block] += 1

    def decref_gpu(self, block: int) -> None:
        self.gpu_ref[block] -= 1
        if self.gpu_ref[block] == 0:
            if self.gpu_key[block] is not None:
                self.lru.append(block)
            else:
                self.uncached_free.add(block)

    def decref_cpu(self, block: int) -> None:
        self.cpu_ref[block] -= 1
        if self.cpu_ref[block] == 0:
            self.cpu_free.add(block)

    def group_error(self, seqs: list[int], swapped: bool):
        """Exception type the manager must raise for a swap group, or None if valid."""
        seen = set()
        for s in seqs:
            if s not in self.seqs or s in seen:
                return ValueError
            seen.add(s)
            if self.seqs[s].swapped != swapped:
                return PagedLLMError
        return None

    def distinct_blocks(self, seqs: list[int]) -> list[int]:
        out, seen = [], set()
        for s in seqs:
            for b in self.seqs[s].table:
                if b not in seen:
                    seen.add(b)
                    out.append(b)
        return out


class KVCacheManagerMachine(RuleBasedStateMachine):
    operations = 0

    @initialize(
        block_size=st.sampled_from([1, 2, 4]),
        num_gpu=st.integers(4, 24),
        num_cpu=st.integers(0, 32),
        watermark=st.sampled_from([0.0, 0.1]),
        caching=st.sampled_from([True, True, True, False]),
    )
    def setup(self, block_size, num_gpu, num_cpu, watermark, caching):
        self.m = KVCacheManager(
            num_gpu_blocks=num_gpu,
            block_size=block_size,
            num_cpu_blocks=num_cpu,
            watermark=watermark,
            enable_prefix_caching=caching,
        )
        self.model = RefModel(block_size, num_gpu, num_cpu, int(watermark * num_gpu), caching)
        assert self.m.watermark_blocks == self.model.watermark_blocks

    def _count(self):
        type(self).operations += 1

    def _seq(self, data, *, swapped=None) -> int:
        """Mostly an existing sequence (in the given location, if any), sometimes any id, so
        that both the working paths and the unknown-id errors are exercised."""
        existing = sorted(
            s for s, sm in self.model.seqs.items() if swapped is None or sm.swapped == swapped
        )
        if existing and data.draw(st.integers(0, 3)) > 0:
            return data.draw(st.sampled_from(existing))
        return data.draw(seq_ids)

    def _group(self, data, *, swapped: bool) -> list[int]:
        return [
            self._seq(data, swapped=swapped)
            for _ in range(data.draw(st.sampled_from([1, 1, 2, 3])))
        ]

    # -- rules --------------------------------------------------------------------------------
    @rule(
        seq=seq_ids,
        tokens=prompts(),
        extra_key=extra_keys,
        watermark=st.booleans(),
        register=st.booleans(),
    )
    def allocate(self, seq, tokens, extra_key, watermark, register):
        """Admission; with `register`, the prompt's full blocks are cached right away, as the
        scheduler does when it schedules the whole prompt."""
        self._count()
        md = self.model
        if seq in md.seqs:
            with pytest.raises(ValueError, match="already exists"):
                self.m.allocate(seq, tokens, extra_key=extra_key, apply_watermark=watermark)
            return
        hit = md.find(tokens, extra_key)
        if md.caching:
            md.queries += 1
            md.hits += len(hit)
            md.misses += md.eligible(tokens) - len(hit)
        total = md.blocks_for(len(tokens))
        needed = total - len(hit) + sum(md.gpu_ref[b] == 0 for b in hit)
        reserve = md.watermark_blocks if watermark else 0
        result = self.m.allocate(seq, tokens, extra_key=extra_key, apply_watermark=watermark)
        if md.num_free_gpu() < needed + reserve:
            assert result is None
            return
        assert result == len(hit) * md.block_size
        table = self.m.block_table(seq)
        assert len(table) == total and table[: len(hit)] == hit
        for b in hit:
            md.incref_gpu(b)
        for b in table[len(hit) :]:
            md.take_fresh(b)
        md.seqs[seq] = SeqModel(list(tokens), extra_key, table, num_registered=len(hit))
        if register:
            self._register(seq)

    @rule(data=st.data(), new_tokens=st.lists(st.integers(0, 5), min_size=1, max_size=6))
    def append(self, data, new_tokens):
        self._count()
        seq = self._seq(data, swapped=False)
        md = self.model
        s = md.seqs.get(seq)
        first = len(s.tokens) if s else 0
        last = first + len(new_tokens)
        if s is None:
            with pytest.raises(ValueError, match=f"unknown sequence id {seq}"):
                self.m.append_slots(seq, first, last)
            return
        if s.swapped:
            with pytest.raises(PagedLLMError, match="swapped out"):
                self.m.append_slots(seq, first, last)
            return
        bs = md.block_size
        target = md.blocks_for(last)
        cow = [
            i for i in range(first // bs, min(target, len(s.table))) if md.gpu_ref[s.table[i]] > 1
        ]
        grow = max(0, target - len(s.table))
        copies = self.m.append_slots(seq, first, last)
        if md.num_free_gpu() < len(cow) + grow:
            assert copies is None
            return
        new_table = self.m.block_table(seq)
        assert len(copies) == len(cow)
        for i, (src, dst) in zip(cow, copies):
            assert src == s.table[i] and new_table[i] == dst
            md.take_fresh(dst)
            md.decref_gpu(src)
        for b in new_table[len(s.table) :]:
            md.take_fresh(b)
        unchanged = [i for i in range(len(s.table)) if i not in cow]
        assert [new_table[i] for i in unchanged] == [s.table[i] for i in unchanged]
        s.table = new_table
        s.tokens.extend(new_tokens)

    @rule(data=st.data())
    def cache_full_blocks(self, data):
        self._count()
        seq = self._seq(data, swapped=False)
        md = self.model
        s = md.seqs.get(seq)
        if s is None:
            with pytest.raises(ValueError, match=f"unknown sequence id {seq}"):
                self.m.cache_full_blocks(seq, [0], 0)
            return
        if s.swapped:
            with pytest.raises(PagedLLMError, match="swapped out"):
                self.m.cache_full_blocks(seq, s.tokens, len(s.tokens), extra_key=s.extra_key)
            return
        self._register(seq)

    def _register(self, seq):
        md = self.model
        s = md.seqs[seq]
        full = len(s.tokens) // md.block_size
        expected = 0
        if md.caching and full > s.num_registered:
            for i in range(s.num_registered, full):
                key, block = md.key(s.tokens, i, s.extra_key), s.table[i]
                if md.gpu_key[block] is None and key not in md.cache:
                    md.cache[key] = block
                    md.gpu_key[block] = key
                    expected += 1
            s.num_registered = full
        assert (
            self.m.cache_full_blocks(seq, s.tokens, len(s.tokens), extra_key=s.extra_key)
            == expected
        )

    @rule(data=st.data(), child=seq_ids)
    def fork(self, data, child):
        self._count()
        parent = self._seq(data)
        md = self.model
        if parent not in md.seqs or parent == child or child in md.seqs:
            with pytest.raises(ValueError):
                self.m.fork(parent, child)
            return
        self.m.fork(parent, child)
        p = md.seqs[parent]
        md.seqs[child] = SeqModel(
            list(p.tokens), p.extra_key, list(p.table), p.swapped, p.num_registered
        )
        for b in p.table:
            if p.swapped:
                md.cpu_ref[b] += 1
            else:
                md.incref_gpu(b)

    @rule(data=st.data())
    def free(self, data):
        self._count()
        seq = self._seq(data)
        md = self.model
        s = md.seqs.pop(seq, None)
        if s is None:
            with pytest.raises(ValueError, match=f"unknown sequence id {seq}"):
                self.m.free(seq)
            return
        self.m.free(seq)
        for b in reversed(s.table):
            if s.swapped:
                md.decref_cpu(b)
            else:
                md.decref_gpu(b)

    @rule(data=st.data())
    def swap_out(self, data):
        self._count()
        seqs = self._group(data, swapped=False)
        md = self.model
        error = md.group_error(seqs, swapped=False)
        if error is not None:
            with pytest.raises(error):
                self.m.can_swap_out(seqs)
            with pytest.raises(error):
                self.m.swap_out(seqs)
            return
        distinct = md.distinct_blocks(seqs)
        fits = len(distinct) <= len(md.cpu_free)
        assert self.m.can_swap_out(seqs) == fits
        if not fits:
            with pytest.raises(PagedLLMError, match="out of host"):
                self.m.swap_out(seqs)
            return
        pairs = self.m.swap_out(seqs)
        assert [d for d, _ in pairs] == distinct, "each device block crosses exactly once"
        mapping = {}
        for device, host in pairs:
            assert host in md.cpu_free
            md.cpu_free.remove(host)
            mapping[device] = host
        for s in seqs:
            sm = md.seqs[s]
            for b in reversed(sm.table):
                md.cpu_ref[mapping[b]] += 1
                md.decref_gpu(b)
            sm.table = [mapping[b] for b in sm.table]
            sm.swapped = True

    @rule(data=st.data())
    def swap_in(self, data):
        self._count()
        seqs = self._group(data, swapped=True)
        md = self.model
        error = md.group_error(seqs, swapped=True)
        if error is not None:
            with pytest.raises(error):
                self.m.can_swap_in(seqs)
            with pytest.raises(error):
                self.m.swap_in(seqs)
            return
        distinct = md.distinct_blocks(seqs)
        if len(distinct) > md.num_gpu:
            expected = AllocStatus.NEVER
        elif md.num_free_gpu() < len(distinct) + md.watermark_blocks:
            expected = AllocStatus.LATER
        else:
            expected = AllocStatus.OK
        assert self.m.can_swap_in(seqs) == expected
        if len(distinct) > md.num_free_gpu():
            with pytest.raises(PagedLLMError, match="out of device"):
                self.m.swap_in(seqs)
            return
        pairs = self.m.swap_in(seqs)
        assert [h for h, _ in pairs] == distinct, "each host block crosses exactly once"
        mapping = {}
        for host, device in pairs:
            md.take_fresh(device)
            md.gpu_ref[device] = 0  # set from the table references below
            mapping[host] = device
        for s in seqs:
            sm = md.seqs[s]
            for b in sm.table:
                md.gpu_ref[mapping[b]] += 1
                md.decref_cpu(b)
            sm.table = [mapping[b] for b in sm.table]
            sm.swapped = False
            sm.num_registered = 0

    @rule(tokens=prompts(), extra_key=extra_keys)
    def lookup(self, tokens, extra_key):
        self._count()
        hit = self.m.lookup(tokens, extra_key=extra_key)
        expected = self.model.find(tokens, extra_key)
        assert hit.blocks == expected
        assert hit.num_cached_tokens == len(expected) * self.model.block_size

    @rule(data=st.data())
    def reset_prefix_cache(self, data):
        # Rare (1 in 5 draws), so that the cache usually lives long enough to be hit.
        if data.draw(st.integers(0, 4)) != 0:
            return
        self._count()
        md = self.model
        self.m.reset_prefix_cache()
        md.cache.clear()
        md.gpu_key = [None] * md.num_gpu
        md.uncached_free.update(md.lru)
        md.lru.clear()

    # -- checks after every step ----------------------------------------------------------------
    @invariant()
    def matches_reference_model(self):
        m, md = self.m, self.model
        m.check_invariants()
        assert m.num_free_gpu_blocks == md.num_free_gpu()
        assert m.num_free_cpu_blocks == len(md.cpu_free)
        assert m.evictable_blocks() == md.lru
        assert m.seq_ids() == sorted(md.seqs)
        for seq, s in md.seqs.items():
            assert m.block_table(seq) == s.table
            assert m.is_swapped(seq) == s.swapped
            assert len(s.table) == md.blocks_for(len(s.tokens))
        assert [m.ref_count(b) for b in range(md.num_gpu)] == md.gpu_ref
        assert [m.ref_count(b, device=False) for b in range(md.num_cpu)] == md.cpu_ref
        assert [m.block_hash(b) is not None for b in range(md.num_gpu)] == [
            k is not None for k in md.gpu_key
        ]
        stats = m.stats()
        assert (
            stats["prefix_cache_queries"],
            stats["prefix_cache_hits"],
            stats["prefix_cache_misses"],
            stats["prefix_cache_evictions"],
        ) == (md.queries, md.hits, md.misses, md.evictions)

    def teardown(self):
        # once every sequence has finished, every block of both pools is free.
        if not hasattr(self, "m"):
            return
        for seq in list(self.model.seqs):
            self.m.free(seq)
        self.m.check_invariants()
        assert self.m.num_free_gpu_blocks == self.m.num_gpu_blocks
        assert self.m.num_free_cpu_blocks == self.m.num_cpu_blocks


def test_random_operations_match_reference_model_and_keep_invariants():
    KVCacheManagerMachine.operations = 0
    start = time.perf_counter()
    run_state_machine_as_test(
        KVCacheManagerMachine,
        settings=settings(
            max_examples=200,
            stateful_step_count=100,
            deadline=None,
            database=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        ),
    )
    elapsed = time.perf_counter() - start
    print(f"{KVCacheManagerMachine.operations} operations in {elapsed:.1f} s")
    assert KVCacheManagerMachine.operations >= MIN_OPERATIONS
