"""The process group's life in the engine's process: a join that failed or is still pending (an
engine whose start failed: a rank never came) does not stop the next engine's ranks meeting."""

from __future__ import annotations

import multiprocessing
import socket
import threading
import time

import pytest
import torch

from pagedllm.distributed import parallel_state

CPU = torch.device("cpu")


def _rank_one(rendezvous, out, delay_s: float = 0.0) -> None:
    time.sleep(delay_s)  # a rank slow to start (a loaded machine)
    parallel_state.init_tensor_parallel(
        1, 2, rendezvous, device=CPU, timeout_s=60, startup_timeout_s=120
    )
    out.put(parallel_state.all_reduce(torch.ones(3)).tolist())
    parallel_state.destroy_tensor_parallel()


def _meet_a_fresh_rank(step_timeout_s: float = 30, delay_s: float = 0.0) -> None:
    """Rank 0 here, rank 1 a freshly spawned process: both sum a tensor."""
    store = parallel_state.open_rendezvous(2, 120)
    context = multiprocessing.get_context("spawn")
    out = context.Queue()
    rendezvous = parallel_state.Rendezvous("127.0.0.1", store.port)
    worker = context.Process(target=_rank_one, args=(rendezvous, out, delay_s), daemon=True)
    worker.start()
    try:
        parallel_state.init_tensor_parallel(
            0, 2, store, device=CPU, timeout_s=step_timeout_s, startup_timeout_s=120
        )
        assert parallel_state.all_reduce(torch.ones(3)).tolist() == [2.0, 2.0, 2.0]
        assert out.get(timeout=30) == [2.0, 2.0, 2.0]
    finally:
        parallel_state.destroy_tensor_parallel()
        worker.join(timeout=30)
        if worker.is_alive():
            worker.kill()


def _join_alone(timeout_s: float) -> None:
    """Rank 0 of 2 waiting for a rank 1 that never comes."""
    store = parallel_state.open_rendezvous(2, timeout_s)
    parallel_state.init_tensor_parallel(
        0, 2, store, device=CPU, timeout_s=timeout_s, startup_timeout_s=timeout_s
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


def test_a_rank_slower_to_start_than_the_step_timeout_still_joins():
    # the step timeout bounds collectives, not the wait for a rank still starting
    _meet_a_fresh_rank(step_timeout_s=1, delay_s=3.0)


def test_the_rendezvous_port_is_held_from_the_moment_it_is_chosen():
    # nothing else (another engine's rendezvous) can take it before the ranks arrive
    store = parallel_state.open_rendezvous(2, 5)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock, pytest.raises(OSError):
        sock.bind(("127.0.0.1", store.port))
