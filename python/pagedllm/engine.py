"""`LLMEngine`: the step loop.

schedule (Rust) -> swap/copy blocks -> tensors from the step arrays -> forward -> sample ->
detokenize and check stop strings -> `update_from_output` (Rust) -> RequestOutputs.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import numpy as np
import torch

from pagedllm._core import Scheduler
from pagedllm.cache_engine import CacheEngine
from pagedllm.config import GiB, EngineArgs
from pagedllm.detokenizer import IncrementalDetokenizer
from pagedllm.model_runner import ModelRunner
from pagedllm.models import ModelConfig, load_model, load_model_config, resolve_device, resolve_dtype
from pagedllm.outputs import CompletionOutput, RequestMetrics, RequestOutput
from pagedllm.sampler import Sampler, SamplingMetadata
from pagedllm.sampling_params import SamplingParams
from pagedllm.tokenizer import load_tokenizer

logger = logging.getLogger("pagedllm")

PromptType = str | dict | Sequence[int]


@dataclass
class _Sequence:
    """Engine-side state of one generated sequence: tokens, text, logprobs, finish."""

    index: int
    detokenizer: IncrementalDetokenizer | None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    @property
    def text(self) -> str:
        return self.detokenizer.text if self.detokenizer is not None else ""

    def finish(self, reason: str, stop_reason: int | str | None = None) -> None:
        if self.finish_reason is None:
            self.finish_reason, self.stop_reason = reason, stop_reason
            if self.detokenizer is not None:
                self.detokenizer.finish()

    def output(self) -> CompletionOutput:
        return CompletionOutput(self.index, self.text, list(self.token_ids), self.cumulative_logprob,
                                self.logprobs, self.finish_reason, self.stop_reason)


@dataclass
class _Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[_Sequence]
    metrics: RequestMetrics
    stop_token_ids: frozenset[int] = frozenset()  # EOS (unless ignore_eos) + stop ids
    num_cached_tokens: int = 0
    num_faults: int = 0  # failed steps this request was part of (see LLMEngine.MAX_STEP_FAULTS)

    @property
    def finished(self) -> bool:
        return all(seq.finish_reason is not None for seq in self.seqs)

    def finish_all(self, reason: str, stop_reason: int | str | None = None) -> None:
        for seq in self.seqs:
            seq.finish(reason, stop_reason)
        self.metrics.finished_time = time.time()

    def __post_init__(self) -> None:
        # What the sampler sees: best_of > n needs the sampled tokens' logprobs for ranking.
        params = self.params
        if params.num_samples > params.n and params.logprobs is None:
            params = dataclasses.replace(params, logprobs=0)
        self.sampling_params = params

    def output(self) -> RequestOutput:
        seqs = self.seqs
        if len(seqs) > self.params.n:
            # best_of: the n samples with the highest cumulative logprob
            seqs = sorted(seqs, key=lambda s: -s.cumulative_logprob)[:self.params.n]
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids,
                             [seq.output() for seq in seqs], self.finished,
                             self.num_cached_tokens, self.metrics)


@dataclass
class StepTimings:
    """Accumulated wall time of the step phases (seconds), for `pagedllm bench`."""

    steps: int = 0
    schedule: float = 0.0
    prepare: float = 0.0
    forward: float = 0.0
    sample: float = 0.0
    update: float = 0.0

    def mean_ms(self) -> dict[str, float]:
        n = max(self.steps, 1)
        return {name: 1e3 * getattr(self, name) / n
                for name in ("schedule", "prepare", "forward", "sample", "update")}


class LLMEngine:
    """Step-wise engine (vLLM's names): add requests, call `step()` until nothing is left.

    A step that fails after scheduling (building inputs, the forward, sampling) is rolled back:
    its requests are recomputed by later steps, and `step()` re-raises the error. A request
    that was part of `MAX_STEP_FAULTS` failed steps is given up instead: it finishes with
    `finish_reason="abort"` and the error in `stop_reason`. A fault that belongs to one
    request (its sampling or output processing raises) ends only that request, the same way,
    without raising.
    """

    MAX_STEP_FAULTS = 3

    def __init__(self, args: EngineArgs) -> None:
        args.validate()
        self.args = args
        self.device = resolve_device(args.device)
        # config.json is validated before anything big is allocated
        self.model_config: ModelConfig = load_model_config(args.model)
        self.max_model_len = self._resolve_max_model_len(args, self.model_config)
        self.dtype = resolve_dtype(args.dtype, self.model_config, self.device)
        torch.manual_seed(args.seed)
        self.tokenizer = None
        if not args.skip_tokenizer_init:
            cfg = self.model_config
            self.tokenizer = load_tokenizer(args.tokenizer or args.model,
                                            eos_token_id=cfg.eos_token_id, bos_token_id=cfg.bos_token_id)
        self.model = load_model(args.model, dtype=self.dtype, device=self.device)
        self.max_num_batched_tokens = args.resolved_max_num_batched_tokens(self.max_model_len)
        num_gpu_blocks, num_cpu_blocks = self._plan_kv_cache()
        self.cache_engine = CacheEngine(
            num_layers=self.model_config.num_layers, num_kv_heads=self.model_config.num_kv_heads,
            head_dim=self.model_config.head_dim, block_size=args.block_size,
            num_gpu_blocks=num_gpu_blocks, num_cpu_blocks=num_cpu_blocks, dtype=self.dtype,
            device=self.device)
        self.scheduler = Scheduler(
            block_size=args.block_size, num_gpu_blocks=num_gpu_blocks, num_cpu_blocks=num_cpu_blocks,
            max_num_batched_tokens=self.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
            max_model_len=self.max_model_len, scheduling=args.scheduling, policy=args.policy,
            preemption_mode=args.preemption_mode, enable_prefix_caching=args.enable_prefix_caching,
            watermark=args.watermark, long_prefill_token_threshold=args.long_prefill_token_threshold,
            delay_factor=args.delay_factor)
        self.runner = ModelRunner(self.model, self.cache_engine, self.device)
        generator = torch.Generator(device=self.device)
        generator.manual_seed(args.seed)
        self.sampler = Sampler(generator)
        self.requests: dict[str, _Request] = {}
        # finished requests whose final output the next step returns (aborted, or owed by a
        # step that failed)
        self._aborted: list[str] = []
        # added but never scheduled: only these need first-scheduling bookkeeping, so a pure
        # decode step skips reading the step's request ids
        self._unscheduled: set[str] = set()
        self.timings = StepTimings()
        self._stats = _ThroughputStats(args.stats_log_interval, enabled=not args.disable_log_stats)

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> "LLMEngine":
        return cls(args)

    # ---- start-up ---------------------------------------------------------------------------

    @staticmethod
    def _resolve_max_model_len(args: EngineArgs, cfg: ModelConfig) -> int:
        if args.max_model_len is None:
            return cfg.max_position_embeddings
        if args.max_model_len > cfg.max_position_embeddings:
            raise ValueError(
                f"max_model_len={args.max_model_len} exceeds the model's max_position_embeddings="
                f"{cfg.max_position_embeddings} (config.json)")
        return args.max_model_len

    def _bytes_per_block(self) -> int:
        cfg = self.model_config
        return CacheEngine.bytes_per_block(num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads,
                                           head_dim=cfg.head_dim, block_size=self.args.block_size,
                                           dtype=self.dtype)

    def _plan_kv_cache(self) -> tuple[int, int]:
        """Device and host block counts; fails if one max_model_len sequence cannot fit."""
        args = self.args
        block_bytes = self._bytes_per_block()
        blocks_per_seq = math.ceil(self.max_model_len / args.block_size)
        if args.num_gpu_blocks is not None:
            num_gpu_blocks = args.num_gpu_blocks
        elif self.device.type == "cuda":
            num_gpu_blocks = self._profile_gpu_blocks(block_bytes)
        else:
            # CPU: a fixed memory budget, no more than every sequence at full length needs
            num_gpu_blocks = min(int(args.cpu_kv_cache_space * GiB) // block_bytes,
                                 blocks_per_seq * args.max_num_seqs)
        if num_gpu_blocks < blocks_per_seq:
            raise ValueError(
                f"KV cache too small: one sequence of max_model_len={self.max_model_len} needs "
                f"{blocks_per_seq} blocks of {args.block_size} tokens, but only {num_gpu_blocks} "
                f"are available; lower max_model_len or give more memory "
                f"(num_gpu_blocks / gpu_memory_utilization / cpu_kv_cache_space)")
        num_cpu_blocks = int(args.swap_space * GiB) // block_bytes
        return num_gpu_blocks, num_cpu_blocks

    @torch.inference_mode()
    def _profile_gpu_blocks(self, block_bytes: int) -> int:
        """Run a forward of a full token budget, then give what memory is left to the cache."""
        from pagedllm.attention import AttentionMetadata

        num_tokens = min(self.max_num_batched_tokens, self.max_model_len * self.args.max_num_seqs)
        seq_len = min(num_tokens, self.max_model_len)
        num_seqs = math.ceil(num_tokens / seq_len)
        bs = self.args.block_size
        blocks_per_seq = math.ceil(seq_len / bs)
        cfg = self.model_config
        scratch = torch.zeros((2, cfg.num_layers, num_seqs * blocks_per_seq, bs, cfg.num_kv_heads,
                               cfg.head_dim), dtype=self.dtype, device=self.device)
        lens = torch.full((num_seqs,), seq_len, dtype=torch.int32, device=self.device)
        meta = AttentionMetadata(
            slot_mapping=torch.arange(num_seqs * seq_len, device=self.device) % (scratch.shape[2] * bs),
            query_start_loc=torch.arange(num_seqs + 1, dtype=torch.int32, device=self.device) * seq_len,
            seq_lens=lens,
            block_tables=torch.arange(num_seqs * blocks_per_seq, dtype=torch.int32,
                                      device=self.device).view(num_seqs, blocks_per_seq),
            max_query_len=seq_len, max_seq_len=seq_len, is_decode_only=False)
        ids = torch.zeros(num_seqs * seq_len, dtype=torch.long, device=self.device)
        positions = torch.arange(seq_len, device=self.device).repeat(num_seqs)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        hidden = self.model(ids, positions, scratch, meta)
        self.model.compute_logits(hidden[-self.args.max_num_seqs:])
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - scratch.numel() * scratch.element_size()
        del scratch, hidden
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info()
        outside_torch = total - free - torch.cuda.memory_reserved()
        budget = total * self.args.gpu_memory_utilization - peak - outside_torch
        return max(int(budget // block_bytes), 0)

    # ---- requests ---------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams | None = None,
                    arrival_time: float | None = None, priority: int = 0) -> None:
        """Queue a request. Bad input raises ValueError naming the request; nothing is queued.

        `request_id` must be a str (TypeError otherwise, as in `abort_request`): ids are never
        converted, so outputs carry, and `abort_request` takes, exactly the id given here.
        Token ids must be ints (Python ints, numpy integers, an integer-dtype array); floats,
        bools and strings are refused, never truncated. `n` and `best_of` are bounded by
        `max_num_seqs`, `logprobs` by the vocabulary size, `priority` by the int64 range: each
        a ValueError naming the request, the field and the limit, before anything is allocated.
        """
        _check_request_id(request_id, "request_id")
        if request_id in self.requests:
            raise ValueError(f"request {request_id!r}: duplicate request id")
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"request {request_id!r}: params must be SamplingParams, got {type(params).__name__}")
        self._check_limits(request_id, params, arrival_time, priority)
        text, token_ids = self._tokenize(request_id, prompt)
        self._check_prompt(request_id, token_ids)
        eos_ids = list(self.model_config.eos_token_ids)
        if not eos_ids and self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos_ids = [self.tokenizer.eos_token_id]
        eos = eos_ids[0] if eos_ids else None
        # a checkpoint's further EOS ids (Llama 3) stop like stop ids, unless EOS is ignored
        stop_ids = list(params.stop_token_ids or []) + ([] if params.ignore_eos else eos_ids[1:])
        arrival = time.time() if arrival_time is None else arrival_time
        self.scheduler.add_request(
            request_id, token_ids, n=params.num_samples, priority=priority, arrival_time=arrival,
            max_tokens=params.max_tokens, min_tokens=params.min_tokens, eos_token_id=eos,
            stop_token_ids=stop_ids, ignore_eos=params.ignore_eos)
        seqs = [_Sequence(i, self._detokenizer(token_ids, params)) for i in range(params.num_samples)]
        if params.logprobs is not None or params.num_samples > params.n:
            # best_of ranks samples by cumulative logprob, so it needs them too
            for seq in seqs:
                seq.cumulative_logprob = 0.0
                seq.logprobs = [] if params.logprobs is not None else None
        self._unscheduled.add(request_id)
        self.requests[request_id] = _Request(request_id, text, token_ids, params, seqs,
                                             RequestMetrics(arrival_time=arrival),
                                             stop_token_ids=frozenset(
                                                 stop_ids + ([] if params.ignore_eos or eos is None else [eos])))

    def _check_limits(self, request_id: str, params: SamplingParams, arrival_time: Any,
                      priority: Any) -> None:
        """Per-request bounds that depend on the engine, checked before anything is queued."""
        max_seqs = self.scheduler.max_num_seqs
        for name in ("n", "best_of"):
            value = getattr(params, name)
            if value is not None and value > max_seqs:
                raise ValueError(f"request {request_id!r}: {name}={value} exceeds max_num_seqs="
                                 f"{max_seqs} (the most sequences one request may have)")
        vocab = self.model_config.vocab_size
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name, None)
            if value is not None and value > vocab:
                raise ValueError(f"request {request_id!r}: {name}={value} exceeds the vocabulary "
                                 f"size {vocab}")
        if not _is_int(priority) or not _INT64_MIN <= priority <= _INT64_MAX:
            raise ValueError(f"request {request_id!r}: priority must be an int in "
                             f"[{_INT64_MIN}, {_INT64_MAX}], got {priority!r}")
        if arrival_time is not None and not (
                (_is_int(arrival_time) or isinstance(arrival_time, float))
                and math.isfinite(arrival_time)):
            raise ValueError(f"request {request_id!r}: arrival_time must be None or a finite "
                             f"number of seconds, got {arrival_time!r}")

    def _tokenize(self, request_id: str, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"request {request_id!r}: text prompts need a tokenizer "
                                 f"(the engine was built with skip_tokenizer_init=True)")
            _check_text(request_id, "prompt", prompt)
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" not in prompt:
                raise ValueError(f"request {request_id!r}: a dict prompt needs 'prompt_token_ids'")
            text = prompt.get("prompt")
            if text is not None:
                if not isinstance(text, str):
                    raise ValueError(f"request {request_id!r}: 'prompt' must be None or a str, "
                                     f"got {type(text).__name__}")
                _check_text(request_id, "prompt", text)
            return text, _token_id_list(request_id, prompt["prompt_token_ids"])
        if isinstance(prompt, (list, tuple, np.ndarray)):
            return None, _token_id_list(request_id, prompt)
        raise ValueError(f"request {request_id!r}: unsupported prompt type {type(prompt).__name__}")

    def _check_prompt(self, request_id: str, token_ids: list[int]) -> None:
        if not token_ids:
            raise ValueError(f"request {request_id!r}: empty prompt")
        vocab = self.model_config.vocab_size
        if min(token_ids) < 0 or max(token_ids) >= vocab:  # C-level passes; locate only if bad
            i, bad = next((i, t) for i, t in enumerate(token_ids) if not 0 <= t < vocab)
            raise ValueError(f"request {request_id!r}: prompt token id {bad} (position {i}) is "
                             f"outside the vocabulary [0, {vocab})")

    def _detokenizer(self, prompt_ids: list[int], params: SamplingParams):
        if self.tokenizer is None:
            return None
        return IncrementalDetokenizer.from_params(self.tokenizer, prompt_ids, params)

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        """Abort requests in any queue; unknown or finished ids are ignored.

        Takes one id (a str, as given to `add_request`) or an iterable of them; anything else
        (an int, an iterable holding a non-str) is a TypeError, raised before anything is aborted.
        """
        if isinstance(request_ids, str):
            ids = [request_ids]
        else:
            try:
                ids = list(request_ids)
            except TypeError:
                raise TypeError(f"abort_request takes a request id (str) or an iterable of them, "
                                f"got {type(request_ids).__name__} {request_ids!r}") from None
            for request_id in ids:
                _check_request_id(request_id, "abort_request: request id")
        for request_id in ids:
            request = self.requests.get(request_id)
            if request is None or request.finished:
                continue
            self.scheduler.abort_request(request.request_id)
            request.finish_all("abort")
            self._aborted.append(request.request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self._aborted)

    def get_num_unfinished_requests(self) -> int:
        return sum(not r.finished for r in self.requests.values())

    # ---- the step ---------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One scheduling step; returns the (cumulative) state of every request it touched.

        If building, running or sampling the step raises, the step is rolled back (see the
        class docstring) and the error re-raised; the engine keeps serving."""
        t0 = time.perf_counter()
        step = self.scheduler.schedule()
        t1 = time.perf_counter()
        touched: dict[str, _Request] = {}
        for request_id in self._aborted:
            touched[request_id] = self.requests[request_id]
        self._aborted.clear()
        for request_id, reason in step.finished:
            request = self.requests[request_id]
            # never fits (prompt over max_model_len or the whole cache): finished, not dropped
            request.finish_all("length", reason)
            touched[request_id] = request
        sampled = None
        try:
            self._note_scheduled(step)
            inputs = self.runner.prepare_step(step)
            t2 = time.perf_counter()
            logits = self.runner.forward(inputs) if inputs is not None else None
            t3 = time.perf_counter()
            faulty = {}
            if logits is not None:
                sampled, faulty = self._sample_isolating(step, logits)
        except BaseException as exc:
            self._roll_back(step, touched, exc)
            raise
        if faulty:
            self._end_faulty(step, faulty, touched)
            return self._outputs(touched)
        t4 = t3
        if sampled is not None:
            t4 = time.perf_counter()
            self._update(step, sampled, touched)
        t5 = time.perf_counter()
        self._account(step, (t0, t1, t2, t3, t4, t5))
        return self._outputs(touched)

    def _outputs(self, touched: dict[str, _Request]) -> list[RequestOutput]:
        outputs = [request.output() for request in touched.values()]
        for request in touched.values():
            if request.finished:
                del self.requests[request.request_id]
                self._unscheduled.discard(request.request_id)
        return outputs

    # ---- step faults ------------------------------------------------------------------------

    def _roll_back(self, step, touched: dict[str, _Request], exc: BaseException) -> None:
        """Takes back a step that failed: its requests are recomputed by later steps (given up
        after MAX_STEP_FAULTS; an interrupt counts against nobody), and the outputs the step
        owed are returned by the next one."""
        rolled_back = self.scheduler.discard_step(step)
        counts = isinstance(exc, Exception)
        for request_id in rolled_back:
            request = self.requests[request_id]
            request.num_faults += counts
            if request.num_faults >= self.MAX_STEP_FAULTS:
                self._give_up(request, f"gave up after {request.num_faults} failed steps; last "
                                       f"error: {type(exc).__name__}: {exc}")
                touched[request_id] = request
        self._aborted.extend(touched)
        exc.add_note(f"pagedllm: step {step.step} was rolled back; {len(rolled_back)} request(s) "
                     f"will be recomputed by the next steps (the engine keeps serving)")

    def _give_up(self, request: _Request, reason: str) -> None:
        self.scheduler.abort_request(request.request_id)
        request.finish_all("abort", reason)

    def _sample_isolating(self, step, logits: torch.Tensor):
        """(sampled, {}) normally; when batched sampling raises, (None, {request id: error}) of
        the requests whose own rows fail to sample, or the error itself if none does alone."""
        try:
            return self._sample(step, logits), {}
        except Exception:
            rows_of: dict[str, list[int]] = {}
            for k, request_id in enumerate(step.sample_request_ids):
                rows_of.setdefault(request_id, []).append(k)
            faulty = {}
            for request_id, rows in rows_of.items():
                try:
                    self._sample(step, logits, rows)
                except Exception as exc:
                    faulty[request_id] = exc
            if not faulty:
                raise
            return None, faulty

    def _end_faulty(self, step, faulty: dict[str, Exception], touched: dict[str, _Request]) -> None:
        """Ends the requests a fault belongs to; the rest of the step is recomputed later."""
        self.scheduler.discard_step(step)
        for request_id, exc in faulty.items():
            request = self.requests[request_id]
            self._give_up(request, f"sampling failed: {type(exc).__name__}: {exc}")
            touched[request_id] = request
            logger.error("request %r ended: sampling failed: %s: %s", request_id,
                         type(exc).__name__, exc)

    def _note_scheduled(self, step) -> None:
        if self._unscheduled and step.num_seqs:
            now = time.time()
            for request_id in self._unscheduled.intersection(step.request_ids):
                self._unscheduled.discard(request_id)
                request = self.requests[request_id]
                request.metrics.first_scheduled_time = now
                request.metrics.time_in_queue = now - request.metrics.arrival_time
                request.num_cached_tokens = self.scheduler.num_cached_tokens(request_id) or 0
        for request_id in step.preempted:
            self.requests[request_id].metrics.num_preemptions += 1

    def _sample(self, step, logits: torch.Tensor, rows: list[int] | None = None):
        """Samples every row of `logits` (or only `rows` of them, to find a faulty request)."""
        request_ids = step.sample_request_ids
        seq_index = step.sample_seq_index.tolist()
        if rows is not None:
            request_ids = [request_ids[k] for k in rows]
            seq_index = [seq_index[k] for k in rows]
            logits = logits[rows]
        requests = [self.requests[rid] for rid in request_ids]
        seqs = [request.seqs[i] for request, i in zip(requests, seq_index)]
        meta = SamplingMetadata.build(
            [r.sampling_params for r in requests], [s.token_ids for s in seqs],
            [r.prompt_token_ids for r in requests], seq_index, vocab_size=logits.shape[-1],
            eos_token_id=self.model_config.eos_token_id, device=logits.device)
        return self.sampler(logits, meta)

    def _update(self, step, sampled, touched: dict[str, _Request]) -> None:
        tokens = sampled.sampled_token_ids.cpu().numpy()
        logprobs = sampled.logprobs.tolists() if sampled.logprobs is not None else None
        stop_hits = np.zeros(len(tokens), dtype=bool)
        stop_strings: dict[tuple[str, int], str] = {}
        faulty: dict[str, Exception] = {}
        now = time.time()
        for k, (request_id, index, token) in enumerate(
                zip(step.sample_request_ids, step.sample_seq_index.tolist(), tokens.tolist())):
            request = self.requests[request_id]
            touched[request_id] = request
            try:
                stop = self._append_token(request, request.seqs[index], k, token, logprobs, now)
            except Exception as exc:  # this request's fault (e.g. its detokenizer): it alone ends
                faulty.setdefault(request_id, exc)
                continue
            if stop is not None:
                stop_hits[k] = True
                stop_strings[(request_id, index)] = stop
        for request_id, exc in faulty.items():
            self._give_up(self.requests[request_id],
                          f"output processing failed: {type(exc).__name__}: {exc}")
            logger.error("request %r ended: output processing failed: %s: %s", request_id,
                         type(exc).__name__, exc)
        finished = self.scheduler.update_from_output(step, tokens, stop_hits)
        for request_id, index, reason, stop_reason, _ in finished:
            request = self.requests[request_id]
            stop_reason = stop_strings.get((request_id, index), stop_reason)
            request.seqs[index].finish(reason, stop_reason)
            if request.finished:
                request.metrics.finished_time = time.time()
            touched[request_id] = request

    def _append_token(self, request: _Request, seq: _Sequence, k: int, token: int, logprobs,
                      now: float) -> str | None:
        """Adds sample `k` to its sequence (token, logprobs, text); returns a matched stop string."""
        seq.token_ids.append(token)
        if request.metrics.first_token_time is None:
            request.metrics.first_token_time = now
        request.metrics.last_token_time = now
        if seq.cumulative_logprob is not None and logprobs is not None:
            seq.cumulative_logprob += logprobs.sampled_logprobs[k]
            if request.params.logprobs is not None:
                seq.logprobs.append(logprobs.entry(k, token, request.params.logprobs, self._decode_one))
        if seq.detokenizer is not None and not self._ends_by_token(request, seq, token):
            return seq.detokenizer.append(token)[1]
        return None

    def _ends_by_token(self, request: _Request, seq: _Sequence, token: int) -> bool:
        """EOS or a stop token id that will end the sequence: its text is not part of the output
        (vLLM), unless the request keeps stop strings in the output."""
        params = request.params
        if params.include_stop_str_in_output or len(seq.token_ids) < params.min_tokens:
            return False
        return token in request.stop_token_ids

    def _decode_one(self, token_id: int) -> str | None:
        return self.tokenizer.decode([token_id], skip_special_tokens=False) if self.tokenizer else None

    def _account(self, step, marks: tuple[float, ...]) -> None:
        """Add the phase times (schedule, prepare incl. block ops, forward, sample, update)."""
        t = self.timings
        t.steps += 1
        for name, start, end in zip(("schedule", "prepare", "forward", "sample", "update"),
                                    marks, marks[1:]):
            setattr(t, name, getattr(t, name) + end - start)
        self._stats.record(int(step.num_batched_tokens), len(step.sample_rows), self)

    # ---- stats ------------------------------------------------------------------------------

    def get_stats(self) -> dict[str, Any]:
        """Scheduler/cache statistics plus throughput since start."""
        stats = dict(self.scheduler.get_stats())
        stats.update(self._stats.totals())
        return stats


_INT64_MIN, _INT64_MAX = -2**63, 2**63 - 1


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _check_request_id(request_id: Any, what: str) -> None:
    if not isinstance(request_id, str):
        raise TypeError(f"{what} must be a str, got {type(request_id).__name__} {request_id!r}")


def _check_text(request_id: str, name: str, text: str) -> None:
    """Text must encode as UTF-8 (no lone surrogates); ASCII text (the usual case) is free."""
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(f"request {request_id!r}: {name} is not valid Unicode text: lone "
                             f"surrogate {text[e.start]!r} at position {e.start}") from None


def _token_id_list(request_id: str, ids: Any) -> list[int]:
    """Prompt token ids as a list of Python ints: a list / tuple of ints (or numpy integers) or
    a 1-D integer numpy array / torch tensor. Anything else (floats, bools, strings, None) is a
    ValueError naming the request and the offending position: never truncated or coerced."""
    if isinstance(ids, np.ndarray):
        if ids.ndim != 1 or (ids.size and ids.dtype.kind not in "iu"):
            raise ValueError(f"request {request_id!r}: prompt_token_ids must be a 1-D integer "
                             f"array, got a {ids.ndim}-D {ids.dtype} array")
        return ids.tolist()
    if isinstance(ids, torch.Tensor):
        dtype = ids.dtype
        if ids.dim() != 1 or (ids.numel() and (dtype.is_floating_point or dtype.is_complex
                                               or dtype == torch.bool)):
            raise ValueError(f"request {request_id!r}: prompt_token_ids must be a 1-D integer "
                             f"tensor, got a {ids.dim()}-D {dtype} tensor")
        return ids.tolist()
    if not isinstance(ids, (list, tuple, range)):
        raise ValueError(f"request {request_id!r}: prompt_token_ids must be a list of ints or an "
                         f"integer numpy array, got {type(ids).__name__} {ids!r:.80}")
    if set(map(type, ids)) <= {int}:  # the usual case, one C-level pass
        return list(ids)
    for i, t in enumerate(ids):
        if not _is_int(t):
            raise ValueError(f"request {request_id!r}: prompt_token_ids[{i}] must be an int, got "
                             f"{type(t).__name__} {t!r:.80}")
    return [int(t) for t in ids]


class _ThroughputStats:
    """Token counters and the periodic log line (tokens/s, queues, KV usage, hits, preemptions)."""

    def __init__(self, interval: float, *, enabled: bool) -> None:
        self.interval = interval
        self.enabled = enabled
        self.started = time.perf_counter()
        self.last_log = self.started
        self.processed_tokens = self.generation_tokens = 0
        self._window_processed = self._window_generation = 0

    def record(self, num_batched_tokens: int, num_generated: int, engine: LLMEngine) -> None:
        self.processed_tokens += num_batched_tokens
        self.generation_tokens += num_generated
        self._window_processed += num_batched_tokens
        self._window_generation += num_generated
        now = time.perf_counter()
        if self.enabled and now - self.last_log >= self.interval:
            self._log(engine, now - self.last_log)
            self.last_log = now
            self._window_processed = self._window_generation = 0

    def _log(self, engine: LLMEngine, elapsed: float) -> None:
        s = engine.scheduler.get_stats()
        logger.info(
            "processed %.1f tok/s, generation %.1f tok/s | running %d, waiting %d, swapped %d | "
            "KV usage %.1f%% | prefix hit rate %.1f%% | preemptions %d",
            self._window_processed / elapsed, self._window_generation / elapsed,
            s["num_running"], s["num_waiting"], s["num_swapped"], 100 * s["kv_usage"],
            100 * s["prefix_cache_hit_rate"], s["num_preemptions"])

    def totals(self) -> dict[str, float]:
        elapsed = max(time.perf_counter() - self.started, 1e-9)
        return {"processed_tokens": self.processed_tokens,
                "generation_tokens": self.generation_tokens,
                "generation_throughput": self.generation_tokens / elapsed,
                "processed_throughput": self.processed_tokens / elapsed}
