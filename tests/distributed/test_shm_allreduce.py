"""The shared-memory all-reduce of ranks on one host (`parallel_state` over `_core.ShmAllReduce`,
2 spawned ranks): gloo's sums, nothing left in /dev/shm, a dead rank failing the others at once,
the knob forcing gloo."""

from __future__ import annotations

import glob
import multiprocessing
import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

from pagedllm.distributed import parallel_state

CHUNK_FLOATS = parallel_state.SHM_CHUNK_BYTES // 4
# from one element to several chunks, none of the larger ones a multiple of a chunk
SHAPES = [
    (1,),
    (7,),
    (3, 5, 7),
    (4096,),
    (CHUNK_FLOATS,),
    (2, CHUNK_FLOATS + 3),
    (CHUNK_FLOATS * 3 - 5,),
]


def _segments(pid: int) -> list[str]:
    return glob.glob(f"/dev/shm/pagedllm-allreduce-{pid}-*")


def _join(rank: int, rendezvous, env: str | None, timeout_s: float = 30.0) -> None:
    if env is not None:
        os.environ[parallel_state.CPU_ALLREDUCE_ENV] = env
    parallel_state.init_tensor_parallel(
        rank, 2, rendezvous, device=torch.device("cpu"), timeout_s=timeout_s, startup_timeout_s=120
    )


def _compare_with_gloo(rank: int, rendezvous, results) -> None:
    """Each shape and dtype: the shm sum and gloo's of the same per-rank inputs."""
    _join(rank, rendezvous, None)
    worst = {}
    for dtype in (torch.float32, torch.bfloat16):
        for shape in SHAPES:
            gen = torch.Generator().manual_seed(hash((rank, shape)) % 2**31)
            x = torch.randn(shape, generator=gen).to(dtype)
            reference = x.clone()
            dist.all_reduce(reference)  # gloo
            parallel_state.all_reduce(x)
            worst[(str(dtype), shape)] = (x.float() - reference.float()).abs().max().item()
    results.put((rank, parallel_state.uses_shm_allreduce(), worst, x.sum().item()))
    parallel_state.destroy_tensor_parallel()


def _gather_both_ways(rank: int, rendezvous, results) -> None:
    """Rank 0: the shm gather of each dtype's parts against gloo's gather of the same parts."""
    _join(rank, rendezvous, None)
    gloo_gather = dist.gather
    dist.gather = None  # (this process only) the gather must not go through gloo
    same = {}
    for dtype in (torch.float32, torch.bfloat16):
        x = (torch.randn(5, 300, generator=torch.Generator().manual_seed(rank)) - 0.5).to(dtype)
        parts = [torch.empty_like(x) for _ in range(2)] if rank == 0 else None
        gloo_gather(x, parts, dst=0)
        got = parallel_state.gather_to_first(x)
        if rank == 0:
            same[str(dtype)] = torch.equal(got, torch.cat(parts, dim=-1))
        else:
            same[str(dtype)] = got is None
    results.put((rank, parallel_state.uses_shm_allreduce(), same))
    parallel_state.destroy_tensor_parallel()


def _report_path(rank: int, rendezvous, env: str, results) -> None:
    _join(rank, rendezvous, env)
    results.put((rank, parallel_state.uses_shm_allreduce()))
    parallel_state.destroy_tensor_parallel()


def _reduce_until_failure(rank: int, rendezvous, results) -> None:
    """Reduce until a peer vanishes; report how it failed."""
    _join(rank, rendezvous, None)
    results.put(("joined", rank, os.getpid()))
    x = torch.ones(1000)
    try:
        while True:
            parallel_state.all_reduce(x)
            x.fill_(1.0)
    except Exception as exc:  # noqa: BLE001 - the failure is the result
        results.put(("failed", rank, type(exc).__name__, str(exc)))


def _abort_or_reduce(rank: int, rendezvous, results) -> None:
    """Rank 1 gives up; rank 0 reports how its all-reduce ended and how long it took."""
    _join(rank, rendezvous, None)
    if rank == 1:
        time.sleep(0.5)
        parallel_state.abort()
        return
    start = time.monotonic()
    try:
        parallel_state.all_reduce(torch.ones(10))
        results.put(("reduced", time.monotonic() - start))
    except ConnectionError as exc:
        results.put((str(exc), time.monotonic() - start))


_store = None


def _spawn(target, *args):
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    global _store
    # the ranks meet at a store this process holds (until the next spawn)
    _store = parallel_state.open_rendezvous(2, 120)
    rendezvous = parallel_state.Rendezvous("127.0.0.1", _store.port)
    procs = [
        context.Process(target=target, args=(rank, rendezvous, *args, results), daemon=True)
        for rank in range(2)
    ]
    for proc in procs:
        proc.start()
    return procs, results


def _finish(procs) -> None:
    for proc in procs:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
            proc.join()


def test_shm_sums_equal_gloos_for_every_shape_and_dtype():
    procs, results = _spawn(_compare_with_gloo)
    try:
        got = sorted(results.get(timeout=120) for _ in procs)
    finally:
        _finish(procs)
    for _, used_shm, worst, _ in got:
        assert used_shm
        for (dtype, shape), diff in worst.items():
            tolerance = 1e-5 if dtype == "torch.float32" else 1e-2
            assert diff <= tolerance, (dtype, shape, diff)
    # both ranks hold the same result
    assert got[0][3] == got[1][3]


def test_the_shm_gather_to_rank_0_equals_gloos_bit_for_bit():
    procs, results = _spawn(_gather_both_ways)
    try:
        got = sorted(results.get(timeout=120) for _ in procs)
    finally:
        _finish(procs)
    for _, used_shm, same in got:
        assert used_shm
        assert same == {"torch.float32": True, "torch.bfloat16": True}


def test_no_segment_is_left_after_shutdown():
    procs, results = _spawn(_report_path, "shm")
    try:
        assert [used for _, used in sorted(results.get(timeout=120) for _ in procs)] == [True] * 2
    finally:
        _finish(procs)
    assert _segments(procs[0].pid) == []
    assert all(proc.exitcode == 0 for proc in procs)


def test_the_knob_forces_gloo():
    procs, results = _spawn(_report_path, "gloo")
    try:
        assert [used for _, used in sorted(results.get(timeout=120) for _ in procs)] == [False] * 2
    finally:
        _finish(procs)


def test_an_unknown_knob_value_is_refused(monkeypatch):
    monkeypatch.setenv(parallel_state.CPU_ALLREDUCE_ENV, "mpi")
    with pytest.raises(ValueError, match="PAGEDLLM_CPU_ALLREDUCE must be one of shm, gloo"):
        parallel_state.cpu_allreduce_choice()


def test_a_killed_rank_fails_the_other_at_once_and_leaves_no_segment():
    procs, results = _spawn(_reduce_until_failure)
    try:
        joined = {results.get(timeout=120)[1] for _ in procs}
        assert joined == {0, 1}
        time.sleep(0.2)  # both reducing
        os.kill(procs[1].pid, signal.SIGKILL)
        start = time.monotonic()
        kind, rank, error, message = results.get(timeout=20)
        # noticed from the process, long before the 30 s timeout
        assert time.monotonic() - start < 5.0
        assert (kind, rank, error) == ("failed", 0, "ConnectionError")
        assert f"rank 1 (pid {procs[1].pid}) died" in message
    finally:
        _finish(procs)
    assert _segments(procs[0].pid) == []


def test_a_rank_that_aborts_fails_the_others_all_reduce_at_once():
    procs, results = _spawn(_abort_or_reduce)
    try:
        outcome, seconds = results.get(timeout=120)
    finally:
        _finish(procs)
    assert outcome == "a peer aborted the shared-memory group"
    assert seconds < 10.0  # the timeout is 30 s


def test_a_group_that_fails_while_joining_leaves_no_segment(monkeypatch):
    def peer_gone(*args, **kwargs):
        raise RuntimeError("connection reset by peer")

    monkeypatch.setattr(dist, "broadcast_object_list", peer_gone)
    with pytest.raises(RuntimeError, match="connection reset"):
        parallel_state._join_shm_allreduce(0, 2, timeout_s=5.0)
    assert _segments(os.getpid()) == []
