"""Output processing: a step's sampled tokens appended to their sequences (token ids, logprobs,
text through the incremental detokenizer, stop strings), then the scheduler's finish decisions
applied to them.

One step goes `append` -> `Scheduler.update_from_output` (Rust: the stop rules and the block
bookkeeping, told which samples hit a stop string) -> `finish`. Which token ends a sequence by
itself (EOS or a stop id once `min_tokens` are out, whose text is left out) is the scheduler's
answer too (`Scheduler.stop_cuts`, asked before any text is appended; a token is a run of one),
so the stop rule lives in Rust alone.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from pagedllm.engine.beam_search import BeamSearch
from pagedllm.engine.registry import RequestRegistry
from pagedllm.engine.request import RequestState, SequenceState
from pagedllm.sampling import SamplerOutput
from pagedllm.sampling.logprobs import LogprobsLists
from pagedllm.tokenizer import Tokenizer


@dataclass
class AppendedStep:
    """What `append` made of a step's samples, for `update_from_output` and `finish`."""

    tokens: np.ndarray  # int64 [K], the sampled tokens on the host
    stop_hits: np.ndarray  # bool [K], sample k completed a stop string
    stop_strings: dict[tuple[str, int], str] = field(default_factory=dict)  # (request, seq) ->
    faulty: dict[str, Exception] = field(default_factory=dict)  # request id -> its error
    # speculative decoding: int64 [K] tokens each sample kept of its run (None: one each)
    num_tokens: np.ndarray | None = None


class OutputProcessor:
    """Appends sampled tokens to the requests of `requests` (the engine's live requests), cut
    where `scheduler`'s stop rules end them; finishes go through the registry."""

    def __init__(self, tokenizer: Tokenizer | None, requests: RequestRegistry, scheduler) -> None:
        self.tokenizer = tokenizer
        self.requests = requests
        self.scheduler = scheduler
        # beam requests: each step's beams chosen and forked before their tokens are appended
        self.beams = BeamSearch()

    def append(
        self, step, sampled: SamplerOutput, touched: dict[str, RequestState]
    ) -> AppendedStep:
        """Adds every sample of `step` to its sequence. A request whose output processing raises
        (its detokenizer, say) is left out and reported in `faulty`; the others go on."""
        stuck = {}
        if self.beams:  # each beam's token chosen, the beams forked from their parents
            stuck = self.beams.select(step, sampled, self.requests, self.scheduler)
        tokens = sampled.sampled_token_ids.cpu().numpy()
        logprobs = sampled.logprobs.tolists() if sampled.logprobs is not None else None
        out = AppendedStep(tokens, np.zeros(len(tokens), dtype=bool), faulty=stuck)
        # which tokens end their sequence by themselves: only the text needs it
        ends = [False] * len(tokens)
        if self.tokenizer is not None:
            ends = self.scheduler.stop_cuts(step, tokens)[1].tolist()
        now = time.time()
        for k, (request_id, index, token) in enumerate(
            zip(step.sample_request_ids, step.sample_seq_index.tolist(), tokens.tolist())
        ):
            request = self.requests[request_id]
            touched[request_id] = request
            try:
                stop = self._append_token(
                    request, request.seqs[index], k, token, logprobs, now, ends[k]
                )
            except Exception as exc:  # this request's fault (e.g. its detokenizer): it alone ends
                out.faulty.setdefault(request_id, exc)
                continue
            if stop is not None:
                out.stop_hits[k] = True
                out.stop_strings[(request_id, index)] = stop
        return out

    def append_runs(self, step, verified, touched: dict[str, RequestState]) -> AppendedStep:
        """`append` for a verification step (`VerifiedTokens`): sample `k` brings a run of
        tokens, appended one by one up to where the scheduler's stop rules end it
        (`Scheduler.stop_cuts`), or up to a stop string; the tokens after the cut are dropped."""
        tokens = verified.token_ids.cpu().numpy()
        counts = verified.num_tokens
        cuts, ends = self.scheduler.stop_cuts(step, tokens, counts)
        logprobs = verified.logprobs.tolists() if verified.logprobs is not None else None
        keep = np.ones(len(tokens), dtype=bool)
        kept = counts.copy()
        out = AppendedStep(tokens, np.zeros(len(counts), dtype=bool), num_tokens=kept)
        now = time.time()
        start = 0
        for k, (request_id, index) in enumerate(
            zip(step.sample_request_ids, step.sample_seq_index.tolist())
        ):
            request = self.requests[request_id]
            touched[request_id] = request
            seq = request.seqs[index]
            count, cut = int(counts[k]), int(cuts[k])
            for j in range(cut):
                try:
                    stop = self._append_token(
                        request,
                        seq,
                        start + j,
                        int(tokens[start + j]),
                        logprobs,
                        now,
                        j + 1 == cut and bool(ends[k]),
                    )
                except Exception as exc:  # this request's fault: it alone ends
                    out.faulty.setdefault(request_id, exc)
                    break
                if stop is not None:
                    out.stop_hits[k] = True
                    out.stop_strings[(request_id, index)] = stop
                if stop is not None or j + 1 == cut < count:
                    kept[k] = j + 1
                    keep[start + j + 1 : start + count] = False
                    break
            start += count
        out.tokens = tokens[keep]
        return out

    def finish(self, finished, appended: AppendedStep, touched: dict[str, RequestState]) -> None:
        """Applies the sequences `update_from_output` finished; a stop string is the reason of
        the sequence that hit it."""
        for request_id, index, reason, stop_reason, _ in finished:
            stop_reason = appended.stop_strings.get((request_id, index), stop_reason)
            touched[request_id] = self.requests.finish_seq(request_id, index, reason, stop_reason)
        if self.beams:  # finished beam searches: their best beams
            self.beams.settle(touched, self.tokenizer)

    def _append_token(
        self,
        request: RequestState,
        seq: SequenceState,
        k: int,
        token: int,
        logprobs: LogprobsLists | None,
        now: float,
        ends_by_token: bool,
    ) -> str | None:
        """Adds sample `k` to its sequence (token, logprobs, text); returns a matched stop
        string. A token that ends its sequence by itself (`ends_by_token`, the scheduler's
        answer) adds no text (vLLM), unless the request keeps stop strings in the output."""
        seq.token_ids.append(token)
        if request.metrics.first_token_time is None:
            request.metrics.first_token_time = now
        request.metrics.last_token_time = now
        if seq.cumulative_logprob is not None and logprobs is not None:
            seq.cumulative_logprob += logprobs.sampled_logprobs[k]
            if request.params.logprobs is not None:
                seq.logprobs.append(
                    logprobs.entry(k, token, request.params.logprobs, self.decode_one)
                )
        if seq.detokenizer is None:
            return None
        if ends_by_token and not request.params.include_stop_str_in_output:
            return None
        return seq.detokenizer.append(token)[1]

    def decode_one(self, token_id: int) -> str | None:
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode([token_id], skip_special_tokens=False)
