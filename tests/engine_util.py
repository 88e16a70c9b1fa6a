"""An engine driven to the end of a few greedy requests, shared by the tests that compare two
tensor-parallel ranks with one (models/, distributed/).

- `running_engine(args)`: an `LLMEngine` over `args` that is shut down on the way out, so a
  two-rank engine's worker never outlives its test.
- `greedy_tokens(engine, prompts, max_tokens)`: each prompt (token ids) as request `str(i)`,
  stepped until all finish; the new tokens in prompt order.
- `engine_greedy(args, prompts, max_tokens)`: both at once.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

from pagedllm import SamplingParams
from pagedllm.config import EngineArgs
from pagedllm.engine.llm_engine import LLMEngine


@contextlib.contextmanager
def running_engine(args: EngineArgs) -> Iterator[LLMEngine]:
    engine = LLMEngine(args)
    try:
        yield engine
    finally:
        engine.shutdown()


def greedy_tokens(
    engine: LLMEngine, prompts: Sequence[list[int]], max_tokens: int
) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i, ids in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": ids}, params)
    tokens = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = list(out.outputs[0].token_ids)
    return [tokens[str(i)] for i in range(len(prompts))]


def engine_greedy(
    args: EngineArgs, prompts: Sequence[list[int]], max_tokens: int
) -> list[list[int]]:
    with running_engine(args) as engine:
        return greedy_tokens(engine, prompts, max_tokens)
