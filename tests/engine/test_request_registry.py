"""`RequestRegistry`: the one owner of the engine's live requests. Its parts read it as a mapping
and end requests only through its methods, which keep the scheduler and the Python-side state
in step."""

from __future__ import annotations

import time

import pytest

from pagedllm.engine.registry import RequestRegistry
from pagedllm.engine.request import RequestState, StopTokens
from pagedllm.sampling_params import SamplingParams

from scheduler_util import make, prompt, step


def queued(
    scheduler, registry: RequestRegistry, request_id: str, n: int = 1, tag: int | None = None
) -> RequestState:
    """A request queued in the scheduler and added to the registry, as `add_request` does."""
    params = SamplingParams(n=n, max_tokens=8)
    tokens = prompt(len(registry) if tag is None else tag, 6)
    stop = StopTokens.of(params, [])
    request = RequestState.new(request_id, None, tokens, params, stop, time.time(), None)
    scheduler.add_request(request_id, tokens, n=n, max_tokens=8)
    registry.add(request)
    return request


@pytest.fixture
def scheduler():
    return make(num_gpu_blocks=32)


def test_registry_refuses_item_assignment_and_deletion(scheduler):
    registry = RequestRegistry(scheduler)
    request = queued(scheduler, registry, "a")
    with pytest.raises(TypeError):
        registry["b"] = request
    with pytest.raises(TypeError):
        del registry["a"]
    assert list(registry) == ["a"] and registry.get("a") is request


def test_abort_ends_the_request_in_the_scheduler_and_every_sequence(scheduler):
    registry = RequestRegistry(scheduler)
    request = queued(scheduler, registry, "a", n=2)
    assert registry.abort("a", "why") is request
    assert not scheduler.has_unfinished_requests()
    assert [(s.finish_reason, s.stop_reason) for s in request.seqs] == [("abort", "why")] * 2
    assert request.finished and request.metrics.finished_time is not None
    assert registry.num_unfinished() == 0


def test_finish_leaves_the_scheduler_alone(scheduler):
    registry = RequestRegistry(scheduler)
    request = queued(scheduler, registry, "a")
    registry.finish("a", "length", "prompt too long")
    assert scheduler.has_unfinished_requests()
    assert (request.seqs[0].finish_reason, request.seqs[0].stop_reason) == (
        "length",
        "prompt too long",
    )


def test_finish_seq_sets_the_finish_time_with_the_last_sequence(scheduler):
    registry = RequestRegistry(scheduler)
    request = queued(scheduler, registry, "a", n=2)
    registry.finish_seq("a", 1, "stop", 7)
    assert not request.finished and request.metrics.finished_time is None
    assert (request.seqs[1].finish_reason, request.seqs[1].stop_reason) == ("stop", 7)
    registry.finish_seq("a", 0, "length", None)
    assert request.finished and request.metrics.finished_time is not None


def test_release_drops_the_request(scheduler):
    registry = RequestRegistry(scheduler)
    queued(scheduler, registry, "a")
    queued(scheduler, registry, "b")
    registry.abort("a")
    registry.release("a")
    assert "a" not in registry and list(registry) == ["b"] and len(registry) == 1


def test_first_scheduled_records_time_in_queue_and_cached_tokens(scheduler):
    registry = RequestRegistry(scheduler)
    queued(scheduler, registry, "a", tag=0)
    step(scheduler)  # "a"'s prompt (one full block of 4) is now in the prefix cache
    request = queued(scheduler, registry, "b", tag=0)
    scheduler.schedule()
    now = request.metrics.arrival_time + 2.5
    registry.first_scheduled("b", now)
    assert request.metrics.first_scheduled_time == now
    assert request.metrics.time_in_queue == pytest.approx(2.5)
    assert request.num_cached_tokens == 4


def test_preempted_counts_preemptions(scheduler):
    registry = RequestRegistry(scheduler)
    request = queued(scheduler, registry, "a")
    registry.preempted("a")
    registry.preempted("a")
    assert request.metrics.num_preemptions == 2
