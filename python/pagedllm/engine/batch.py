"""One batch of requests run to completion on an engine: what `LLM.generate` does in-process and
what each data-parallel replica process does with its share (`router/offline.py`), so that a
replica needs the engine, not the `LLM` that starts it."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from pagedllm.engine.inputs import PromptType
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.lora.request import LoRARequest
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams


def generate_batch(
    engine: LLMEngine,
    request_ids: Sequence[str],
    prompts: Sequence[PromptType],
    params: Sequence[SamplingParams],
    priorities: Sequence[int],
    loras: Sequence[LoRARequest | None],
    on_done: Callable[[int], object] | None = None,
) -> list[RequestOutput]:
    """Adds every request (one entry per prompt in each sequence), steps until all finish, and
    returns their final outputs in order; `on_done(1)` per finished request (a progress bar).
    Bad input adds nothing; a failed step or an interrupt aborts the batch, so the engine's
    next batch starts clean."""
    # bad constraints are refused before anything is queued (compiled in parallel, cached)
    engine.structured_output.check(
        (f"sampling_params[{i}].structured_outputs", p.structured_outputs)
        for i, p in enumerate(params)
        if isinstance(p, SamplingParams) and p.structured_outputs is not None
    )
    added: list[str] = []
    try:
        for request_id, prompt, p, prio, lora in zip(
            request_ids, prompts, params, priorities, loras
        ):
            engine.add_request(request_id, prompt, p, priority=prio, lora_request=lora)
            added.append(request_id)
    except Exception:
        _abandon(engine, added)  # bad input: leave no half-added batch behind
        raise
    try:
        return _run(engine, request_ids, on_done)
    except BaseException:
        # a failed step or an interrupt: the engine rolled the step back
        _abandon(engine, request_ids)
        raise


def _abandon(engine: LLMEngine, request_ids: Sequence[str]) -> None:
    """Aborts these requests and drains their final outputs (no forward runs for them)."""
    engine.abort_request(list(request_ids))
    while engine.has_unfinished_requests():
        engine.step()


def _run(engine: LLMEngine, request_ids: Sequence[str], on_done) -> list[RequestOutput]:
    finished: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
                if on_done is not None:
                    on_done(1)
    return [finished[request_id] for request_id in request_ids]
