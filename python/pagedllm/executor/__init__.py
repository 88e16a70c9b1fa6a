"""Executors: how rank 0's steps reach the model's other ranks (every rank a `worker.Worker`,
rank 0's in the engine process). `base`: the protocol the engine uses, `UniprocExecutor` (one
rank) and rank 0's `ParallelModelRunner`; `multiproc`: ranks 1..N-1 in spawned processes (one
machine), their lives kept by `supervisor.ProcessSupervisor`; `ray_executor`: ranks 1..N-1 as Ray
actors in a placement group (one machine or several); `errors`: the failure vocabulary."""

from __future__ import annotations


def create_executor(args, dtype):
    """The executor for `args.tensor_parallel_size` ranks over the backend
    `args.distributed_executor_backend` names (Ray is imported only for "ray")."""
    if args.tensor_parallel_size == 1:
        from pagedllm.executor.base import UniprocExecutor

        return UniprocExecutor()
    if args.distributed_executor_backend == "ray":
        from pagedllm.executor.ray_executor import RayExecutor

        return RayExecutor(args, dtype)
    from pagedllm.executor.multiproc import MultiprocExecutor

    return MultiprocExecutor(args, dtype)
