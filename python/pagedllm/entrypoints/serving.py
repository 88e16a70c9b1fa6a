"""What both OpenAI endpoints share: checking a request, its prompts (`prompts.py`: rendered
and tokenized off the event loop, or as a router forwarded them), admission control, submitting
it to the engine, and following its outputs (merged across prompts, with a timeout, aborted
when the client goes away)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from pagedllm.chat.template import checkpoint_chat_template
from pagedllm.chat.tools import ChatOptions
from pagedllm.entrypoints.async_engine import MAX_FAILED_STEPS, AsyncEngine, EngineDeadError
from pagedllm.entrypoints.errors import APIError, bad_request, unavailable
from pagedllm.entrypoints.metrics import ServerMetrics
from pagedllm.entrypoints.prompts import Prompts
from pagedllm.entrypoints.rendering import Prompt, Renderer, tokenizer_source
from pagedllm.entrypoints.structured_outputs import check_compiles, constraint_of
from pagedllm.kv_events import KVEventsConfig
from pagedllm.lora.request import LoRARequest
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import BeamSearchParams, SamplingParams

# OpenAI's documented range of a logit_bias value; vLLM clips to it too
MAX_LOGIT_BIAS = 100.0
# a request body over this is a 413 before it is parsed: 4 MiB holds a text prompt of some 4
# million ASCII characters, or some 500,000 token ids
DEFAULT_MAX_REQUEST_BODY_BYTES = 4 * 1024 * 1024


@dataclass
class ServerConfig:
    served_model_name: str
    api_key: str | None = None
    chat_template: str | None = None
    max_queued_requests: int | None = None
    max_queued_tokens: int | None = None
    # LoRA adapters served as models of their own: model id -> PEFT folder (--lora-modules)
    lora_modules: dict[str, str] = field(default_factory=dict)
    # POST /v1/load_lora_adapter and /v1/unload_lora_adapter (lora_routes.py; or the env var)
    allow_runtime_lora_updating: bool = False
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES
    # failed engine steps in a row after which the engine counts as broken (the server exits)
    max_failed_steps: int = MAX_FAILED_STEPS
    # tool-call and reasoning parsers, and where structured output applies (chat_tools.py)
    chat_options: ChatOptions = field(default_factory=ChatOptions)


@dataclass
class Job:
    """The engine requests of one HTTP request: one per prompt, each with its output queue."""

    server: Server
    streams: list[tuple[str, asyncio.Queue]]
    prompts: list[Prompt]
    params: SamplingParams | BeamSearchParams
    timeout: float | None
    created: int = field(default_factory=lambda: int(time.time()))
    model: str = ""  # the model id the client asked for (the base model or an adapter)
    # prompt index -> its prompt tokens served from the prefix cache (as the outputs say)
    cached: dict[int, int] = field(default_factory=dict)

    @property
    def id(self) -> str:
        return self.streams[0][0]

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p.ids) for p in self.prompts)

    @property
    def num_cached_tokens(self) -> int:
        return sum(self.cached.values())

    def abort(self) -> None:
        for request_id, _ in self.streams:
            self.server.engine.abort(request_id)

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, cumulative output) as outputs arrive, until every request finished.
        A request past `timeout` is aborted (its last output has finish reason "abort")."""
        if len(self.streams) == 1:
            async for output in self._one_stream():
                yield 0, output
            return
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        timed_out = False
        getters: dict[asyncio.Task, int] = {}

        def watch(index: int) -> None:
            getters[asyncio.ensure_future(self.streams[index][1].get())] = index

        for index in range(len(self.streams)):
            watch(index)
        try:
            while getters:
                wait = None if deadline is None else max(0.0, deadline - time.monotonic())
                done, _ = await asyncio.wait(
                    getters, timeout=wait, return_when=asyncio.FIRST_COMPLETED
                )
                if not done:  # the deadline passed: abort once, then drain the final outputs
                    timed_out, deadline = True, None
                    self.abort()
                    continue
                for task in done:
                    index = getters.pop(task)
                    item = _latest(task.result(), self.streams[index][1])
                    if isinstance(item, BaseException):
                        raise unavailable(str(item))
                    if timed_out and item.finished:
                        _mark_timeout(item, self.timeout)
                    self.cached[index] = item.num_cached_tokens
                    yield index, item
                    if not item.finished:
                        watch(index)
        finally:
            for task in getters:
                task.cancel()

    async def _one_stream(self) -> AsyncIterator[RequestOutput]:
        """`outputs` of a job with one request (one prompt, n = 1 or n > 1 in one output): its
        queue awaited directly, with no task per output as the multi-stream wait needs."""
        queue = self.streams[0][1]
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        timed_out = False
        while True:
            try:
                async with asyncio.timeout_at(None if deadline is None else _loop_time(deadline)):
                    item = await queue.get()
            except TimeoutError:  # the deadline passed: abort once, then drain the final outputs
                timed_out, deadline = True, None
                self.abort()
                continue
            item = _latest(item, queue)
            if isinstance(item, BaseException):
                raise unavailable(str(item))
            if timed_out and item.finished:
                _mark_timeout(item, self.timeout)
            self.cached[0] = item.num_cached_tokens
            yield item
            if item.finished:
                return

    async def finals(self, request: Request) -> list[RequestOutput]:
        """The final output of every prompt; a client that disconnects first has its requests
        aborted (and gets nothing: the connection is gone)."""
        finals: list[RequestOutput | None] = [None] * len(self.streams)

        async def gather() -> None:
            async for index, output in self.outputs():
                if output.finished:
                    finals[index] = output

        gather_task = asyncio.ensure_future(gather())
        watch_task = asyncio.ensure_future(_watch_disconnect(request))
        try:
            await asyncio.wait({gather_task, watch_task}, return_when=asyncio.FIRST_COMPLETED)
            if not gather_task.done():  # disconnected
                return []
            gather_task.result()
            return [f for f in finals if f is not None]
        finally:
            watch_task.cancel()
            gather_task.cancel()
            if any(f is None for f in finals):  # disconnected or failed: abort what is left
                self.abort()


def _loop_time(monotonic_deadline: float) -> float:
    """A `time.monotonic()` deadline on the running event loop's clock."""
    return asyncio.get_running_loop().time() + (monotonic_deadline - time.monotonic())


def _latest(item: Any, queue: asyncio.Queue) -> Any:
    """Outputs are cumulative: when the client fell behind, only the latest one counts."""
    while not queue.empty() and isinstance(item, RequestOutput) and not item.finished:
        item = queue.get_nowait()
    return item


def _mark_timeout(output: RequestOutput, timeout: float | None) -> None:
    for completion in output.outputs:
        if completion.finish_reason == "abort":
            completion.stop_reason = f"timeout after {timeout} s"


def prompt_logprobs_json(output: RequestOutput) -> list[dict[str, dict] | None] | None:
    """vLLM's `prompt_logprobs` answer field: per prompt token None (the first) or token id ->
    {logprob, rank, decoded_token}."""
    entries = output.prompt_logprobs
    if entries is None:
        return None
    return [
        None
        if entry is None
        else {
            str(tid): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
            for tid, lp in entry.items()
        }
        for entry in entries
    ]


def continuous_usage(body: Any) -> bool:
    """stream_options.continuous_usage_stats: usage in every streamed chunk."""
    return bool(body.stream_options and body.stream_options.continuous_usage_stats)


def usage(job: Job, completion_tokens: int) -> dict:
    """OpenAI's usage object; `prompt_tokens_details.cached_tokens`: the prompt tokens the
    prefix cache served (so far: known once each prompt was first scheduled)."""
    prompt_tokens = job.num_prompt_tokens
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": job.num_cached_tokens},
    }


async def _watch_disconnect(request: Request) -> None:
    """Returns when the client has gone. The body was read already, so the ASGI server's next
    message is `http.disconnect`: awaited, not polled (as vLLM's `listen_for_disconnect`), so a
    short request cannot finish unaborted inside a poll interval after its client left."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class Server:
    """The app's state: the engine loop, the config, the metrics, and the steps every
    endpoint takes before its requests reach the engine."""

    def __init__(self, engine: AsyncEngine, config: ServerConfig) -> None:
        self.engine = engine
        self.config = config
        self.metrics = ServerMetrics(engine)
        # admission limits count requests the scheduler has not started yet
        engine.track_waiting = (
            config.max_queued_requests is not None or config.max_queued_tokens is not None
        )
        self._admitting = [0, 0]  # (requests, prompt tokens) admitted, not yet in the engine
        engine.max_failed_steps = config.max_failed_steps
        self.renderer = self._renderer()
        self.prompts = Prompts(engine, self.renderer, self.check_model)
        self.loras = self._register_loras(config.lora_modules)
        self.instance_id = uuid.uuid4().hex

    def _renderer(self) -> Renderer:
        """The chat template (the one given, else the checkpoint's) and the tokenizer, described
        on /load for a router to render as this server does."""
        engine, config = self.engine.engine, self.config
        name = engine.args.tokenizer or engine.args.model
        template = config.chat_template
        if template is None:
            template = checkpoint_chat_template(engine.tokenizer, name)
        cfg = engine.model_config
        source = tokenizer_source(name, cfg.eos_token_id, cfg.bos_token_id)
        return Renderer(engine.tokenizer, template, config.chat_options, source)

    def _register_loras(self, modules: dict[str, str]) -> dict[str, LoRARequest]:
        """Each `--lora-modules` adapter as a model id, read and checked now (a bad folder stops
        the server from starting, with the adapter's name and the problem)."""
        loras = {}
        for i, (name, path) in enumerate(modules.items()):
            if name == self.model_name:
                raise ValueError(f"--lora-modules: {name!r} is already the base model's name")
            loras[name] = LoRARequest(name, i + 1, path)
            self.engine.engine.add_lora(loras[name])
        return loras

    def load_report(self) -> dict:
        """What a data-parallel router polls (`GET /load`): this process's identity (a new one
        after a restart), its queues and KV usage from the engine loop's latest snapshot, the
        block size and the adapters' ids it hashes prompts with, and where its KV events go."""
        stats = self.engine.snapshot.stats
        engine = self.engine.engine
        events = KVEventsConfig.from_dict(engine.args.kv_events_config)
        return {
            "instance_id": self.instance_id,
            # what /health says: a failing engine is taken out of rotation
            "healthy": self.engine.unhealthy_reason is None,
            "num_waiting": int(stats.get("num_waiting", 0)),
            "num_running": int(stats.get("num_running", 0)),
            "kv_usage": float(stats.get("kv_usage", 0.0)),
            "block_size": engine.args.block_size,
            # the router bounds its index of this replica by it (forged events cannot grow it)
            "num_gpu_blocks": int(stats.get("num_gpu_blocks", 0)),
            "lora_ids": {name: lora.lora_int_id for name, lora in self.loras.items()},
            "kv_events": dataclasses.asdict(events) if events and events.publishes else None,
            # how a router renders and tokenizes a request as this server would
            "renderer": self.renderer.description,
            # the body it takes: a router sends the rendered ids with one only when it fits
            "max_request_body_bytes": self.config.max_request_body_bytes,
        }

    @property
    def model_name(self) -> str:
        return self.config.served_model_name

    @property
    def vocab_size(self) -> int:
        return self.engine.engine.model_config.vocab_size

    def check_model(self, model: str | None) -> LoRARequest | None:
        """The adapter `model` names (None: the base model); 404 for a model not served."""
        if model is None or model == self.model_name:
            return None
        lora = self.loras.get(model)
        if lora is None:
            served = ", ".join(f"`{m}`" for m in (self.model_name, *self.loras))
            raise APIError(
                404,
                f"The model `{model}` does not exist (this server serves {served})",
                param="model",
                type_="NotFoundError",
            )
        return lora

    def sampling_params(
        self, body: Any, *, max_tokens: int | None, logprobs: int | None
    ) -> SamplingParams:
        """The engine's parameters from the fields both endpoints share."""
        if body.prompt_logprobs is not None and body.stream:
            raise APIError(
                400, "prompt_logprobs are not available with stream=true", param="prompt_logprobs"
            )
        for token in body.stop_token_ids or ():
            if not 0 <= token < self.vocab_size:
                raise APIError(
                    400,
                    f"stop_token_ids: token id {token} is outside the vocabulary "
                    f"[0, {self.vocab_size})",
                    param="stop_token_ids",
                )
        kwargs: dict[str, Any] = dict(
            n=body.n,
            seed=body.seed,
            stop=body.stop,
            presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty,
            ignore_eos=body.ignore_eos,
            min_tokens=body.min_tokens,
            stop_token_ids=body.stop_token_ids,
            logprobs=logprobs,
            skip_special_tokens=body.skip_special_tokens,
            include_stop_str_in_output=body.include_stop_str_in_output,
            structured_outputs=constraint_of(body),
            logit_bias=_logit_bias(body.logit_bias),
            allowed_token_ids=body.allowed_token_ids,
            bad_words=body.bad_words,
            prompt_logprobs=body.prompt_logprobs,
            truncate_prompt_tokens=body.truncate_prompt_tokens,
        )
        if max_tokens is not None:
            kwargs["max_tokens"] = max_tokens
        for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "best_of"):
            value = getattr(body, name, None)
            if value is not None:
                kwargs[name] = value
        try:
            return SamplingParams(**kwargs)
        except ValueError as exc:
            raise bad_request(exc) from None

    # -- admission and submission -------------------------------------------------------------

    @contextlib.contextmanager
    def admission(self, num_requests: int, num_tokens: int) -> Iterator[None]:
        """429 with Retry-After when the queue limits would be exceeded. Otherwise the requests
        count as queued while the block runs (compiling a constraint awaits); its caller hands
        them to the engine right after it, with no await between, where `queued()` counts them.
        Every request passes here, so all count the same way."""
        cfg = self.config
        if not self.engine.track_waiting:
            yield
            return
        engine_requests, engine_tokens = self.engine.queued()
        queued_requests = engine_requests + self._admitting[0]
        queued_tokens = engine_tokens + self._admitting[1]
        over_requests = (
            cfg.max_queued_requests is not None
            and queued_requests + num_requests > cfg.max_queued_requests
        )
        over_tokens = (
            cfg.max_queued_tokens is not None and queued_tokens + num_tokens > cfg.max_queued_tokens
        )
        if over_requests or over_tokens:
            self.metrics.rejected.inc()
            raise APIError(
                429,
                f"the server is overloaded: {queued_requests} requests ({queued_tokens} prompt "
                f"tokens) are queued; limits are max_queued_requests="
                f"{cfg.max_queued_requests}, max_queued_tokens={cfg.max_queued_tokens}",
                type_="rate_limit_error",
                headers={"Retry-After": "1"},
            )
        self._admitting[0] += num_requests
        self._admitting[1] += num_tokens
        try:
            yield
        finally:
            self._admitting[0] -= num_requests
            self._admitting[1] -= num_tokens

    async def submit(
        self,
        prompts: list[Prompt],
        params: SamplingParams | BeamSearchParams,
        *,
        priority: int,
        timeout: float | None,
        model: str | None = None,
    ) -> Job:
        """Adds one engine request per prompt (under the adapter `model` names, if it names
        one); on any failure aborts those already added."""
        lora = self.check_model(model)
        with self.admission(len(prompts), sum(len(p.ids) for p in prompts)):
            constraint = getattr(params, "structured_outputs", None)  # none for a beam search
            await check_compiles(self.engine.engine.structured_output, constraint)
        base = uuid.uuid4().hex
        job = Job(self, [], prompts, params, timeout, model=model or self.model_name)
        try:
            # all at once, right after admission: queued() counts them from here
            pending = [
                self.engine.submit(
                    f"{base}-{i}",
                    {"prompt_token_ids": prompt.ids, "prompt": prompt.text},
                    params,
                    priority=priority,
                    num_prompt_tokens=len(prompt.ids),
                    lora_request=lora,
                )
                for i, prompt in enumerate(prompts)
            ]
        except EngineDeadError as exc:  # raised before any is queued: the state is shared
            raise unavailable(str(exc)) from None
        job.streams = [(p.request_id, p.queue) for p in pending]
        try:
            for p in pending:
                await p.added
        except EngineDeadError as exc:
            job.abort()
            raise unavailable(str(exc)) from None
        except (ValueError, TypeError) as exc:
            job.abort()
            raise bad_request(exc) from None
        except BaseException:
            job.abort()
            raise
        return job

    def shutdown(self) -> None:
        self.prompts.shutdown()
        self.engine.engine.close_kv_events()  # the engine loop has stopped: no step publishes


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's logit_bias (token ids as strings) with each value clipped to +-100."""
    if bias is None:
        return None
    out = {}
    for key, value in bias.items():
        try:
            token = int(key)
        except ValueError:
            raise APIError(
                400, f"logit_bias: key {key!r} is not a token id", param="logit_bias"
            ) from None
        if math.isnan(value):
            raise APIError(400, f"logit_bias: the bias of {key!r} is NaN", param="logit_bias")
        out[token] = min(MAX_LOGIT_BIAS, max(-MAX_LOGIT_BIAS, float(value)))
    return out
