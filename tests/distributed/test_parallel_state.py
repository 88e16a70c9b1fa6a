"""The process group's life in the engine's process: a join that failed (a rank never came)
leaves nothing behind, so the next engine's ranks still meet."""

from __future__ import annotations

import multiprocessing

import pytest
import torch

from pagedllm.distributed import parallel_state

CPU = torch.device("cpu")


def _rank_one(init_method: str, out) -> None:
    parallel_state.init_tensor_parallel(1, 2, init_method, device=CPU, timeout_s=60)
    out.put(parallel_state.all_reduce(torch.ones(3)).tolist())
    parallel_state.destroy_tensor_parallel()


def test_a_failed_join_does_not_stop_the_next_group_from_meeting():
    with pytest.raises(RuntimeError):  # rank 1 never comes
        parallel_state.init_tensor_parallel(
            0, 2, parallel_state.free_init_method(), device=CPU, timeout_s=1
        )
    assert not parallel_state.is_initialized()
    init_method = parallel_state.free_init_method()
    context = multiprocessing.get_context("spawn")
    out = context.Queue()
    worker = context.Process(target=_rank_one, args=(init_method, out), daemon=True)
    worker.start()
    try:
        parallel_state.init_tensor_parallel(0, 2, init_method, device=CPU, timeout_s=60)
        assert parallel_state.all_reduce(torch.ones(3)).tolist() == [2.0, 2.0, 2.0]
        assert out.get(timeout=60) == [2.0, 2.0, 2.0]
    finally:
        parallel_state.destroy_tensor_parallel()
        worker.join(timeout=30)
        if worker.is_alive():
            worker.kill()
