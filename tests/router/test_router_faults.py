"""A replica that stops is taken out of rotation within seconds and its requests go elsewhere;
when it comes back (a new process on the same address) its part of the index is rebuilt from
its events and it serves again."""

from __future__ import annotations

import httpx
from router_util import cached_hashes, complete, replica, routed, stop, wait_for


def test_a_stopped_replica_is_routed_around_and_rejoins(tmp_path):
    port_b = None
    a = replica(tmp_path, "a")
    b = replica(tmp_path, "b")
    port_b = int(b.url.rsplit(":", 1)[1])
    try:
        with routed([a.url, b.url], policy="round_robin") as (router, state):
            for i in range(4):
                assert complete(router.url, f"warm {i}").status_code == 200
            stop(b)
            # every request still succeeds (sent to b: refused, retried on a)
            served = [complete(router.url, f"while b is down {i}") for i in range(4)]
            assert all(r.status_code == 200 for r in served)
            assert {r.headers["x-pagedllm-replica"] for r in served} == {"0"}
            wait_for(lambda: not state.replicas[1].alive, what="b to leave rotation")
            b = replica(tmp_path, "b", port=port_b)  # a new process at b's address
            wait_for(lambda: state.replicas[1].alive, what="b to rejoin")
            served = [complete(router.url, f"after b is back {i}") for i in range(4)]
            assert {r.headers["x-pagedllm-replica"] for r in served} == {"0", "1"}
            b.wait_idle()

            def rebuilt() -> bool:
                with state.lock:
                    ours = sorted(state.router.replica_hashes(1).tolist())
                return ours == cached_hashes(b.engine.engine)

            wait_for(rebuilt, what="b's index to match its new cache")
            metrics = httpx.get(f"{router.url}/metrics", timeout=10).text
            assert 'pagedllm_router:replica_up{engine="1"} 1.0' in metrics
    finally:
        stop(a)
        stop(b)
