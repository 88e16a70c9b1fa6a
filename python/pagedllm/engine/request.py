"""Engine-side state of one request: its sequences (tokens, text, logprobs, finish), its metrics,
and what ends its sequences by token.

The scheduler (Rust) owns where a request is and which blocks it holds; this state is what the
engine adds on top: what the caller sees in a `RequestOutput`.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pagedllm.engine.detokenizer import IncrementalDetokenizer
from pagedllm.outputs import CompletionOutput, RequestMetrics, RequestOutput
from pagedllm.sampling_params import SamplingParams
from pagedllm.tokenizer import Tokenizer


@dataclass(frozen=True)
class StopTokens:
    """What ends a request's sequences by token, built once per request by `of`.

    `ids` is every token id that ends a sequence (`SamplingParams.all_stop_token_ids`: the
    request's stop ids, plus every EOS id of the checkpoint unless `ignore_eos`). The scheduler's
    stop rule gets it split in two: `eos_token_id` (the primary EOS, which stops with
    `stop_reason` None) and `stop_token_ids` (the rest, which stop with the id as `stop_reason`);
    which token ends a sequence is its answer alone (`Scheduler.stop_cuts`). The sampler's
    `min_tokens` mask uses `ids`.
    """

    eos_token_id: int | None
    stop_token_ids: list[int]
    ids: frozenset[int]

    @classmethod
    def of(cls, params: SamplingParams, eos_token_ids: Sequence[int]) -> StopTokens:
        ids = params.all_stop_token_ids(eos_token_ids)
        eos = eos_token_ids[0] if eos_token_ids else None
        stops_as_eos = None if params.ignore_eos else eos
        return cls(eos, [t for t in ids if t != stops_as_eos], frozenset(ids))


@dataclass
class SequenceState:
    """One generated sequence: tokens, text, logprobs, finish."""

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
        return CompletionOutput(
            self.index,
            self.text,
            list(self.token_ids),
            self.cumulative_logprob,
            self.logprobs,
            self.finish_reason,
            self.stop_reason,
        )


@dataclass
class RequestState:
    """One request: prompt, parameters, sequences, metrics, stop tokens (owned, while live, by
    the engine's `RequestRegistry`)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[SequenceState]
    metrics: RequestMetrics
    stop: StopTokens
    num_cached_tokens: int = 0
    lora_request: Any = None  # its LoRARequest (None: the base model)
    # structured output: one grammar matcher per sequence, once its grammar compiled
    matchers: list | None = None

    def __post_init__(self) -> None:
        # What the sampler sees: best_of > n needs the sampled tokens' logprobs for ranking.
        params = self.params
        if params.num_samples > params.n and params.logprobs is None:
            params = dataclasses.replace(params, logprobs=0)
        self.sampling_params = params

    @classmethod
    def new(
        cls,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        stop: StopTokens,
        arrival_time: float,
        tokenizer: Tokenizer | None,
    ) -> RequestState:
        """A request with its `num_samples` empty sequences (a detokenizer each when there is a
        tokenizer; logprob accumulators when it asks for logprobs or ranks by them)."""
        seqs = []
        for i in range(params.num_samples):
            detokenizer = None
            if tokenizer is not None:
                detokenizer = IncrementalDetokenizer.from_params(
                    tokenizer, prompt_token_ids, params
                )
            seqs.append(SequenceState(i, detokenizer))
        if params.logprobs is not None or params.num_samples > params.n:
            # best_of ranks samples by cumulative logprob, so it needs them too
            for seq in seqs:
                seq.cumulative_logprob = 0.0
                seq.logprobs = [] if params.logprobs is not None else None
        metrics = RequestMetrics(arrival_time=arrival_time)
        return cls(request_id, prompt, prompt_token_ids, params, seqs, metrics, stop)

    @property
    def finished(self) -> bool:
        return all(seq.finish_reason is not None for seq in self.seqs)

    def finish_all(self, reason: str, stop_reason: int | str | None = None) -> None:
        for seq in self.seqs:
            seq.finish(reason, stop_reason)
        self.metrics.finished_time = time.time()

    def output(self) -> RequestOutput:
        seqs = self.seqs
        if len(seqs) > self.params.n:
            # best_of: the n samples with the highest cumulative logprob
            seqs = sorted(seqs, key=lambda s: -s.cumulative_logprob)[: self.params.n]
        return RequestOutput(
            self.request_id,
            self.prompt,
            self.prompt_token_ids,
            [seq.output() for seq in seqs],
            self.finished,
            self.num_cached_tokens,
            self.metrics,
            lora_request=self.lora_request,
        )
