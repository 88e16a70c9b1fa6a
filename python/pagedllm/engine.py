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
    """Step-wise engine (vLLM's names): add requests, call `step()` until nothing is left."""

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
        """Queue a request. Bad input raises ValueError naming the request; nothing is queued."""
        request_id = str(request_id)
        if request_id in self.requests:
            raise ValueError(f"request {request_id!r}: duplicate request id")
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"request {request_id!r}: params must be SamplingParams, got {type(params).__name__}")
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

    def _tokenize(self, request_id: str, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"request {request_id!r}: text prompts need a tokenizer "
                                 f"(the engine was built with skip_tokenizer_init=True)")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" not in prompt:
                raise ValueError(f"request {request_id!r}: a dict prompt needs 'prompt_token_ids'")
            return prompt.get("prompt"), [int(t) for t in prompt["prompt_token_ids"]]
        if isinstance(prompt, (list, tuple, np.ndarray)):
            return None, [int(t) for t in prompt]
        raise ValueError(f"request {request_id!r}: unsupported prompt type {type(prompt).__name__}")

    def _check_prompt(self, request_id: str, token_ids: list[int]) -> None:
        if not token_ids:
            raise ValueError(f"request {request_id!r}: empty prompt")
        vocab = self.model_config.vocab_size
        bad = next((t for t in token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"request {request_id!r}: prompt token id {bad} is outside the "
                             f"vocabulary [0, {vocab})")

    def _detokenizer(self, prompt_ids: list[int], params: SamplingParams):
        if self.tokenizer is None:
            return None
        return IncrementalDetokenizer.from_params(self.tokenizer, prompt_ids, params)

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        """Abort requests in any queue; unknown or finished ids are ignored."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        for request_id in ids:
            request = self.requests.get(str(request_id))
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
        """One scheduling step; returns the (cumulative) state of every request it touched."""
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
        self._note_scheduled(step)
        inputs = self.runner.prepare_step(step)
        t2 = time.perf_counter()
        logits = self.runner.forward(inputs) if inputs is not None else None
        t3 = time.perf_counter()
        if logits is not None:
            sampled = self._sample(step, logits)
            t4 = time.perf_counter()
            self._update(step, sampled, touched)
        else:
            t4 = t3
        t5 = time.perf_counter()
        self._account(step, (t0, t1, t2, t3, t4, t5))
        outputs = [request.output() for request in touched.values()]
        for request in touched.values():
            if request.finished:
                del self.requests[request.request_id]
                self._unscheduled.discard(request.request_id)
        return outputs

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

    def _sample(self, step, logits: torch.Tensor):
        rows = [self.requests[rid] for rid in step.sample_request_ids]
        seq_index = step.sample_seq_index.tolist()
        seqs = [request.seqs[i] for request, i in zip(rows, seq_index)]
        meta = SamplingMetadata.build(
            [r.sampling_params for r in rows], [s.token_ids for s in seqs], [r.prompt_token_ids for r in rows],
            seq_index, vocab_size=logits.shape[-1], eos_token_id=self.model_config.eos_token_id,
            device=logits.device)
        return self.sampler(logits, meta)

    def _update(self, step, sampled, touched: dict[str, _Request]) -> None:
        tokens = sampled.sampled_token_ids.cpu().numpy()
        logprobs = sampled.logprobs.tolists() if sampled.logprobs is not None else None
        stop_hits = np.zeros(len(tokens), dtype=bool)
        stop_strings: dict[tuple[str, int], str] = {}
        now = time.time()
        for k, (request_id, index, token) in enumerate(
                zip(step.sample_request_ids, step.sample_seq_index.tolist(), tokens.tolist())):
            request = self.requests[request_id]
            seq = request.seqs[index]
            seq.token_ids.append(token)
            if request.metrics.first_token_time is None:
                request.metrics.first_token_time = now
            request.metrics.last_token_time = now
            if seq.cumulative_logprob is not None and logprobs is not None:
                seq.cumulative_logprob += logprobs.sampled_logprobs[k]
                if request.params.logprobs is not None:
                    seq.logprobs.append(
                        logprobs.entry(k, token, request.params.logprobs, self._decode_one))
            if seq.detokenizer is not None and not self._ends_by_token(request, seq, token):
                _, stop = seq.detokenizer.append(token)
                if stop is not None:
                    stop_hits[k] = True
                    stop_strings[(request_id, index)] = stop
            touched[request_id] = request
        finished = self.scheduler.update_from_output(step, tokens, stop_hits)
        for request_id, index, reason, stop_reason, _ in finished:
            request = self.requests[request_id]
            stop_reason = stop_strings.get((request_id, index), stop_reason)
            request.seqs[index].finish(reason, stop_reason)
            if request.finished:
                request.metrics.finished_time = time.time()
            touched[request_id] = request

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
