"""`serve -dp 2 --data-parallel-backend ray` on a local Ray cluster (2 CPUs, no dashboard): the
replicas are Ray actors that serve and publish their KV events over TCP; one that ends during
start-up fails the start naming it; the actors and their placement group are gone once the
router returns. Skipped only where Ray is not installed."""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest
from router_util import MODEL, complete, wait_for

import pagedllm
from pagedllm.cli.app import _serve, build_parser
from pagedllm.router.ray_launcher import run_data_parallel_ray

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def cluster():
    # the actors import pagedllm from where this process does (a source checkout included)
    source = str(Path(pagedllm.__file__).parents[1])
    path = os.pathsep.join(p for p in (source, os.environ.get("PYTHONPATH")) if p)
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        logging_level="warning",
        runtime_env={"env_vars": {"PYTHONPATH": path}},
    )
    yield
    ray.shutdown()


def serve_args(*extra: str):
    argv = ["serve", "-dp", "2", "--data-parallel-backend", "ray", "--model", MODEL]
    argv += ["--max-model-len", "128", "--num-gpu-blocks", "32", "--cpu-threads", "1"]
    return build_parser().parse_args([*argv, "--log-level", "warning", *extra])


def test_replicas_are_ray_actors_that_serve_and_publish_events_over_tcp(cluster):
    seen = {}

    def run_router(urls):
        for url in urls:
            assert complete(url, "Hello", max_tokens=3).status_code == 200
            seen[url] = httpx.get(f"{url}/load", timeout=10).json()
        return 0

    assert run_data_parallel_ray(serve_args(), _serve, run_router) == 0
    assert len(seen) == 2
    endpoints = [load["kv_events"]["endpoint"] for load in seen.values()]
    assert all(e.startswith("tcp://") for e in endpoints) and len(set(endpoints)) == 2
    assert len({load["instance_id"] for load in seen.values()}) == 2


def test_stopping_kills_the_replicas_and_removes_their_placement_group(cluster):
    before = set(ray.util.placement_group_table())
    served = []
    assert run_data_parallel_ray(serve_args(), _serve, lambda urls: served.extend(urls) or 0) == 0
    groups = {k: v for k, v in ray.util.placement_group_table().items() if k not in before}
    assert len(groups) == 1 and all(g["state"] == "REMOVED" for g in groups.values())

    def down(url: str) -> bool:
        try:
            httpx.get(f"{url}/health", timeout=1)
        except httpx.TransportError:
            return True
        return False

    wait_for(lambda: all(down(url) for url in served), what="the replicas to stop")


def test_a_replica_that_ends_during_start_up_fails_the_start_naming_it(cluster):
    args = serve_args("--num-gpu-blocks", "1")  # too few blocks for one sequence: serve exits
    with pytest.raises(RuntimeError, match=r"data-parallel replica \d \(Ray actor\) ended"):
        run_data_parallel_ray(args, _serve, lambda urls: 0)
