"""`POST /v1/completions`: one choice per (prompt, sample), streamed or not."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from pagedllm.entrypoints.errors import APIError, bad_request
from pagedllm.entrypoints.protocol import CompletionRequest
from pagedllm.entrypoints.serving import (
    Job,
    Server,
    continuous_usage,
    prompt_logprobs_json,
    usage,
)
from pagedllm.entrypoints.streaming import Deltas, sse_stream
from pagedllm.sampling_params import BeamSearchParams

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions


async def create_completion(server: Server, body: CompletionRequest, request: Request):
    server.check_model(body.model)
    max_tokens = body.max_tokens if body.max_tokens is not None else DEFAULT_MAX_TOKENS
    if body.use_beam_search:
        return await _create_beam_completion(server, body, request, max_tokens)
    if body.length_penalty != 1.0:
        message = "length_penalty needs use_beam_search=true (it scores beams)"
        raise APIError(400, message, param="length_penalty")
    params = server.sampling_params(body, max_tokens=max_tokens, logprobs=body.logprobs)
    if body.stream and params.num_samples > params.n:
        # the n best are known only when all best_of candidates finished: nothing to stream
        raise APIError(
            400,
            f"stream=true needs best_of equal to n (got best_of={params.best_of}, n={params.n}): "
            f"the best candidates are known only at the end",
            param="best_of",
        )
    prompts = await server.prompts.completion(
        _raw_prompts(body), params.truncate_prompt_tokens, body.prompt_token_ids
    )
    server.prompts.check_max_tokens(prompts, body.max_tokens, "max_tokens")
    echo = await server.prompts.decode(prompts, params.skip_special_tokens) if body.echo else None
    job = await server.submit(
        prompts, params, priority=body.priority, timeout=body.timeout, model=body.model
    )
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        chunks = _chunks(job, echo, include_usage, continuous_usage(body))
        return StreamingResponse(sse_stream(job, chunks), media_type="text/event-stream")
    finals = await job.finals(request)
    choices, num_tokens = [], 0
    for i, output in enumerate(finals):
        prefix = echo[i] if echo else ""
        for completion in output.outputs:
            num_tokens += len(completion.token_ids)
            logprobs = _logprobs(completion, 0, len(prefix))
            choice = _choice(job, i, completion, prefix + completion.text, logprobs)
            if params.prompt_logprobs is not None:
                choice["prompt_logprobs"] = prompt_logprobs_json(output)
            choices.append(choice)
    return _response(job, choices) | {"usage": usage(job, num_tokens)}


# fields that only sampling reads, each with its default test: with use_beam_search a set one is
# a 400 naming it (beams are ranked by the model's raw log-probabilities, nothing is sampled)
_SAMPLING_ONLY = {
    "stream": lambda v: v,
    "temperature": lambda v: v is not None and v != 0,
    "top_p": lambda v: v is not None and v != 1,
    "top_k": lambda v: v is not None and v not in (0, -1),
    "min_p": lambda v: v is not None and v != 0,
    "presence_penalty": lambda v: v != 0,
    "frequency_penalty": lambda v: v != 0,
    "repetition_penalty": lambda v: v is not None and v != 1,
    "logit_bias": lambda v: bool(v),
    "logprobs": lambda v: v is not None,
    "prompt_logprobs": lambda v: v is not None,
    "stop": lambda v: bool(v),
    "stop_token_ids": lambda v: bool(v),
    "min_tokens": lambda v: v != 0,
    "allowed_token_ids": lambda v: v is not None,
    "bad_words": lambda v: bool(v),
    "structured_outputs": lambda v: v is not None,
    "truncate_prompt_tokens": lambda v: v is not None,
    "seed": lambda v: v is not None,
}


def beam_search_params(body: CompletionRequest, max_tokens: int) -> BeamSearchParams:
    """vLLM's `use_beam_search`: `best_of` beams (else `n`), the `n` best returned."""
    for name, is_set in _SAMPLING_ONLY.items():
        if is_set(getattr(body, name)):
            raise APIError(
                400,
                f"{name} does not apply with use_beam_search=true (beams are ranked by the "
                "model's log-probabilities and returned at the end: nothing is sampled or "
                "streamed)",
                param=name,
            )
    width_field = "best_of" if body.best_of is not None else "n"
    width = body.best_of if body.best_of is not None else body.n
    if width < 1:
        message = f"{width_field} (the beam width) must be >= 1, got {width}"
        raise APIError(400, message, param=width_field)
    if not 1 <= body.n <= width:
        raise APIError(400, f"n must be in [1, best_of={width}], got {body.n}", param="n")
    try:
        return BeamSearchParams(
            beam_width=width,
            max_tokens=max_tokens,
            ignore_eos=body.ignore_eos,
            length_penalty=body.length_penalty,
            include_stop_str_in_output=body.include_stop_str_in_output,
        )
    except ValueError as exc:
        raise bad_request(exc) from None


async def _create_beam_completion(
    server: Server, body: CompletionRequest, request: Request, max_tokens: int
):
    params = beam_search_params(body, max_tokens)
    prompts = await server.prompts.completion(_raw_prompts(body), None, body.prompt_token_ids)
    server.prompts.check_max_tokens(prompts, body.max_tokens, "max_tokens")
    echo = await server.prompts.decode(prompts, body.skip_special_tokens) if body.echo else None
    job = await server.submit(
        prompts, params, priority=body.priority, timeout=body.timeout, model=body.model
    )
    finals = await job.finals(request)
    choices, num_tokens = [], 0
    for i, output in enumerate(finals):
        prefix = echo[i] if echo else ""
        for j, beam in enumerate(output.outputs[: body.n]):  # best first
            num_tokens += len(beam.token_ids)
            choices.append(
                {
                    "index": i * body.n + j,
                    "text": prefix + beam.text,
                    "logprobs": None,
                    "finish_reason": beam.finish_reason,
                    "stop_reason": beam.stop_reason,
                }
            )
    return _response(job, choices) | {"usage": usage(job, num_tokens)}


def _raw_prompts(body: CompletionRequest) -> list[str | list[int]]:
    """A string, a list of strings, a list of token ids or a list of such lists -> a list."""
    prompt = body.prompt
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise APIError(400, "prompt must not be empty", param="prompt")
    if isinstance(prompt[0], int):
        return [list(prompt)]
    return list(prompt)


async def _chunks(
    job: Job, echo: list[str] | None, include_usage: bool, continuous: bool
) -> AsyncIterator[dict]:
    """`continuous`: each chunk carries the usage so far (continuous_usage_stats)."""
    deltas = Deltas()
    async for i, output in job.outputs():
        for completion in output.outputs:
            key = (i, completion.index)
            first = deltas.first(key)
            unsent = deltas.take(completion, key)
            if unsent is None:
                continue
            delta, text_start, token_start = unsent
            prefix = echo[i] if echo and first else ""
            text_offset = text_start + (len(echo[i]) if echo else 0)
            logprobs = _logprobs(completion, token_start, text_offset)
            chunk = _response(job, [_choice(job, i, completion, prefix + delta, logprobs)])
            if continuous:
                chunk["usage"] = usage(job, deltas.num_tokens)
            yield chunk
    if include_usage:
        yield _response(job, []) | {"usage": usage(job, deltas.num_tokens)}


def _response(job: Job, choices: list[dict]) -> dict[str, Any]:
    return {
        "id": f"cmpl-{job.id}",
        "object": "text_completion",
        "created": job.created,
        "model": job.model,
        "choices": choices,
    }


def _choice(job: Job, prompt_index: int, completion, text: str, logprobs) -> dict[str, Any]:
    return {
        "index": prompt_index * job.params.n + completion.index,
        "text": text,
        "logprobs": logprobs,
        "finish_reason": completion.finish_reason,
        "stop_reason": completion.stop_reason,
    }


def _logprobs(completion, start: int, text_offset: int) -> dict[str, Any] | None:
    """OpenAI's legacy completion logprobs of tokens [start:] of a completion."""
    if completion.logprobs is None:
        return None
    tokens, token_logprobs, top, offsets = [], [], [], []
    offset = text_offset
    for token_id, entry in zip(completion.token_ids[start:], completion.logprobs[start:]):
        chosen = entry.get(token_id)
        text = chosen.decoded_token if chosen is not None and chosen.decoded_token else ""
        tokens.append(text)
        token_logprobs.append(chosen.logprob if chosen is not None else None)
        # keyed by token text, as OpenAI's are: tokens with the same text keep the likeliest
        ranked: dict[str, float] = {}
        for tid, lp in sorted(entry.items(), key=lambda kv: -kv[1].logprob):
            ranked.setdefault(lp.decoded_token or str(tid), lp.logprob)
        top.append(ranked)
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top,
        "text_offset": offsets,
    }
