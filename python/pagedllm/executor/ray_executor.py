"""The `ray` tensor-parallel executor: ranks 1..N-1 as Ray actors, rank 0 in the engine process.

The same ranks as the `mp` executor (a `worker.Worker` in each actor, `base.ParallelModelRunner`
in the engine), placed by Ray so that a model can span machines. Rank 0 stays in the engine
process, as with `mp`: the scheduler, sampling and rank 0's forward share one process, logits
never cross a process boundary, and rank 0's runner is the one `mp` uses; an actor for rank 0
would add a hop to every step for nothing.

Placement: one placement group, one bundle of 1 CPU per rank; bundle 0 is pinned to the engine's
node (Ray's `node:<ip>` resource) and held for rank 0, so the group reserves what the engine
uses there too; actor r runs in bundle r (`PACK`: as few nodes as fit). The ranks meet at rank
0's store on the engine's node (its Ray node address, a port rank 0 holds) and run their
collectives over torch.distributed (gloo on CPU).

Each step is put in Ray's object store once (`ray.put`: pickled once, whatever the number of
actors) and handed to one remote call per actor; `collect` takes the answers as they come. An
actor that dies fails its call at once (Ray's `ActorDiedError`), one that does not answer a step
within `tp_step_timeout` counts as hung (start-up: placing, meeting, loading, within
`EngineArgs.tp_startup_timeout`); an actor that raises returns its traceback. Each makes the
executor dead: `RankDiedError` naming the rank, now and at every later step. `shutdown()` kills
the actors, removes the placement group and, if the engine started Ray itself (no cluster was
running), stops Ray.

Ray is imported only here, and only when `distributed_executor_backend="ray"` asks for it.
"""

from __future__ import annotations

import atexit
import os
import time
import warnings
import weakref

import torch

from pagedllm.config import EngineArgs
from pagedllm.distributed import parallel_state
from pagedllm.executor.base import FAILED_STEP_GRACE_S, join_as_rank, join_as_rank_zero
from pagedllm.executor.errors import RankDiedError
from pagedllm.executor.supervisor import RayPlacement
from pagedllm.worker.worker import StepMessage

# seconds the cluster is given to place the group's bundles before the start fails
PLACEMENT_TIMEOUT_S = 60.0
# how a start-up call's silence is named in the error
STARTUP_BOUND = "the start-up timeout"


class RayRank:
    """Actor body: one worker rank (made a Ray actor by `RayExecutor`, so this module loads
    without Ray)."""

    def pid(self) -> int:
        return os.getpid()

    def join(
        self,
        rank: int,
        args: EngineArgs,
        dtype: torch.dtype,
        rendezvous: parallel_state.Rendezvous,
    ) -> None:
        self.worker = join_as_rank(rank, args, dtype, rendezvous)

    def allocate(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        self.worker.init_cache(num_gpu_blocks, num_cpu_blocks)

    def execute(self, message: StepMessage) -> None:
        with warnings.catch_warnings():
            # Ray hands over numpy arrays read-only (zero-copy); the runner only reads them
            warnings.filterwarnings("ignore", "The given NumPy array is not writable")
            self.worker.execute(message)


class RayExecutor:
    """Places ranks 1..N-1 as Ray actors and joins the group as rank 0 (in this process)."""

    def __init__(self, args: EngineArgs, dtype: torch.dtype) -> None:
        import ray

        self.ray = ray
        self.size = args.tensor_parallel_size
        self.timeout_s = args.tp_step_timeout
        self.startup_timeout_s = args.tp_startup_timeout
        self.dead: str | None = None  # why the executor can run no more steps
        self.placement: RayPlacement | None = None  # Ray, the group and the actors
        self._pending: list = []  # the running step's calls
        self._deadline = 0.0  # the running step's bound (monotonic seconds)
        self.on_death: list = []  # told of a rank's death between steps (`mp` only, for now)
        ref = weakref.ref(self)
        self._atexit = lambda: (executor := ref()) is not None and executor.shutdown()
        atexit.register(self._atexit)
        try:
            # a cluster started with `ray start` (or RAY_ADDRESS), else a local one we own
            self.placement = RayPlacement()
            host = ray.util.get_node_ip_address()
            self.placement.place(
                [{"CPU": 1, f"node:{host}": 0.001}] + [{"CPU": 1}] * (self.size - 1),
                "PACK",
                f"tensor_parallel_size={self.size} (one bundle on this node, {host})",
                PLACEMENT_TIMEOUT_S,
            )
            for rank in range(1, self.size):
                self.placement.start(rank, RayRank, num_cpus=1)
            # the rendezvous' port is ours from here on: engines side by side never collide
            store = parallel_state.open_rendezvous(self.size, self.startup_timeout_s, host)
            rendezvous = parallel_state.Rendezvous(host, store.port)
            joins = [
                a.join.remote(rank, args, dtype, rendezvous)
                for rank, a in enumerate(self.actors, start=1)
            ]
            self._join_group(store, joins)
            self._wait(joins, self.startup_timeout_s, STARTUP_BOUND)
        except BaseException:
            self.shutdown()
            raise

    @property
    def actors(self) -> list:
        """The live actors, rank 1 first (none once shut down)."""
        if self.placement is None:
            return []
        return [self.placement.actors[rank] for rank in sorted(self.placement.actors)]

    @property
    def group(self):
        """The placement group (None once removed)."""
        return None if self.placement is None else self.placement.group

    def _join_group(self, store, joins: list) -> None:
        """Join as rank 0 while watching the actors' join calls."""

        def watch() -> None:
            done, _ = self.ray.wait(joins, num_returns=len(joins), timeout=0.05)
            for ref in done:
                self._result(ref, joins.index(ref) + 1)

        join_as_rank_zero(self.size, store, self.timeout_s, self.startup_timeout_s, watch)

    def start_workers(self, num_gpu_blocks: int, num_cpu_blocks: int, rank_zero):
        """Give the actors the cache size rank 0 planned (every rank holds as many blocks);
        rank 0 allocates its own meanwhile."""
        self.check_health()
        allocations = [a.allocate.remote(num_gpu_blocks, num_cpu_blocks) for a in self.actors]
        local = rank_zero(num_gpu_blocks, num_cpu_blocks)
        self._wait(allocations, self.startup_timeout_s, STARTUP_BOUND)
        return local

    def pids(self) -> list[int]:
        """The actors' process ids, rank 1 first."""
        return self.ray.get([a.pid.remote() for a in self.actors], timeout=self.timeout_s)

    # ---- steps --------------------------------------------------------------------------------

    def broadcast_step(self, message: StepMessage) -> None:
        self.check_health()
        self._deadline = time.monotonic() + self.timeout_s
        step = self.ray.put(message)  # serialized once, read by every actor
        self._pending = [a.execute.remote(step) for a in self.actors]

    def collect(self, rank_zero_failed: bool = False) -> None:
        """The actors' answers to the step. Also after rank 0's own forward failed
        (`rank_zero_failed`): a collective that failed because an actor did is reported as that
        actor's failure, and only what is left of the step's bound is waited (at least
        `FAILED_STEP_GRACE_S`): a collective that timed out waited for the frozen rank already."""
        self.check_health()
        pending, self._pending = self._pending, []
        wait_s = None
        if rank_zero_failed:
            wait_s = max(self._deadline - time.monotonic(), FAILED_STEP_GRACE_S)
        self._wait(pending, self.timeout_s, wait_s=wait_s)

    def _wait(
        self,
        refs: list,
        timeout_s: float,
        bound: str = "tp_step_timeout",
        wait_s: float | None = None,
    ) -> None:
        """Every call's result, taken as each arrives (rank r's call is `refs[r - 1]`): the first
        death or error kills at once; silence past `timeout_s` (named `bound`; `wait_s` when
        given) kills too."""
        rank_of = {ref: rank for rank, ref in enumerate(refs, start=1)}
        deadline = time.monotonic() + (timeout_s if wait_s is None else wait_s)
        pending = list(refs)
        while pending:
            done, pending = self.ray.wait(
                pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic())
            )
            if not done:
                rank = min(rank_of[ref] for ref in pending)
                self._die(
                    f"tensor-parallel rank {rank} did not answer within {bound} ({timeout_s:g}s)"
                )
            for ref in done:
                self._result(ref, rank_of[ref])

    def _result(self, ref, rank: int) -> None:
        exceptions = self.ray.exceptions
        try:
            self.ray.get(ref)
        except exceptions.RayActorError as exc:
            self._die(f"tensor-parallel rank {rank} (Ray actor) died: {exc}")
        except exceptions.RayTaskError as exc:
            self._die(f"tensor-parallel rank {rank} failed:\n{exc}")

    def check_health(self) -> None:
        """RankDiedError when the executor is dead."""
        if self.dead is not None:
            raise RankDiedError(self.dead)

    def _die(self, reason: str):
        self.dead = reason
        self.shutdown()
        raise RankDiedError(reason)

    # ---- shutdown -----------------------------------------------------------------------------

    def __del__(self) -> None:
        # the engine (an `LLM`) dropped without shutdown(): its actors go with it
        if getattr(self, "placement", None) is not None and self.group is not None:
            self.shutdown()

    def shutdown(self) -> None:
        """Kill the actors, remove the placement group, leave the process group; stop Ray if
        this executor started it (`supervisor.RayPlacement`). Idempotent."""
        atexit.unregister(self._atexit)
        if self.placement is not None:
            self.placement.release()
        parallel_state.destroy_tensor_parallel()
        if self.dead is None:
            self.dead = "the engine was shut down"
