"""Beam search in the engine's step, on copy-on-write blocks.

A beam request is an ordinary request with `beam_width` sequences (`n`), greedy, whose sampler
also returns each row's `2 * beam_width` most likely tokens (`logprobs`). After prefill the
scheduler forks the beams from the prompt's blocks as for `n > 1`; every later step runs all
beams of all requests in the one forward. Between the forward and the update
(`OutputProcessor.append`), `select` picks each request's next beams from its rows' candidates
and `Scheduler.fork_beams` makes every new beam continue the beam it came from: a copy-on-write
fork of that beam's blocks, the blocks of a beam nobody continues given back (nothing is
computed twice; a shared partial block is copied only when a beam appends to it). The sampled
token of each row is replaced by the chosen one before the usual output processing appends it.

The semantics are vLLM's `LLM.beam_search`: per step, every running beam's `2 * beam_width`
most likely tokens are candidates; a candidate that is an EOS id (unless `ignore_eos`) becomes a
finished hypothesis, the `beam_width` best of the others (by cumulative logprob) run on. After
`max_tokens` steps, the `beam_width` best of the finished hypotheses and the running beams by
`cum_logprob / len(prompt + output) ** length_penalty` (a final EOS not counted) are returned,
best first. The scheduler sees `ignore_eos` and `max_tokens` only: every beam of a request runs
to `max_tokens` in step, so each step has all of them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from pagedllm.engine.request import RequestState, SequenceState
from pagedllm.outputs import Logprob
from pagedllm.sampling import SamplerOutput
from pagedllm.sampling_params import BeamSearchParams, SamplingParams


@dataclass
class _Hypothesis:
    """A finished beam: its generated tokens (the EOS last) and their logprobs."""

    token_ids: list[int]
    logprobs: list[tuple[float, int]]  # (logprob, rank in its beam's distribution) per token
    cum_logprob: float


@dataclass
class BeamState:
    """One beam request's search: the parameters, the running beams' per-token logprobs (by
    sequence slot) and the finished hypotheses."""

    params: BeamSearchParams
    prompt_len: int
    eos_ids: frozenset[int]
    logprobs: list[list[tuple[float, int]]]  # per slot, (logprob, rank) per token
    finished: list[_Hypothesis] = field(default_factory=list)
    started: bool = False  # the first step has one beam (the prompt), sampled W times


class _DecodedText:
    """A finished beam's text, decoded once (beams carry no incremental detokenizer)."""

    def __init__(self, text: str) -> None:
        self.text = text

    def finish(self) -> None:
        """Nothing is held back: the text is final."""


def beam_score(cum_logprob: float, seq_len: int, length_penalty: float) -> float:
    """vLLM's `get_beam_search_score`: `seq_len` counts the prompt and the output (a final
    EOS not counted)."""
    return cum_logprob / (seq_len**length_penalty)


class BeamSearch:
    """The engine's beam requests (request id -> `BeamState`)."""

    def __init__(self) -> None:
        self.states: dict[str, BeamState] = {}

    def __bool__(self) -> bool:
        return bool(self.states)

    def add(
        self,
        engine,
        request_id: str,
        prompt,
        params: BeamSearchParams,
        lora_request=None,
        priority: int = 0,
        arrival_time: float | None = None,
    ) -> None:
        """Queues a beam search of `prompt` on `engine` (an `LLMEngine`, whose `add_request`
        calls this for `BeamSearchParams`); bad input is a ValueError naming the field,
        nothing queued."""
        if not isinstance(params, BeamSearchParams):
            raise TypeError(f"params must be a BeamSearchParams, got {type(params).__name__}")
        width = params.beam_width
        if width > engine.args.max_num_seqs:
            raise ValueError(
                f"request {request_id!r}: beam_width={width} is over max_num_seqs="
                f"{engine.args.max_num_seqs} (every beam is a running sequence)"
            )
        vocab = engine.model_config.vocab_size
        if 2 * width > vocab:
            raise ValueError(
                f"request {request_id!r}: beam_width={width} needs 2 * beam_width candidates "
                f"per beam, over the vocabulary ({vocab} tokens)"
            )
        if engine.spec is not None:
            raise ValueError("beam search does not run with speculative decoding")
        self._forget_released(engine.requests)
        sampling = SamplingParams(
            n=width,
            temperature=0.0,
            max_tokens=params.max_tokens,
            ignore_eos=True,  # EOS ends a hypothesis here, never a running beam
            include_stop_str_in_output=params.include_stop_str_in_output,
        )
        engine.add_request(
            request_id, prompt, sampling, arrival_time, priority, lora_request=lora_request
        )
        request = engine.requests[request_id]
        eos = frozenset() if params.ignore_eos else frozenset(engine.eos_token_ids)
        # the sampler's view: greedy rows with the candidates' logprobs
        request.sampling_params = dataclasses.replace(sampling, logprobs=2 * width + len(eos))
        for seq in request.seqs:
            seq.detokenizer = None
            seq.cumulative_logprob = 0.0
        self.states[request_id] = BeamState(
            params, len(request.prompt_token_ids), eos, [[] for _ in range(width)]
        )

    def select(self, step, sampled: SamplerOutput, requests, scheduler) -> dict[str, Exception]:
        """Chooses every beam request's next beams from this step's rows: rewrites their
        sampled tokens (and the tokens' logprobs) and forks each new beam from its parent, in
        the scheduler (its blocks) and in the request's sequences (tokens, cumulative
        logprob). Returns the requests that cannot go on -> why (the engine ends them)."""
        self._forget_released(requests)
        rows_of: dict[str, list[tuple[int, int]]] = {}
        for k, (request_id, index) in enumerate(
            zip(step.sample_request_ids, step.sample_seq_index.tolist())
        ):
            if request_id in self.states:
                rows_of.setdefault(request_id, []).append((index, k))
        faulty: dict[str, Exception] = {}
        if not rows_of:
            return faulty
        logprobs = sampled.logprobs
        rows_all, tokens_all, lps_all, ranks_all = [], [], [], []
        for request_id, rows in rows_of.items():
            state, request = self.states[request_id], requests[request_id]
            rows.sort()
            if len(rows) != state.params.beam_width:
                faulty[request_id] = RuntimeError(
                    f"{len(rows)} of its {state.params.beam_width} beams sampled in one step "
                    "(preempted by recompute, its beams came back apart: give the engine more "
                    "KV blocks or swap space)"
                )
                continue
            k_rows = [k for _, k in rows]
            columns = 2 * state.params.beam_width + len(state.eos_ids)
            chosen = self._choose(
                state,
                request,
                logprobs.top_token_ids[k_rows, :columns].cpu(),
                logprobs.top_logprobs[k_rows, :columns].cpu(),
            )
            parents = self._fork(state, request, chosen)
            scheduler.fork_beams(step, request_id, parents)
            for (_, k), (_, token, (lp, rank)) in zip(rows, chosen):
                rows_all.append(k)
                tokens_all.append(token)
                lps_all.append(lp)
                ranks_all.append(rank)
        if not rows_all:
            return faulty
        index = torch.tensor(rows_all, device=sampled.sampled_token_ids.device)
        sampled.sampled_token_ids[index] = torch.tensor(
            tokens_all, dtype=sampled.sampled_token_ids.dtype, device=index.device
        )
        logprobs.sampled_logprobs[index] = torch.tensor(
            lps_all, dtype=logprobs.sampled_logprobs.dtype, device=index.device
        )
        logprobs.sampled_ranks[index] = torch.tensor(
            ranks_all, dtype=logprobs.sampled_ranks.dtype, device=index.device
        )
        return faulty

    def _forget_released(self, requests) -> None:
        """Drops the searches the engine released without an update (aborted)."""
        for gone in [r for r in self.states if r not in requests]:
            del self.states[gone]

    def _choose(self, state: BeamState, request: RequestState, top_ids, top_lps):
        """The next beams as (parent slot, token, logprob) by slot: the best `beam_width`
        non-EOS candidates of the running beams' top `2 * beam_width`; EOS candidates among
        those become finished hypotheses."""
        width = state.params.beam_width
        beams = range(width) if state.started else range(1)
        state.started = True
        cum = torch.tensor([request.seqs[b].cumulative_logprob for b in beams], dtype=torch.float64)
        top_ids, top_lps = top_ids[: len(cum)], top_lps[: len(cum)]
        scores = cum[:, None] + top_lps.double()
        candidates = []
        for b in beams:
            for j, (token, lp) in enumerate(zip(top_ids[b].tolist(), top_lps[b].tolist())):
                if token in state.eos_ids:
                    if j < 2 * width:  # vLLM's candidates: the top 2 * beam_width only
                        seq = request.seqs[b]
                        state.finished.append(
                            _Hypothesis(
                                seq.token_ids + [token],
                                state.logprobs[b] + [(lp, j + 1)],
                                float(scores[b, j]),
                            )
                        )
                    continue
                candidates.append((float(scores[b, j]), b, token, (lp, j + 1)))
        # stable: equal scores keep the order vLLM lists them in (beam, then rank)
        candidates.sort(key=lambda c: -c[0])
        return [(b, token, lp) for _, b, token, lp in candidates[:width]]

    def _fork(self, state: BeamState, request: RequestState, chosen) -> list[int]:
        """Puts each new beam in a slot (a parent keeps its own slot for its first child, the
        others take the slots of beams nobody continues), copies parents into the other slots;
        returns the slots' parents for `Scheduler.fork_beams`. Reorders `chosen` by slot."""
        width = state.params.beam_width
        by_slot: list = [None] * width
        spare = []
        for beam in chosen:
            if by_slot[beam[0]] is None:
                by_slot[beam[0]] = beam
            else:
                spare.append(beam)
        free = [s for s in range(width) if by_slot[s] is None]
        for slot, beam in zip(free, spare):
            by_slot[slot] = beam
        parents = [beam[0] for beam in by_slot]
        for slot, parent in enumerate(parents):
            if slot != parent:
                child, source = request.seqs[slot], request.seqs[parent]
                child.token_ids = list(source.token_ids)
                child.cumulative_logprob = source.cumulative_logprob
                state.logprobs[slot] = list(state.logprobs[parent])
        for slot, (_, _, lp) in enumerate(by_slot):
            state.logprobs[slot].append(lp)
        chosen[:] = by_slot
        return parents

    def settle(self, touched: dict[str, RequestState], tokenizer) -> None:
        """After a step's update: every beam request of `touched` that finished gets its final
        sequences (the `beam_width` best of its finished hypotheses and its beams, best first)
        and is forgotten; one aborted or ended by a fault keeps what it had (`select` forgets
        it once the engine released it)."""
        for request_id, request in touched.items():
            if request_id not in self.states or not request.finished:
                continue
            state = self.states.pop(request_id)
            if any(seq.finish_reason == "abort" for seq in request.seqs):
                continue
            request.seqs = _final_sequences(state, request, tokenizer)


def _final_sequences(state: BeamState, request: RequestState, tokenizer) -> list[SequenceState]:
    hypotheses = list(state.finished)
    for slot, seq in enumerate(request.seqs):
        hypotheses.append(
            _Hypothesis(list(seq.token_ids), state.logprobs[slot], seq.cumulative_logprob)
        )
    eos = state.eos_ids

    def score(h: _Hypothesis) -> float:
        length = state.prompt_len + len(h.token_ids) - (1 if h.token_ids[-1] in eos else 0)
        return beam_score(h.cum_logprob, length, state.params.length_penalty)

    hypotheses.sort(key=score, reverse=True)
    seqs = []
    for i, h in enumerate(hypotheses[: state.params.beam_width]):
        ended = h.token_ids[-1] in eos
        shown = h.token_ids if not ended or state.params.include_stop_str_in_output else None
        text = ""
        if tokenizer is not None:
            text = tokenizer.decode(shown if shown is not None else h.token_ids[:-1])
        logprobs = [
            {token: Logprob(lp, rank)} for token, (lp, rank) in zip(h.token_ids, h.logprobs)
        ]
        seq = SequenceState(i, _DecodedText(text), h.token_ids, logprobs, h.cum_logprob)
        seq.finish("stop" if ended else "length")
        seqs.append(seq)
    return seqs


@dataclass
class BeamSearchSequence:
    """One returned beam (vLLM's): `tokens` holds the prompt, then the output; `text` decodes
    all of them; `logprobs` one dict per output token (the chosen token's logprob and rank)."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]]
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class BeamSearchOutput:
    """A prompt's best `beam_width` beams, best first (vLLM's)."""

    sequences: list[BeamSearchSequence]


def run_beam_search(
    engine, request_ids, prompts, params: BeamSearchParams, loras, on_done=None
) -> list[BeamSearchOutput]:
    """Beam-searches every prompt on `engine` (idle or not: beams share its steps) and returns
    one `BeamSearchOutput` per prompt, in order. Bad input queues nothing; a failed step or an
    interrupt aborts the batch."""
    added: list[str] = []
    try:
        for request_id, prompt, lora in zip(request_ids, prompts, loras):
            engine.add_request(request_id, prompt, params, lora_request=lora)
            added.append(request_id)
        finished = {}
        while len(finished) < len(added):
            for output in engine.step():
                if output.finished and output.request_id in request_ids:
                    finished[output.request_id] = output
                    if on_done is not None:
                        on_done(1)
    except BaseException:
        engine.abort_request(added)
        while engine.has_unfinished_requests():
            engine.step()
        raise
    return beam_outputs(engine.tokenizer, [finished[r] for r in request_ids])


def beam_outputs(tokenizer, outputs) -> list[BeamSearchOutput]:
    """The `BeamSearchOutput` of each finished beam request's `RequestOutput` (from this
    process's engine or a data-parallel replica's: `LLM.beam_search`)."""
    return [_beam_output(tokenizer, output) for output in outputs]


def _beam_output(tokenizer, output) -> BeamSearchOutput:
    sequences = []
    for completion in output.outputs:
        tokens = list(output.prompt_token_ids) + list(completion.token_ids)
        text = tokenizer.decode(tokens, skip_special_tokens=False) if tokenizer else None
        sequences.append(
            BeamSearchSequence(
                tokens,
                completion.logprobs or [],
                completion.cumulative_logprob or 0.0,
                text,
                completion.finish_reason,
                completion.stop_reason,
            )
        )
    return BeamSearchOutput(sequences)
