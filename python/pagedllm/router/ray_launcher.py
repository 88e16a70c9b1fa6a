"""`pagedllm serve -dp N --data-parallel-backend ray`: the N replicas as Ray actors, placed across
a Ray cluster's nodes, behind the router in this process.

Each actor runs `serve` (one engine, its HTTP server on its node's address and a port free
there, its KV events on TCP ports free there unless `--kv-events-config` names them: each TCP
port + its rank) in its main thread, so the call lasts as long as the replica: one that ends
or dies during start-up fails the start naming it; afterwards the router's health polls take
a dead one out of rotation, as with `mp`, and a replica whose actor dies or whose `serve`
ends is started again in a new actor on its bundle, on its old address (`launcher.Supervisor`:
the same back-off; a bundle that moved to another node, its old one lost, is not: the router
knows the replica at its old address). Placement: one placement group, one bundle per
replica of as many CPUs as its threads (`SPREAD`: over as many nodes as there are); when the
router returns, the actors are killed, the group removed and, if this process started Ray
itself (no cluster was running), Ray stopped: `executor.supervisor.RayPlacement`, which the `ray`
tensor-parallel executor's ranks run on too. A replica that ends is a `ReplicaDiedError`, as
with `mp`.

Ray is imported only here, and only when `--data-parallel-backend ray` asks for it.
"""

from __future__ import annotations

import argparse
import copy
import logging
from collections.abc import Callable

from pagedllm.executor.errors import ReplicaDiedError, WorkerStartupError
from pagedllm.executor.supervisor import RayPlacement
from pagedllm.router.launcher import (
    Supervisor,
    _free_port,
    replica_cpu_threads,
    replica_events_config,
    wait_healthy,
)

logger = logging.getLogger(__name__)
# seconds the cluster is given to place the replicas' bundles before the start fails
PLACEMENT_TIMEOUT_S = 60.0


class RayServeReplica:
    """Actor body: one `serve` replica (made a Ray actor by `run_data_parallel_ray`, so this
    module loads without Ray)."""

    def place(self, args: argparse.Namespace, rank: int) -> argparse.Namespace:
        """`serve`'s arguments on this actor's node: its address, free ports, its events."""
        import ray

        ns = copy.copy(args)
        ns.data_parallel_size = 1
        ns.data_parallel_backend = "mp"
        ns.host = ray.util.get_node_ip_address()
        ns.port = _free_port(ns.host)
        ns.kv_events_config = replica_events_config(
            args.kv_events_config,
            rank,
            f"tcp://*:{_free_port(ns.host)}",
            f"tcp://*:{_free_port(ns.host)}",
        )
        return ns

    def serve(self, serve_replica: Callable[[argparse.Namespace], int], ns) -> int:
        return serve_replica(ns)

    def node_ip(self) -> str:
        import ray

        return ray.util.get_node_ip_address()


def run_data_parallel_ray(
    args: argparse.Namespace,
    serve_replica: Callable[[argparse.Namespace], int],
    run_router: Callable[[list[str]], int],
) -> int:
    """Starts `args.data_parallel_size` replica actors (`serve_replica(namespace)` in each),
    waits until all answer /health, then `run_router(urls)` here; stops them when it returns."""
    import ray

    size = args.data_parallel_size
    threads = replica_cpu_threads(args.cpu_threads, args.device, size) or 1
    placement = RayPlacement()
    try:
        placement.place(
            [{"CPU": threads}] * size,
            "SPREAD",
            f"data_parallel_size={size}",
            PLACEMENT_TIMEOUT_S,
        )

        def restart(rank: int) -> None:
            actor = placement.start(rank, RayServeReplica, num_cpus=threads)
            node = ray.get(actor.node_ip.remote(), timeout=PLACEMENT_TIMEOUT_S)
            if node != placed[rank].host:
                raise WorkerStartupError(f"its bundle is on {node} now, not {placed[rank].host}")
            runs[rank] = actor.serve.remote(serve_replica, placed[rank])

        actors = [placement.start(rank, RayServeReplica, num_cpus=threads) for rank in range(size)]
        placed = ray.get([a.place.remote(args, rank) for rank, a in enumerate(actors)])
        for ns in placed:
            ns.cpu_threads = threads
        runs = [a.serve.remote(serve_replica, ns) for a, ns in zip(actors, placed)]
        urls = [f"http://{ns.host}:{ns.port}" for ns in placed]
        wait_healthy(urls, lambda: _check_actors(ray, runs))
        logger.info("data-parallel replicas (Ray actors) up: %s", ", ".join(urls))

        def ended() -> list[tuple[int, str]]:
            return [
                (rank, f"(Ray actor) ended ({status})") for rank, status in _ended_actors(ray, runs)
            ]

        with Supervisor(size, ended, restart):
            return run_router(urls)
    finally:
        placement.release()


def _ended_actors(ray, runs: list) -> list[tuple[int, str]]:
    """(rank, status) for each replica whose `serve` call ended (it exited or its actor died)."""
    done, _ = ray.wait(runs, num_returns=len(runs), timeout=0)
    ended = []
    for ref in done:
        try:
            status = f"status {ray.get(ref)}"
        except ray.exceptions.RayError as exc:
            status = f"{type(exc).__name__}: {exc}"
        ended.append((runs.index(ref), status))
    return ended


def _check_actors(ray, runs: list) -> None:
    """A replica that ended during start-up fails the start naming it."""
    for rank, status in _ended_actors(ray, runs):
        raise ReplicaDiedError(
            f"data-parallel replica {rank} (Ray actor) ended during start-up ({status})"
        )
