"""`LLMEngine`: the step loop.

schedule (Rust) -> swap/copy blocks -> tensors from the step arrays -> forward -> sample ->
detokenize and check stop strings -> `update_from_output` (Rust) -> RequestOutputs.

The engine holds the live requests (`requests`, a `RequestRegistry`: their one owner, which its
parts read and go through) and drives its parts: the scheduler (Rust), the worker (model runner
over the cache engine), the sampler, the output processor, the step-fault handling and the
statistics.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from functools import partial
from typing import Any

import torch

from pagedllm._core import Scheduler, request_id_list
from pagedllm.config import EngineArgs
from pagedllm.engine.faults import StepFaults, sample_isolating
from pagedllm.engine.inputs import InputProcessor, PromptType
from pagedllm.engine.kv_sizing import KVCachePlanner, apply_kv_groups, resolve_max_model_len
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.engine.parts import (
    check_model_fits,
    draft_model,
    eos_token_ids,
    kv_events_publisher,
    kv_offloading_kwargs,
    kv_transfer,
    spec_decoder,
)
from pagedllm.engine.registry import RequestRegistry
from pagedllm.engine.request import RequestState, StopTokens
from pagedllm.engine.stats import StepTimings, ThroughputStats
from pagedllm.executor import create_executor
from pagedllm.executor.base import rank_zero_runner
from pagedllm.lora.request import LoRARequest
from pagedllm.models import (
    ModelConfig,
    load_model_config,
    resolve_device,
    resolve_dtype,
)
from pagedllm.outputs import RequestOutput
from pagedllm.sampling import Sampler, SamplingMetadata
from pagedllm.sampling.prompt_logprobs import PromptLogprobs
from pagedllm.sampling.verification import has_drafts
from pagedllm.sampling_params import BeamSearchParams, SamplingParams
from pagedllm.spec_decode import VerifiedTokens
from pagedllm.spec_decode.decoder import SpecDecoder
from pagedllm.structured_output.manager import StructuredOutputManager
from pagedllm.tokenizer import load_tokenizer
from pagedllm.worker.worker import Worker


class LLMEngine:
    """Step-wise engine (vLLM's names): add requests, call `step()` until nothing is left.

    A step that fails after scheduling (building inputs, the forward, sampling) is rolled back:
    its requests are recomputed by later steps, and `step()` re-raises the error. The requests
    of the failed forward then run apart, in halves, until the one at fault is found
    (`engine/faults.py`): a request whose forward fails alone in `MAX_STEP_FAULTS` steps while
    the rest ran fine is given up (it finishes with `finish_reason="abort"` and the error in
    `stop_reason`), and so is one in `MAX_UNATTRIBUTED_FAULTS` failed steps in a row where
    nothing ran fine (the device may be failing); the others finish with the outputs they
    would have had. A fault that belongs to one request (its sampling or output processing
    raises, its LoRA adapter can no longer be read) ends only that request, the same way,
    without raising.
    """

    MAX_STEP_FAULTS = 3
    MAX_UNATTRIBUTED_FAULTS = 8

    def __init__(self, args: EngineArgs) -> None:
        args.validate()
        if args.data_parallel_size > 1:
            raise ValueError(
                f"data_parallel_size={args.data_parallel_size}: one LLMEngine is one replica; "
                "replicas run behind a router (`pagedllm serve -dp N`, or `pagedllm router`)"
            )
        self.args = args
        self.device = resolve_device(args.device)
        # config.json is validated before anything big is allocated
        self.model_config: ModelConfig = load_model_config(args.model)
        cfg = self.model_config
        check_model_fits(args, cfg, self.device)
        self.max_model_len = resolve_max_model_len(args, cfg)
        self.dtype = resolve_dtype(args.dtype, cfg, self.device)
        torch.manual_seed(args.seed)
        self.tokenizer = None
        if not args.skip_tokenizer_init:
            self.tokenizer = load_tokenizer(
                args.tokenizer or args.model,
                eos_token_id=cfg.eos_token_id,
                bos_token_id=cfg.bos_token_id,
            )
        self.eos_token_ids = eos_token_ids(cfg, self.tokenizer)
        generator = torch.Generator(device=self.device)
        generator.manual_seed(args.seed)
        # speculative decoding (None: off); checked before the model is loaded
        self.spec = spec_decoder(args, cfg, generator)
        # the other ranks (none with one) are spawned and load their shards first
        self.executor = create_executor(args, self.dtype)
        try:
            self._build(args, cfg, generator)
        except BaseException:
            self.shutdown()
            raise

    def _build(self, args: EngineArgs, cfg: ModelConfig, generator: torch.Generator) -> None:
        """Rank 0's worker (its shard of the model, its LoRA slots: before the KV cache is sized,
        the adapters' device slots take memory too), the KV cache planned and allocated on every
        rank, the scheduler and the step's parts."""
        self.worker = Worker(args, 0, dtype=self.dtype, device=self.device)
        self.model, self.lora = self.worker.model, self.worker.lora
        draft = draft_model(self.spec, dtype=self.dtype, device=self.device)
        self.max_num_batched_tokens = args.resolved_max_num_batched_tokens(self.max_model_len)
        num_gpu_blocks, num_cpu_blocks = KVCachePlanner(
            args,
            cfg,
            self.model,
            dtype=self.dtype,
            device=self.device,
            max_model_len=self.max_model_len,
            max_num_batched_tokens=self.max_num_batched_tokens,
            draft=draft,
        ).plan()
        runner = self.executor.start_workers(num_gpu_blocks, num_cpu_blocks, self.worker.init_cache)
        self.cache_engine = self.worker.cache_engine
        self.cache_engine.log_capacity()
        # the offload tier (None: off): its host pool, and the copies the scheduler asks for
        self.kv_transfer = kv_transfer(args, self.cache_engine, self.device)
        if draft is not None:
            draft.allocate_cache(
                block_size=args.block_size,
                num_gpu_blocks=num_gpu_blocks,
                num_cpu_blocks=num_cpu_blocks,
                max_num_seqs=args.max_num_seqs,
            )
            self.spec.attach_draft(draft)
        self.scheduler = Scheduler(
            block_size=args.block_size,
            num_gpu_blocks=num_gpu_blocks,
            num_cpu_blocks=num_cpu_blocks,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_num_seqs=args.max_num_seqs,
            max_model_len=self.max_model_len,
            scheduling=args.scheduling,
            policy=args.policy,
            preemption_mode=args.preemption_mode,
            enable_prefix_caching=args.enable_prefix_caching,
            watermark=args.watermark,
            long_prefill_token_threshold=args.long_prefill_token_threshold,
            delay_factor=args.delay_factor,
            max_loras=args.max_loras if args.enable_lora else 0,
            **kv_offloading_kwargs(args, self.kv_transfer),
            **(self.spec.scheduler_kwargs(args.scheduling) if self.spec else {}),
        )
        apply_kv_groups(self.scheduler, self.worker.kv_layout)  # sliding windows' own blocks
        self.kv_events = kv_events_publisher(args, self.scheduler)
        self.worker.capture_cuda_graphs(self.max_model_len)
        self.runner = rank_zero_runner(runner, self.executor)
        self.sampler = Sampler(generator)
        self.requests = RequestRegistry(self.scheduler)
        if self.kv_transfer is not None:
            backend = args.resolved_kv_offloading_backend
            self.requests.offload_tier = "host" if backend == "native" else backend
        self.inputs = InputProcessor(
            self.tokenizer, vocab_size=cfg.vocab_size, max_model_len=self.max_model_len
        )
        self.output_processor = OutputProcessor(self.tokenizer, self.requests, self.scheduler)
        self.beams = self.output_processor.beams  # beam requests (`engine/beam_search.py`)
        self.prompt_logprobs = PromptLogprobs(self.output_processor.decode_one)
        self.structured_output = StructuredOutputManager(
            self.tokenizer, cfg.vocab_size, self.eos_token_ids
        )
        self.faults = StepFaults(
            self.scheduler, self.requests, self.MAX_STEP_FAULTS, self.MAX_UNATTRIBUTED_FAULTS
        )
        # finished requests whose final output the next step returns (aborted, or owed by a
        # step that failed)
        self._owed_outputs: list[str] = []
        # added but never scheduled: only these need first-scheduling bookkeeping, so a pure
        # decode step skips reading the step's request ids
        self._unscheduled: set[str] = set()
        self.timings = StepTimings()
        self._stats = ThroughputStats(
            args.stats_log_interval, self.scheduler.get_stats, enabled=not args.disable_log_stats
        )

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLMEngine:
        return cls(args)

    @property
    def dead_reason(self) -> str | None:
        """Why the engine can run no more steps (a tensor-parallel rank died, hung or failed; the
        engine was shut down), known between steps too; None while it can run them."""
        return self.executor.dead

    def on_death(self, callback) -> None:
        """Have `callback(reason)` called (from another thread) when a tensor-parallel rank dies
        between steps; a death in a step raises from the step instead."""
        self.executor.on_death.append(callback)

    def shutdown(self) -> None:
        """Stops the tensor-parallel workers (none with one rank), the offload tier's copy
        thread and the KV-event publisher. The engine runs no more steps after it under tensor
        parallelism."""
        self.executor.shutdown()
        if getattr(self, "kv_transfer", None) is not None:
            self.kv_transfer.shutdown()
        self.close_kv_events()

    def close_kv_events(self) -> None:
        """Stops publishing KV events and frees the sockets (nothing when events are off)."""
        publisher = getattr(self, "kv_events", None)
        if publisher is not None:
            self.kv_events = None
            self.scheduler.set_kv_events(False)
            publisher.close()

    # ---- requests ---------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | BeamSearchParams | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Queue a request. Bad input raises ValueError naming the request; nothing is queued.
        With `BeamSearchParams` the request is a beam search (its output: the best beams).

        `lora_request` runs it with that LoRA adapter (needs `enable_lora`): its folder is read
        and checked here, a bad one is a ValueError naming the adapter and the problem.

        `request_id` must be a str (TypeError otherwise, as in `abort_request`): ids are never
        converted, so outputs carry, and `abort_request` takes, exactly the id given here.
        Token ids must be ints (Python ints, numpy integers, an integer-dtype array); floats,
        bools and strings are refused, never truncated. `n` and `best_of` are bounded by
        `max_num_seqs`, `logprobs` by the vocabulary size, `priority` by the int64 range: each
        a ValueError naming the request, the field and the limit, before anything is allocated.
        """
        if isinstance(params, BeamSearchParams):  # a beam search (`engine/beam_search.py`)
            args = (lora_request, priority, arrival_time)
            return self.beams.add(self, request_id, prompt, params, *args)
        params = params if params is not None else SamplingParams()
        text, prompt_ids, params = self.inputs.process(request_id, prompt, params)
        if lora_request is not None and not isinstance(lora_request, LoRARequest):
            raise TypeError(
                f"lora_request must be a LoRARequest, got {type(lora_request).__name__} "
                f"{lora_request!r}"
            )
        stop = StopTokens.of(params, self.eos_token_ids)
        arrival = time.time() if arrival_time is None else arrival_time
        # the request rules are the scheduler's: asked here, before any per-sequence state
        request = {
            "n": params.n,
            "best_of": params.best_of,
            "priority": priority,
            "arrival_time": arrival,
            "max_tokens": params.max_tokens,
            "min_tokens": params.min_tokens,
            "eos_token_id": stop.eos_token_id,
            "stop_token_ids": stop.stop_token_ids,
            "ignore_eos": params.ignore_eos,
            "lora_id": lora_request.lora_int_id if lora_request is not None else 0,
            "structured_output": params.structured_outputs is not None,
            "extra_key": self.prompt_logprobs.cache_key(params),
        }
        token_ids = self.scheduler.validate_request(request_id, prompt_ids, **request)
        if request_id in self.requests:
            raise ValueError(f"request {request_id!r}: duplicate request id")
        token_ids = self.inputs.truncate(token_ids, params.truncate_prompt_tokens)
        self.inputs.check_prompt(request_id, token_ids)
        if lora_request is not None:
            self.lora.add(lora_request)  # checks and loads its adapter (LoRA is on: validated)
            if self.kv_events is not None:
                self.kv_events.note_lora(lora_request.lora_int_id)
        constraint = params.structured_outputs
        if constraint is not None and self.tokenizer is None:
            raise ValueError(
                f"request {request_id!r}: structured_outputs needs a tokenizer (the engine was "
                f"built with skip_tokenizer_init=True)"
            )
        state = RequestState.new(request_id, text, token_ids, params, stop, arrival, self.tokenizer)
        state.lora_request = lora_request
        self.scheduler.add_request(request_id, token_ids, **request)
        self.prompt_logprobs.add(request_id, token_ids, params)
        self._unscheduled.add(request_id)
        self.requests.add(state)
        if constraint is not None:
            # compiles off the engine thread; the scheduler holds the request until then
            self.structured_output.submit(request_id, constraint)

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Checks and loads an adapter ahead of its requests (vLLM's `add_lora`)."""
        if self.lora is None:
            raise ValueError("add_lora: LoRA is not enabled (enable_lora=True)")
        self.lora.add(lora_request)
        return True

    def list_loras(self) -> set[int]:
        """Ids of the adapters added so far."""
        return set() if self.lora is None else self.lora.list_loras()

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        """Abort requests in any queue; unknown or finished ids are ignored.

        Takes one id (a str, as given to `add_request`) or an iterable of them; anything else
        (an int, an iterable holding a non-str) is a TypeError, raised before anything is aborted.
        """
        ids = request_id_list(request_ids)  # the scheduler's rule of the argument
        for request_id in ids:
            request = self.requests.get(request_id)
            if request is None or request.finished:
                continue
            self.requests.abort(request_id)
            self._owed_outputs.append(request_id)

    def has_unfinished_requests(self) -> bool:
        # the offload tier's transfers count: their blocks come back once they are reported
        return (
            self.scheduler.has_unfinished_requests()
            or bool(self._owed_outputs)
            or (self.kv_transfer is not None and self.scheduler.has_pending_transfers())
        )

    def get_num_unfinished_requests(self) -> int:
        return self.requests.num_unfinished()

    # ---- the step ---------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One scheduling step; returns the (cumulative) state of every request it touched.

        If building, running or sampling the step raises, the step is rolled back (see the
        class docstring) and the error re-raised; the engine keeps serving. With KV events on,
        the step's prefix-cache changes are published as one batch, failed step or not."""
        if self.kv_events is None:
            return self._step()
        try:
            return self._step()
        finally:
            self.kv_events.publish_step(self.scheduler)

    def _step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        if self.structured_output.has_pending:
            self._grammars_compiled()
        if self.kv_transfer is not None:
            self._transfers_finished()
        step = self.scheduler.schedule()
        load_failed = False
        if self.kv_transfer is not None:
            # first, before anything can fail: the scheduler holds their blocks until reported
            load_failed = self._start_transfers(step)
        t1 = time.perf_counter()
        touched: dict[str, RequestState] = {}
        for request_id in self._owed_outputs:
            touched[request_id] = self.requests[request_id]
        self._owed_outputs.clear()
        for request_id, reason in step.finished:
            # never fits (prompt over max_model_len or the whole cache): finished, not dropped
            touched[request_id] = self.requests.finish(request_id, "length", reason)
        if load_failed:
            # the step would read blocks that never loaded: its requests compute them again
            self.scheduler.discard_step(step)
            return self._outputs(touched)
        sampled = grammar = None
        t2 = t3 = t1
        try:
            self._note_scheduled(step)
            # before anything runs: a request whose adapter can no longer be read fails alone
            faulty = self._lost_adapters(step)
            stage = "loading its LoRA adapter"
            if not faulty:
                # structured output: the bitmask fills on its thread while the forward runs
                grammar = self.structured_output.start_fill(step, self.requests)
                groups = self.faults.groups(step)  # None: nobody in quarantine, one forward
                inputs = self._prepare(step, groups)
                t2 = time.perf_counter()
                if groups is not None:
                    logits = self.faults.run_groups(step, groups, self._forward_rows)
                elif inputs is not None:
                    logits = self._forward(inputs, self.prompt_logprobs.rows_of(step))
                else:
                    logits = None
                t3 = time.perf_counter()
                stage = "sampling"
                if logits is not None:
                    if self.spec is not None and has_drafts(step):
                        sample = partial(self._verify, grammar=grammar)
                    else:
                        sample = partial(self._sample, grammar=grammar)
                    sampled, faulty = sample_isolating(sample, step, logits)
        except BaseException as exc:
            if grammar is not None:
                grammar.settle()
            self.faults.roll_back(step, touched, exc)
            self._owed_outputs.extend(touched)  # the outputs this step owed come with the next one
            raise
        if faulty:
            self.faults.end_faulty(step, faulty, touched, stage)
            return self._outputs(touched)
        t4 = t3
        generated = 0
        if sampled is not None:
            t4 = time.perf_counter()
            generated = self._update(step, sampled, touched, grammar)
        elif not step.num_seqs and self.structured_output.has_pending:
            # nothing to run but grammars to wait for: wait for one instead of spinning
            self.structured_output.wait_for_compile(timeout=0.05)
        elif not step.num_seqs and self.kv_transfer and self.scheduler.has_pending_transfers():
            # nothing to run but transfers (a parked request's load): wait for one
            self.kv_transfer.wait_for_any(timeout=0.05)
        if self.spec is not None:
            self.spec.propose(
                self.scheduler,
                step if sampled is not None else None,
                self.requests,
                self.structured_output,
            )
        t5 = time.perf_counter()
        self.timings.add((t0, t1, t2, t3, t4, t5))
        self._stats.record(int(step.num_batched_tokens), generated)
        return self._outputs(touched)

    def _lost_adapters(self, step) -> dict[str, Exception]:
        """Puts the step's LoRA adapters into device slots; returns the requests whose adapter
        can no longer be read (its folder changed or vanished since it was added) -> the error."""
        if self.lora is None:
            return {}
        lora_ids = step.lora_ids
        if not lora_ids.any():
            return {}
        lost = self.lora.load_step(lora_ids)
        if not lost:
            return {}
        return {
            request_id: lost[lora_id]
            for request_id, lora_id in zip(step.request_ids, lora_ids.tolist())
            if lora_id in lost
        }

    def _prepare(self, step, groups):
        """Runs the step's block operations; returns its inputs (None: nothing to compute, or
        `groups` in quarantine, which build their own)."""
        if groups is None:
            inputs = self.runner.prepare_step(step)
        else:
            self.runner.execute_block_ops(step)
            inputs = None
        if self.spec is not None:
            self.spec.execute_block_ops(step)
        return inputs

    def _forward(self, inputs, prompt=None) -> torch.Tensor | None:
        """`prompt`: the rows whose logits prompt logprobs need (`PromptLogprobs.rows_of`)."""
        # (no `prompt` argument when there is none: the usual call, which tests stand in for)
        logits = (
            self.runner.forward(inputs) if prompt is None else self.runner.forward(inputs, prompt)
        )
        self.prompt_logprobs.collect(prompt)
        if self.spec is not None:
            self.spec.mirror(inputs)
        return logits

    def _forward_rows(self, rows) -> torch.Tensor | None:
        """The forward of some of the step's rows (a group in quarantine, `StepRows`)."""
        return self._forward(self.runner.prepare(rows), self.prompt_logprobs.rows_of(rows))

    def _start_transfers(self, step) -> bool:
        """Starts the step's saves and loads; its synchronous loads (the host tier's) are
        copied in now and reported at once. True when one of them failed: the step must be
        discarded."""
        jobs, invalid = self.kv_transfer.start_load_kv(step)
        if jobs:
            self.scheduler.update_connector_output(jobs, [], invalid)
        return bool(invalid)

    def _transfers_finished(self) -> None:
        """The offload tier's finished loads and saves, fed back to the scheduler: parked
        requests whose prefix loaded become admissible, saved blocks are given back."""
        recving, sending, invalid, removed = self.kv_transfer.get_finished()
        if recving or sending or removed:
            self.scheduler.update_connector_output(recving, sending, invalid, removed)

    def _grammars_compiled(self) -> None:
        """Requests whose grammar finished compiling: schedulable from this step on, or ended
        with the compile's error (their output comes with this step)."""
        for request_id, error in self.structured_output.take_compiled(self.requests):
            if error is None:
                self.scheduler.grammar_ready(request_id)
                continue
            self.requests.abort(request_id, f"structured output: {error}")
            self._owed_outputs.append(request_id)

    def _outputs(self, touched: dict[str, RequestState]) -> list[RequestOutput]:
        outputs = [request.output() for request in touched.values()]
        for output in outputs:
            output.prompt_logprobs = self.prompt_logprobs.result(output.request_id)
        for request in touched.values():
            if request.finished:
                self.prompt_logprobs.release(request.request_id)
                self.requests.release(request.request_id)
                self._unscheduled.discard(request.request_id)
                self.faults.forget(request.request_id)
                self.structured_output.release(request.request_id)
        return outputs

    def _note_scheduled(self, step) -> None:
        if self._unscheduled and step.num_seqs:
            now = time.time()
            for request_id in self._unscheduled.intersection(step.request_ids):
                self._unscheduled.discard(request_id)
                self.requests.first_scheduled(request_id, now)
        for request_id in step.preempted:
            self.requests.preempted(request_id)

    def _sample(self, step, logits: torch.Tensor, rows: list[int] | None = None, *, grammar=None):
        """Samples every row of `logits` (or only `rows` of them, to find a faulty request);
        `grammar`: the step's structured-output bitmask, applied first."""
        request_ids = step.sample_request_ids
        seq_index = step.sample_seq_index.tolist()
        mask = grammar.mask() if grammar is not None else None
        if rows is not None:
            request_ids = [request_ids[k] for k in rows]
            seq_index = [seq_index[k] for k in rows]
            logits = logits[rows]
            mask = mask.subset(rows) if mask is not None else None
        requests = [self.requests[rid] for rid in request_ids]
        seqs = [request.seqs[i] for request, i in zip(requests, seq_index)]
        meta = SamplingMetadata.build(
            [r.sampling_params for r in requests],
            [s.token_ids for s in seqs],
            [r.prompt_token_ids for r in requests],
            seq_index,
            vocab_size=logits.shape[-1],
            stop_token_ids=[r.stop.ids for r in requests],
            device=logits.device,
        )
        return self.sampler(logits, meta, mask)

    def _verify(self, step, logits: torch.Tensor, rows: list[int] | None = None, *, grammar=None):
        """Verifies the drafts of every sample (or only samples `rows`, to find a faulty
        request); `logits` holds each sample's scored positions (see `SpecDecoder.verify`).
        `grammar`'s bitmask masks every position of a constrained sample."""
        mask = grammar.verification_mask(rows) if grammar is not None else None
        return self.spec.verify(step, logits, self.requests, rows, mask)

    def _update(self, step, sampled, touched: dict[str, RequestState], grammar=None) -> int:
        """Appends the step's tokens and applies them in the scheduler; returns how many."""
        if isinstance(sampled, VerifiedTokens):
            appended = self.output_processor.append_runs(step, sampled, touched)
        else:
            appended = self.output_processor.append(step, sampled, touched)
        for request_id, exc in appended.faulty.items():
            self.faults.end_request(request_id, "output processing", exc)
        if grammar is not None:
            rejected = self.structured_output.advance(grammar, appended.tokens, appended.num_tokens)
            for request_id, exc in rejected.items():
                if request_id not in appended.faulty:
                    self.faults.end_request(request_id, "structured output", exc)
        if appended.num_tokens is None:
            finished = self.scheduler.update_from_output(step, appended.tokens, appended.stop_hits)
        else:
            finished = self.scheduler.update_from_output(
                step, appended.tokens, appended.stop_hits, num_tokens=appended.num_tokens
            )
        self.output_processor.finish(finished, appended, touched)
        return len(appended.tokens)

    # ---- stats ------------------------------------------------------------------------------

    def get_stats(self) -> dict[str, Any]:
        """Scheduler/cache statistics plus throughput since start."""
        stats = dict(self.scheduler.get_stats())
        stats.update(self.cache_engine.stats())
        stats.update(self._stats.totals())
        if self.runner.cpu_isa is not None:  # CPU: the Rust kernels' ISA level, the flags
            stats["cpu_isa"], stats["cpu_isa_flags"] = self.runner.cpu_isa
        stats.update(self.spec.stats() if self.spec is not None else SpecDecoder.NO_STATS)
        if self.kv_transfer is not None:
            stats.update(self.kv_transfer.stats())
        if self.model.config.moe is not None:
            from pagedllm.models.moe import expert_token_counts

            # per MoE layer, the tokens each expert took since start: the load an operator reads
            # (every rank routes the same tokens, so rank 0's counts are the whole engine's)
            stats["moe_expert_tokens"] = expert_token_counts(self.model)
        return stats
