"""Executors: how the model runs over its ranks, rank 0 always in the engine process.
`multiproc`: ranks 1..N-1 in spawned worker processes (one machine); `ray_executor`: ranks 1..N-1
as Ray actors in a placement group (one machine or several)."""

from __future__ import annotations


def create_executor(args, dtype):
    """The executor `args.distributed_executor_backend` names (Ray is imported only for "ray")."""
    if args.distributed_executor_backend == "ray":
        from pagedllm.executor.ray_executor import RayExecutor

        return RayExecutor(args, dtype)
    from pagedllm.executor.multiproc import MultiprocExecutor

    return MultiprocExecutor(args, dtype)
