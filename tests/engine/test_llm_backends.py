"""`LLM` over its back-ends (`llm.Backend`): one engine in this process or N replica processes,
chosen once when it is built; `generate`, `chat`, `get_tokenizer` and `close` run the same code
on either (a stand-in back-end shows it: nothing in `LLM` asks which one it has)."""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams, llm
from pagedllm.config import EngineArgs
from pagedllm.outputs import CompletionOutput, RequestOutput


class _Tokenizer:
    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]


class _RecordingBackend:
    """A back-end that answers every prompt with its own request id and records the calls."""

    engine = None

    def __init__(self, args: EngineArgs) -> None:
        self.args, self.calls, self.closed = args, [], False

    def get_tokenizer(self):
        return _Tokenizer()

    def generate(self, request_ids, prompts, params, priorities, loras, on_done=None):
        self.calls.append((list(request_ids), list(prompts), list(priorities)))
        if on_done is not None:
            on_done(len(prompts))
        return [
            RequestOutput(rid, str(prompt), [], [CompletionOutput(0, rid, [], None)], True)
            for rid, prompt in zip(request_ids, prompts)
        ]

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def backend(monkeypatch):
    built = []
    monkeypatch.setattr(
        llm, "_backend", lambda args: built.append(_RecordingBackend(args)) or built[-1]
    )
    return built


def test_generate_runs_on_the_backend_chosen_at_construction(backend):
    model = LLM("pagedllm/tiny-random", data_parallel_size=2)
    outputs = model.generate(
        ["a", "b"], SamplingParams(max_tokens=1), priority=[1, 0], use_tqdm=False
    )
    (built,) = backend
    assert built.calls == [(["0", "1"], ["a", "b"], [1, 0])]
    assert [o.outputs[0].text for o in outputs] == ["0", "1"]
    assert model.replicas is built  # the replica set, as `LLM(data_parallel_size=N)` gives it


def test_close_and_the_tokenizer_are_the_backends(backend):
    model = LLM("pagedllm/tiny-random")
    assert model.get_tokenizer().encode("hi") == [104, 105]
    model.close()
    assert backend[0].closed


def test_one_engine_is_the_default_backend():
    model = LLM("pagedllm/tiny-random", max_model_len=64, num_gpu_blocks=16, cpu_threads=1)
    assert isinstance(model.backend, llm.EngineBackend)
    assert model.llm_engine is model.engine is model.backend.engine
    assert model.replicas is None
    out = model.generate("hello", SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2
