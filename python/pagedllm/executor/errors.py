"""The failure vocabulary of the engine's processes: tensor-parallel ranks (the `mp` and `ray`
executors), data-parallel replicas (the `serve -dp` launchers, `LLM(data_parallel_size=N)`) and
the server's engine loop. Everything that reports such a failure raises one of these, and
everything that reacts to one catches it from here.

    EngineDeadError          the engine can run no more steps (it is gone for good)
    ├── RankDiedError        a tensor-parallel rank died, hung or failed
    └── ReplicaDiedError     a data-parallel replica's process ended while it had work
    WorkerStartupError       ranks or replicas that could not be started (placed, spawned, met)

Each is a `RuntimeError`, as the bare `RuntimeError`s they replace were. The process supervisor
(`supervisor.ProcessSupervisor`, under every `mp` rank and replica) reports a child as
`ChildFailed`; its users name it here: a rank's failure is `RankDiedError`, a replica's death
`ReplicaDiedError` (under Ray too), a child silent past its start-up deadline (killed)
`WorkerStartupError`.
"""

from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The engine can run no more steps: a rank or replica it needs is gone, its loop stopped, or
    it was shut down. A server answers 503 and exits; nothing retries."""


class RankDiedError(EngineDeadError):
    """A tensor-parallel rank died, hung or failed (the message names it): the ranks are out of
    step, so the engine cannot run another one."""


class ReplicaDiedError(EngineDeadError):
    """A data-parallel replica process ended while it had work (or during start-up)."""


class WorkerStartupError(RuntimeError):
    """Ranks or replicas could not be started: not placed, not spawned, or not ready in time."""
