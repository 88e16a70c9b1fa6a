"""The Rust router core through its bindings: policies by name, event batches' status codes,
routing by the prompt's chained block hashes (the cache's own function, LoRA salt included)."""

from __future__ import annotations

import numpy as np
import pytest

from pagedllm._core import (
    KV_EVENT_STORED,
    ROUTING_POLICIES,
    PagedLLMError,
    Router,
    hash_block_chain,
    lora_hash_key,
)

STORED = np.array([KV_EVENT_STORED], np.uint8)


def stored(router: Router, replica: int, seq: int, hashes: list[int]) -> int:
    return router.apply_events(
        replica, seq, STORED, np.array([0, len(hashes)], np.uint32), np.array(hashes, np.uint64)
    )


def test_the_policies_are_named_and_an_unknown_one_is_refused():
    assert ROUTING_POLICIES == ["cache_aware", "least_loaded", "round_robin", "session"]
    with pytest.raises(ValueError, match="routing_policy must be one of"):
        Router(2, 16, "random")
    with pytest.raises(ValueError, match="num_replicas"):
        Router(0, 16)


def test_a_prompt_goes_where_its_blocks_are_hashed_as_the_cache_hashes_them():
    router = Router(2, 4, pending_ttl=0.0)
    prompt = list(range(100, 113))
    assert stored(router, 1, 0, hash_block_chain(prompt, 4)) == -1
    assert router.route(prompt)[:4] == (1, 3, 3, 1)  # 13 tokens, 12 of them cached
    salted = hash_block_chain(prompt, 4, lora_hash_key(7))
    assert stored(router, 0, 0, salted) == -1
    assert router.route(prompt, lora_id=7)[0] == 0


def test_apply_events_says_applied_stale_or_where_to_replay_from():
    router = Router(1, 4)
    assert stored(router, 0, 0, [1]) == -1
    assert stored(router, 0, 0, [1]) == -2
    assert stored(router, 0, 5, [2]) == 1
    with pytest.raises(ValueError, match="starts"):
        router.apply_events(0, 1, STORED, np.array([0], np.uint32), np.array([], np.uint64))


def test_no_live_replica_is_an_error():
    router = Router(1, 4)
    router.set_alive(0, False)
    with pytest.raises(PagedLLMError, match="no live replica"):
        router.route([1, 2, 3])


def test_a_requests_uncached_tokens_are_in_flight_from_route_to_finish():
    router = Router(2, 4, "round_robin")
    replica, _, _, uncached, ticket = router.route(list(range(10)))
    assert uncached == 10
    assert router.stats()[replica]["uncached_tokens"] == 10
    router.finish(ticket)
    assert router.stats()[replica]["uncached_tokens"] == 0


def test_a_token_weight_outside_zero_to_one_is_refused_by_name():
    with pytest.raises(ValueError, match="token_weight"):
        Router(2, 4, token_weight=1.5)


def test_a_routed_prompts_blocks_are_pending_on_its_replica_until_it_finishes():
    router = Router(2, 4)
    replica, _, _, _, ticket = router.route(list(range(9)))
    assert router.num_pending(replica) == 2
    router.finish(ticket)
    assert router.num_pending(replica) == 0
    with pytest.raises(ValueError, match=f"ticket {ticket + 1} was never issued"):
        router.finish(ticket + 1)
