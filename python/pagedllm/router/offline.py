"""`LLM(data_parallel_size=N)`: N engine processes for offline batch jobs, behind the router core.

Each replica is a spawned process running one `LLMEngine` (its share of the CPU cores unless
`cpu_threads` says otherwise) that publishes its KV events on an ipc socket; this process keeps
the router core (`pagedllm._core.Router`, cache-aware) fed by those events, routes every prompt
of a `generate` call (prompts sharing a prefix go to the replica holding it, or to the one the
burst's first prompt went to), sends each replica its share over a multiprocessing pipe, and
puts the outputs back in the caller's order.

A replica that dies makes the call raise `ReplicaDiedError` naming it; the others are stopped
(an engine missing a replica is not kept half-alive). `close()`, the object's deletion and the
interpreter's exit stop every replica (SIGTERM, then SIGKILL) and remove the private socket
folder (`launcher.socket_folder`); a replica whose parent dies is sent SIGTERM
by the kernel (`launcher._replica_main`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import multiprocessing
import os
import threading
import time
import traceback
import weakref
from multiprocessing.connection import wait

from pagedllm._core import Router
from pagedllm.config import EngineArgs
from pagedllm.engine import LLMEngine
from pagedllm.engine.batch import generate_batch
from pagedllm.executor.errors import EngineDeadError, ReplicaDiedError
from pagedllm.kv_events.subscriber import KVEventSubscriber
from pagedllm.models.loader import load_model_config
from pagedllm.router.launcher import (
    START_TIMEOUT_S,
    _replica_main,
    ipc_endpoints,
    replica_cpu_threads,
    replica_events_config,
    socket_folder,
)
from pagedllm.router.replicas import connect_endpoint
from pagedllm.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)
STOP_GRACE_S = 10.0
LOCALHOST = "http://127.0.0.1"


def replica_engine_args(args: EngineArgs, rank: int, folder: str) -> EngineArgs:
    """Replica `rank`'s engine: one replica, its KV events (as `serve -dp` places them), and
    (on CPU, unless given) its share of the cores."""
    return dataclasses.replace(
        args,
        data_parallel_size=1,
        kv_events_config=replica_events_config(
            args.kv_events_config, rank, *ipc_endpoints(folder, rank)
        ),
        cpu_threads=replica_cpu_threads(args.cpu_threads, args.device, args.data_parallel_size),
    )


def _portable(exc: BaseException) -> BaseException:
    """`exc` if it pickles, else a RuntimeError carrying its traceback."""
    import pickle

    try:
        pickle.dumps(exc)
        return exc
    except Exception:
        return RuntimeError("".join(traceback.format_exception(exc)))


def _serve_replica(payload) -> int:
    """A replica process: builds its engine, says "ready", then runs each `generate` it is
    sent until it gets None (or its pipe closes)."""
    conn, args = payload
    request_ids = itertools.count()
    try:
        engine = LLMEngine.from_engine_args(args)
    except Exception as exc:
        conn.send(("error", _portable(exc)))
        return 1
    conn.send(("ready", os.getpid()))
    while True:
        try:
            message = conn.recv()
        except EOFError:
            return 0
        if message is None:
            return 0
        try:
            prompts, params, priority, lora_request = message
            ids = [f"{next(request_ids)}" for _ in prompts]
            outputs = generate_batch(engine, ids, prompts, params, priority, lora_request)
            conn.send(("ok", outputs))
        except Exception as exc:
            conn.send(("error", _portable(exc)))


@dataclasses.dataclass(eq=False)
class _Replica:
    rank: int
    proc: multiprocessing.process.BaseProcess
    conn: multiprocessing.connection.Connection
    subscriber: KVEventSubscriber | None = None

    def died(self) -> ReplicaDiedError:
        return ReplicaDiedError(
            f"data-parallel replica {self.rank} (pid {self.proc.pid}) died "
            f"(exit status {self.proc.exitcode})"
        )


def _stop(replicas: list[_Replica], folder: contextlib.ExitStack) -> None:
    """Stops every replica (None on its pipe, then SIGTERM, then SIGKILL), its subscriber, and
    removes the socket folder (where it is one). Safe to call twice."""
    for r in replicas:
        with contextlib.suppress(OSError, ValueError):
            r.conn.send(None)
    deadline = time.monotonic() + STOP_GRACE_S
    for r in replicas:
        r.proc.join(timeout=max(0.1, deadline - time.monotonic()))
        if r.proc.is_alive():
            r.proc.terminate()
            r.proc.join(timeout=5)
        if r.proc.is_alive():
            r.proc.kill()
            r.proc.join()
        r.conn.close()
        if r.subscriber is not None:
            r.subscriber.close()
    replicas.clear()
    folder.close()


class DataParallelEngines:
    """The replicas of one `LLM(data_parallel_size=N)` and the router in front of them."""

    def __init__(self, args: EngineArgs) -> None:
        args.validate()
        if args.data_parallel_backend != "mp":
            raise ValueError(
                f"data_parallel_backend={args.data_parallel_backend!r}: LLM runs its replicas "
                "as processes on this machine ('mp'); Ray replicas are for `pagedllm serve -dp`"
            )
        self.args = args
        self.size = args.data_parallel_size
        self.router = Router(self.size, args.block_size)
        # per replica: the router's tickets of its requests under way (for `finish`)
        self._tickets: list[list[int]] = [[] for _ in range(self.size)]
        # the prompts are tokenized here as the replicas will, to be hashed for routing
        self.tokenizer = None
        if not args.skip_tokenizer_init:
            cfg = load_model_config(args.model)
            self.tokenizer = load_tokenizer(
                args.tokenizer or args.model,
                eos_token_id=cfg.eos_token_id,
                bos_token_id=cfg.bos_token_id,
            )
        self.lock = threading.Lock()
        folder = contextlib.ExitStack()
        self.folder = folder.enter_context(socket_folder())
        self._replicas: list[_Replica] = []
        self._finalizer = weakref.finalize(self, _stop, self._replicas, folder)
        try:
            self._start()
        except BaseException:
            self.close()
            raise

    def _start(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        for rank in range(self.size):
            ns = replica_engine_args(self.args, rank, self.folder)
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=_replica_main,
                args=(_serve_replica, (child, ns), self.folder),
                name=f"pagedllm-dp-replica-{rank}",
            )
            proc.start()
            child.close()
            self._replicas.append(_Replica(rank, proc, parent))
        for r in self._replicas:
            status, value = self._receive(r, time.monotonic() + START_TIMEOUT_S)
            if status == "error":
                raise value
            events = replica_engine_args(self.args, r.rank, self.folder).kv_events_config
            replay = events["replay_endpoint"]
            r.subscriber = KVEventSubscriber(
                self.router,
                self.lock,
                r.rank,
                connect_endpoint(events["endpoint"], LOCALHOST),
                replay and connect_endpoint(replay, LOCALHOST),
                events.get("topic", ""),
            ).start()

    def _receive(self, r: _Replica, deadline: float):
        """The replica's next message; ReplicaDiedError when it ends (or times out) first."""
        while True:
            ready = wait([r.conn, r.proc.sentinel], timeout=max(0.0, deadline - time.monotonic()))
            if r.conn in ready:
                try:
                    return r.conn.recv()
                except (EOFError, OSError):  # its end closed (reset when killed)
                    r.proc.join(timeout=5)
                    raise r.died() from None
            if r.proc.sentinel in ready:
                raise r.died()
            if not ready:
                raise ReplicaDiedError(f"data-parallel replica {r.rank} did not answer in time")

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def close(self) -> None:
        self._finalizer()

    def pids(self) -> list[int]:
        return [r.proc.pid for r in self._replicas]

    def route(self, token_ids: list[int], lora_id: int) -> int:
        with self.lock:
            replica, _, _, _, ticket = self.router.route(
                token_ids, lora_id=lora_id, now=time.monotonic()
            )
            self._tickets[replica].append(ticket)
        return replica

    def finish(self, replica: int) -> None:
        """One of the requests routed to `replica` ended. `generate` ends a call's requests
        together, so which one's ticket is given back first does not matter."""
        with self.lock:
            self.router.finish(self._tickets[replica].pop())

    def run(self, shares: dict[int, tuple], on_done=None) -> dict[int, list]:
        """Sends `shares[rank]` (generate's arguments) to each replica and returns each one's
        outputs. A replica error is raised once all have answered; a dead replica closes all."""
        if self.closed:
            raise EngineDeadError("this LLM's data-parallel replicas are closed")
        for rank, share in shares.items():
            r = self._replicas[rank]
            try:
                r.conn.send(share)
            except OSError:  # its end is closed: it died since the last call
                r.proc.join(timeout=5)
                died = r.died()
                self.close()
                raise died from None
        pending = {self._replicas[rank] for rank in shares}
        results, errors = {}, []
        while pending:
            sentinels = {r.proc.sentinel: r for r in pending}
            ready = wait([r.conn for r in pending] + list(sentinels))
            for r in list(pending):
                if r.conn not in ready and r.proc.sentinel not in ready:
                    continue
                try:
                    status, value = self._receive(r, time.monotonic())
                except ReplicaDiedError:
                    died = r.died()
                    self.close()  # the others are mid-call: nothing half-alive is kept
                    raise died from None
                pending.discard(r)
                if status == "error":
                    errors.append(value)
                else:
                    results[r.rank] = value
                    if on_done is not None:
                        on_done(len(value))
        if errors:
            raise errors[0]
        return results
