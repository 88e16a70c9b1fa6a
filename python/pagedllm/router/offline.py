"""`LLM(data_parallel_size=N)`: N engine processes for offline batch jobs, behind the router core.

Each replica is a spawned process running one `LLMEngine` (its share of the CPU cores unless
`cpu_threads` says otherwise) that publishes its KV events on an ipc socket; this process keeps
the router core (`pagedllm._core.Router`, cache-aware) fed by those events, routes every prompt
of a `generate` call (prompts sharing a prefix go to the replica holding it, or to the one the
burst's first prompt went to), sends each replica its share over a multiprocessing pipe, and
puts the outputs back in the caller's order.

The replicas' processes are `executor.supervisor.ProcessSupervisor` children
(`launcher.ReplicaProcesses`, as `serve -dp`'s): each is tied to this process from its first
instruction and exits when it dies (`launcher.replica_lifeline`: the socket folder goes with the
last one), says "ready" once its engine is built (one that does not within START_TIMEOUT_S is
killed: `WorkerStartupError`), and its answers are watched beside its sentinel.

A replica that dies makes the call raise `ReplicaDiedError` naming it; the others are stopped
(an engine missing a replica is not kept half-alive). `close()`, the object's deletion and the
interpreter's exit stop every replica (asked, then SIGTERM, then SIGKILL) and remove the private
socket folder (`launcher.socket_folder`).

`DataParallelEngines` is one of `LLM`'s two back-ends (`llm.Backend`): `generate` routes each
prompt, runs every replica's share at once and puts the outputs back in order.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import os
import threading
import time
import traceback
import weakref

from pagedllm._core import Router
from pagedllm.config import EngineArgs
from pagedllm.engine import LLMEngine, PromptType
from pagedllm.engine.batch import generate_batch
from pagedllm.executor.errors import EngineDeadError, ReplicaDiedError, WorkerStartupError
from pagedllm.executor.supervisor import ChildFailed
from pagedllm.kv_events.subscriber import KVEventSubscriber
from pagedllm.models.loader import load_model_config
from pagedllm.outputs import RequestOutput
from pagedllm.router.launcher import (
    START_TIMEOUT_S,
    ReplicaProcesses,
    ipc_endpoints,
    replica_cpu_threads,
    replica_events_config,
    replica_lifeline,
    socket_folder,
)
from pagedllm.router.replicas import connect_endpoint
from pagedllm.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)
STOP_GRACE_S = 10.0  # for a replica to exit once asked (None on its pipe)
TERMINATE_GRACE_S = 5.0  # then after SIGTERM, before SIGKILL
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


def _serve_replica(args: EngineArgs, tie, conn) -> int:
    """A replica process (started tied: `lifeline.run_tied`): builds its engine, says "ready",
    then runs each `generate` it is sent until it gets None (or its pipe closes)."""
    with replica_lifeline(tie):
        return _serve(args, conn)


def _serve(args: EngineArgs, conn) -> int:
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


def _stop(
    processes: ReplicaProcesses,
    subscribers: list[KVEventSubscriber],
    folder: contextlib.ExitStack,
) -> None:
    """Stops every replica (None on its pipe, then SIGTERM, then SIGKILL), the subscribers, and
    removes the socket folder (where it is one). Safe to call twice."""
    for index in range(1, len(processes.procs) + 1):
        with contextlib.suppress(ChildFailed):
            processes.children.send(None, [index])
    processes.stop(STOP_GRACE_S, TERMINATE_GRACE_S)
    for subscriber in subscribers:
        subscriber.close()
    subscribers.clear()
    folder.close()


class DataParallelEngines:
    """The replicas of one `LLM(data_parallel_size=N)` and the router in front of them: one of
    `LLM`'s back-ends (`engine` None: the engines are in the replicas' processes)."""

    engine = None

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
        self.processes = ReplicaProcesses(self.folder)
        self._subscribers: list[KVEventSubscriber] = []
        self._finalizer = weakref.finalize(self, _stop, self.processes, self._subscribers, folder)
        try:
            self._start()
        except BaseException:
            self.close()
            raise

    def _start(self) -> None:
        for rank in range(self.size):
            self.processes.start(_serve_replica, (self._replica_args(rank),))

        def ready(index: int, answer: tuple) -> None:
            if answer[0] == "error":
                raise answer[1]  # its engine's own error (a bad argument, a missing file)
            self._subscribe(index - 1)

        indices = range(1, self.size + 1)
        try:
            self.processes.children.receive(indices, ready, START_TIMEOUT_S, "START_TIMEOUT_S")
        except ChildFailed as failure:
            error = WorkerStartupError if failure.silent else ReplicaDiedError
            raise error(failure.reason) from None

    def _replica_args(self, rank: int) -> EngineArgs:
        return replica_engine_args(self.args, rank, self.folder)

    def _subscribe(self, rank: int) -> None:
        """The router's subscriber to replica `rank`'s KV events (it is ready: bound)."""
        events = self._replica_args(rank).kv_events_config
        replay = events["replay_endpoint"]
        subscriber = KVEventSubscriber(
            self.router,
            self.lock,
            rank,
            connect_endpoint(events["endpoint"], LOCALHOST),
            replay and connect_endpoint(replay, LOCALHOST),
            events.get("topic", ""),
        )
        self._subscribers.append(subscriber.start())

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def close(self) -> None:
        self._finalizer()

    def pids(self) -> list[int]:
        return self.processes.pids()

    def get_tokenizer(self):
        return self.tokenizer

    def generate(
        self,
        request_ids: list[str],
        prompts: list[PromptType],
        params: list,
        priorities: list[int],
        loras: list,
        on_done=None,
    ) -> list[RequestOutput]:
        """Routes each prompt to a replica, runs every replica's share at once, and puts the
        outputs back in the prompts' order under `request_ids`."""
        shares: dict[int, list[int]] = {}
        for i, prompt in enumerate(prompts):
            lora_id = loras[i].lora_int_id if loras[i] is not None else 0
            rank = self.route(self._routing_tokens(prompt), lora_id)
            shares.setdefault(rank, []).append(i)
        try:
            results = self.run(
                {
                    rank: (
                        [prompts[i] for i in rows],
                        [params[i] for i in rows],
                        [priorities[i] for i in rows],
                        [loras[i] for i in rows],
                    )
                    for rank, rows in shares.items()
                },
                on_done=on_done,
            )
        finally:
            for rank, rows in shares.items():
                for _ in rows:
                    self.finish(rank)
        outputs: list[RequestOutput] = [None] * len(prompts)  # type: ignore[list-item]
        for rank, rows in shares.items():
            for i, output in zip(rows, results[rank]):
                output.request_id = request_ids[i]
                outputs[i] = output
        return outputs

    def _routing_tokens(self, prompt: PromptType) -> list[int]:
        """The token ids the router hashes: the replica's own tokenization of a text prompt
        (none without a tokenizer: the replica then refuses the prompt itself)."""
        if isinstance(prompt, dict):
            return list(prompt.get("prompt_token_ids") or ())
        if self.tokenizer is None:
            return []
        return self.tokenizer.encode(prompt)

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
        results, errors = {}, []

        def answered(index: int, answer: tuple) -> None:
            status, value = answer
            if status == "error":
                errors.append(value)
                return
            results[index - 1] = value
            if on_done is not None:
                on_done(len(value))

        children = self.processes.children
        try:
            for rank, share in shares.items():
                children.send(share, [rank + 1])
            children.receive([rank + 1 for rank in shares], answered, None, "no bound")
        except ChildFailed as failure:
            self.close()  # the others are mid-call: nothing half-alive is kept
            raise ReplicaDiedError(failure.reason) from None
        if errors:
            raise errors[0]
        return results
