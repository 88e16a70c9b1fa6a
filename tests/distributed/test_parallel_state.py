"""The process group's life in the engine's process: a join that failed or is still pending (an
engine whose start failed: a rank never came) does not stop the next engine's ranks meeting."""

from __future__ import annotations

import multiprocessing
import threading

import pytest
import torch

from pagedllm.distributed import parallel_state

CPU = torch.device("cpu")


def _rank_one(init_method: str, out) -> None:
    parallel_state.init_tensor_parallel(1, 2, init_method, device=CPU, timeout_s=60)
    out.put(parallel_state.all_reduce(torch.ones(3)).tolist())
    parallel_state.destroy_tensor_parallel()


def _meet_a_fresh_rank() -> None:
    """Rank 0 here, rank 1 a freshly spawned process: both sum a tensor."""
    init_method = parallel_state.free_init_method()
    context = multiprocessing.get_context("spawn")
    out = context.Queue()
    worker = context.Process(target=_rank_one, args=(init_method, out), daemon=True)
    worker.start()
    try:
        parallel_state.init_tensor_parallel(0, 2, init_method, device=CPU, timeout_s=30)
        assert parallel_state.all_reduce(torch.ones(3)).tolist() == [2.0, 2.0, 2.0]
        assert out.get(timeout=30) == [2.0, 2.0, 2.0]
    finally:
        parallel_state.destroy_tensor_parallel()
        worker.join(timeout=30)
        if worker.is_alive():
            worker.kill()


def _join_alone(timeout_s: float) -> None:
    """Rank 0 of 2 waiting for a rank 1 that never comes."""
    parallel_state.init_tensor_parallel(
        0, 2, parallel_state.free_init_method(), device=CPU, timeout_s=timeout_s
    )


def test_a_failed_join_does_not_stop_the_next_group_from_meeting():
    with pytest.raises(RuntimeError):
        _join_alone(1)
    assert not parallel_state.is_initialized()
    _meet_a_fresh_rank()


def test_a_join_still_pending_does_not_stop_the_next_group_from_meeting():
    # an engine whose worker died before joining: rank 0's join waits on in its thread
    failed = []
    pending = threading.Thread(
        target=lambda: pytest.raises(RuntimeError, _join_alone, 40) and failed.append(1),
        daemon=True,
    )
    pending.start()
    try:
        _meet_a_fresh_rank()
    finally:
        pending.join(timeout=60)
    assert failed == [1]
