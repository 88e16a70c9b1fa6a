"""`pagedllm serve -dp N` with the `mp` backend: N `serve` processes on this machine (one engine
each, on a free local port, KV events on ipc sockets unless `--kv-events-config` says where,
each TCP port + its rank) behind the router in this process, on the address `serve` was given.
The ipc sockets are files in a folder only this user can enter (`socket_folder`), removed at
exit; when this process is killed outright its replicas exit and remove the folder.

The replicas' processes are `executor.supervisor.ProcessSupervisor` children, as the `mp`
executor's ranks are (`ReplicaProcesses`): each is tied to this process from its first
instruction (`lifeline.run_tied`: it exits when this process dies, even while it imports; then
the kernel sends it SIGTERM), its start-up is watched on its sentinel beside the /health polls,
and it is stopped by SIGTERM, its shutdown grace, then SIGKILL. `LLM(data_parallel_size=N)`'s
replicas (`router/offline.py`) start the same way (`replica_lifeline`).

A replica that fails to start stops the whole start (`ReplicaDiedError` with its exit status;
one not up within START_TIMEOUT_S: `WorkerStartupError`); SIGINT/SIGTERM stop the router, then
the replicas.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import logging
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from multiprocessing import connection

import httpx

from pagedllm.executor.errors import ReplicaDiedError, WorkerStartupError
from pagedllm.executor.lifeline import Tie
from pagedllm.executor.supervisor import ProcessSupervisor
from pagedllm.kv_events import KVEventsConfig
from pagedllm.kv_events.config import MAX_PORT
from pagedllm.worker.cpu_threads import default_cpu_threads

logger = logging.getLogger(__name__)
START_TIMEOUT_S = 300.0
# a replica that dies is restarted after RESTART_FIRST_S, doubled for each death in a row, at
# most RESTART_MAX_S; one that stayed up RESTART_RESET_S since its last start starts over
RESTART_FIRST_S = 1.0
RESTART_MAX_S = 60.0
RESTART_RESET_S = 60.0


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def check_listen_address(host: str, port: int) -> None:
    """ValueError naming --host/--port when the router could not listen there (an address
    this machine does not have, a port past 65535 or taken), checked before any replica starts:
    the router binds only once they are all up. (Bound with SO_REUSEADDR, as uvicorn binds.)"""
    if not 0 <= port <= MAX_PORT:  # getaddrinfo would take it modulo 65536
        raise ValueError(f"--port {port}: ports go from 0 to {MAX_PORT}")
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(address)
    except OSError as exc:
        why = exc.strerror or str(exc)
        raise ValueError(
            f"--host {host} --port {port}: the data-parallel router cannot listen there ({why})"
        ) from None


def replica_events_config(kv_events_config, rank: int, endpoint: str, replay: str) -> dict:
    """Replica `rank`'s KV-events config: the given one (each TCP port + rank) when it
    publishes, else `endpoint` and `replay` (the launcher's own sockets)."""
    events = KVEventsConfig.from_dict(kv_events_config)
    if events is not None and events.publishes:
        return {**vars(events.for_rank(rank))}
    return {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": endpoint,
        "replay_endpoint": replay,
    }


def socket_folder() -> contextlib.AbstractContextManager[str]:
    """Where the replicas' ipc sockets go: a new temporary folder only this user can enter
    (0700, as `mkdtemp` makes it; each socket in it is 0600: `publisher.bind_private`), removed
    on exit. The events carry every prompt's tokens: Linux's abstract socket namespace, which
    leaves no file behind, has no permissions at all (any local user could connect)."""
    return tempfile.TemporaryDirectory(prefix="pagedllm-dp-")


def ipc_endpoints(folder: str, rank: int) -> tuple[str, str]:
    """Replica `rank`'s events and replay sockets in `folder` (one machine)."""
    return f"ipc://{folder}/replica{rank}-pub", f"ipc://{folder}/replica{rank}-replay"


def replica_cpu_threads(cpu_threads: int | None, device: str, size: int) -> int | None:
    """A replica's CPU threads: the given number, else (on CPU) the engine's own default for
    `size` engines sharing the machine's cores (`default_cpu_threads`)."""
    if cpu_threads is None and device in ("cpu", "auto"):
        return default_cpu_threads(size)
    return cpu_threads


def replica_args(args: argparse.Namespace, rank: int, folder: str) -> argparse.Namespace:
    """`serve`'s arguments for replica `rank`: one replica, a local port, its events endpoint,
    and (on CPU, unless given) its share of the cores."""
    ns = copy.copy(args)
    ns.data_parallel_size = 1
    ns.host = "127.0.0.1"
    ns.port = _free_port("127.0.0.1")
    ns.kv_events_config = replica_events_config(
        args.kv_events_config, rank, *ipc_endpoints(folder, rank)
    )
    ns.cpu_threads = replica_cpu_threads(args.cpu_threads, args.device, args.data_parallel_size)
    return ns


def _exit_on_sigterm(signum, frame) -> None:
    sys.exit(128 + signum)


@contextlib.contextmanager
def replica_lifeline(tie: Tie) -> Iterator[None]:
    """Around a replica process' work (it runs tied from its first instruction: `run_tied`):
    SIGTERM exits through `finally` (until a server takes the signal over for its own shutdown),
    the kernel sends SIGTERM when the launcher dies, and an orphaned replica removes the socket
    folder as it ends (while the launcher lives the folder is its own: a replica restarted there
    binds in it again)."""
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    tie.hold()
    try:
        yield
    finally:
        if tie.orphaned:  # every replica is ending: the first out removes it all
            tie.remove_orphaned()


def _replica_main(serve_replica: Callable[[argparse.Namespace], int], ns, tie: Tie, conn) -> int:
    """A `serve` replica process (its pipe unused: it answers over HTTP)."""
    with replica_lifeline(tie):
        return serve_replica(ns)


def _replica_label(index: int) -> str:
    return f"data-parallel replica {index - 1}"


class ReplicaProcesses:
    """The data-parallel replicas' processes, replica `rank` the supervisor's child `rank + 1`:
    each spawned tied to this process (SIGTERM from the kernel when it dies; any orphan removes
    `folder`), started again in its place after a death."""

    def __init__(self, folder: str, name: str = "pagedllm-dp-replica-") -> None:
        self.folder = folder
        self.children = ProcessSupervisor(_replica_label, name)

    def _tie(self) -> Tie:
        # made by the calling thread: the kernel's signal only for replicas spawned by the main one
        return Tie.to_this_process(orphan_folders=(self.folder,), kill_with=signal.SIGTERM)

    def start(self, target: Callable, args: tuple) -> None:
        """The next replica: `target(*args, tie, conn)` in a spawned process."""
        self.children.spawn(self._tie(), target, args)

    def restart(self, rank: int, target: Callable, args: tuple) -> None:
        self.children.respawn(rank + 1, self._tie(), target, args)

    @property
    def procs(self) -> list:
        return self.children.procs

    def pids(self) -> list[int]:
        return [proc.pid for proc in self.children.procs]

    def check_alive(self) -> None:
        """ReplicaDiedError naming a replica that ended during start-up, with its status."""
        _check_processes(self.children.procs)

    def idle(self, timeout_s: float) -> None:
        """Wait `timeout_s`, or less when a replica dies meanwhile."""
        connection.wait(list(self.children.sentinels), timeout=timeout_s)

    def dead(self) -> list[tuple[int, str]]:
        """(rank, how) for each replica that ended."""
        return [
            (rank, f"exited (status {proc.exitcode})")
            for rank, proc in enumerate(self.children.procs)
            if not proc.is_alive()
        ]

    def stop(self, grace_s: float, terminate_s: float | None = None) -> None:
        """Join for `grace_s` (the replicas were asked to exit), with `terminate_s` SIGTERM
        them and join that long, then kill what still runs. Idempotent."""
        self.children.stop(grace_s, terminate_s)


def wait_healthy(
    urls: list[str],
    check_alive: Callable[[], None],
    idle: Callable[[float], object] = time.sleep,
) -> None:
    """Until every replica answers /health; `check_alive` raises (naming the replica) when one
    ended during start-up, checked after each `idle(0.2)` (which returns early when a replica
    dies: `ReplicaProcesses.idle`). WorkerStartupError naming those not up after
    START_TIMEOUT_S."""
    deadline = time.monotonic() + START_TIMEOUT_S
    pending = set(range(len(urls)))
    while pending:
        check_alive()
        for rank in list(pending):
            try:
                if httpx.get(f"{urls[rank]}/health", timeout=1).status_code == 200:
                    pending.discard(rank)
            except httpx.TransportError:
                pass
        if pending and time.monotonic() > deadline:
            raise WorkerStartupError(f"data-parallel replicas {sorted(pending)} did not start")
        if pending:
            idle(0.2)


def _check_processes(procs) -> None:
    for rank, proc in enumerate(procs):
        if not proc.is_alive():
            raise ReplicaDiedError(
                f"data-parallel replica {rank} exited during start-up (status {proc.exitcode})"
            )


class Supervisor:
    """Restarts the replicas that die while the router runs, each after a back-off: RESTART_FIRST_S
    doubled for each death in a row, at most RESTART_MAX_S (one that stayed up RESTART_RESET_S
    is forgiven its earlier deaths). `dead()`: (rank, why) for each replica that ended; `restart`
    starts one again, on its old address and event endpoints, so the router sees a new instance
    on the same URL (counted on its /metrics; its part of the index reset and rebuilt from the
    new instance's events). A `restart` that raises is tried again after the next back-off.
    (A replica restarted from this thread is tied to the launcher by its watch alone: the
    kernel's death signal follows the thread that spawned it, `lifeline`.)"""

    def __init__(
        self,
        size: int,
        dead: Callable[[], list[tuple[int, str]]],
        restart: Callable[[int], None],
        poll_s: float = 0.2,
    ) -> None:
        self.dead, self.restart, self.poll_s = dead, restart, poll_s
        self._due: dict[int, float] = {}  # rank -> when it is started again
        self._deaths = [0] * size  # in a row
        self._started = [time.monotonic()] * size
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="replica-supervisor", daemon=True)

    def __enter__(self) -> Supervisor:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                for rank, why in self.dead():
                    if rank not in self._due:
                        self._schedule(rank, why)
                for rank, at in sorted(self._due.items()):
                    if time.monotonic() >= at and not self._stop.is_set():
                        self._restart(rank)
            except Exception:  # noqa: BLE001 - the supervisor outlives a failed check
                logger.exception("the data-parallel replicas' supervisor")

    def _schedule(self, rank: int, why: str) -> None:
        now = time.monotonic()
        if now - self._started[rank] >= RESTART_RESET_S:
            self._deaths[rank] = 0
        delay = min(RESTART_FIRST_S * 2 ** self._deaths[rank], RESTART_MAX_S)
        self._deaths[rank] += 1
        self._due[rank] = now + delay
        logger.warning("data-parallel replica %d %s; restarting it in %.1f s", rank, why, delay)

    def _restart(self, rank: int) -> None:
        del self._due[rank]
        self._started[rank] = time.monotonic()
        try:
            self.restart(rank)
        except Exception as exc:  # noqa: BLE001 - tried again after the back-off
            self._schedule(rank, f"could not be restarted ({exc!r})")
            return
        logger.warning("data-parallel replica %d restarted", rank)


def run_data_parallel(
    args: argparse.Namespace,
    serve_replica: Callable[[argparse.Namespace], int],
    run_router: Callable[[list[str]], int],
) -> int:
    """Starts `args.data_parallel_size` replicas (`serve_replica(namespace)` in a spawned
    process each), waits until all answer /health, then `run_router(urls)` here, restarting
    those that die meanwhile (`Supervisor`); stops them when it returns."""
    with socket_folder() as folder:
        replicas = ReplicaProcesses(folder)
        urls, namespaces = [], []

        def restart(rank: int) -> None:
            replicas.restart(rank, _replica_main, (serve_replica, namespaces[rank]))

        try:
            for rank in range(args.data_parallel_size):
                namespaces.append(replica_args(args, rank, folder))
                replicas.start(_replica_main, (serve_replica, namespaces[rank]))
                urls.append(f"http://127.0.0.1:{namespaces[rank].port}")
            wait_healthy(urls, replicas.check_alive, replicas.idle)
            logger.info("data-parallel replicas up: %s", ", ".join(urls))
            with Supervisor(args.data_parallel_size, replicas.dead, restart):
                return run_router(urls)
        finally:
            # SIGTERM is how a server is asked to stop: its shutdown grace, then SIGKILL
            replicas.stop(0.0, args.shutdown_grace + 10)
