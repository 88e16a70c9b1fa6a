"""A grammar that compiles slowly holds only its own request: the others keep decoding while
it compiles (it waits in the scheduler, keeping its place), and it runs once compiled."""

from __future__ import annotations

import re
import threading

from pagedllm import SamplingParams, StructuredOutputsParams
from pagedllm.structured_output import manager

SLOW = r"slow-[0-9]{3}"


def test_other_requests_decode_while_a_grammar_compiles(llm, monkeypatch):
    release = threading.Event()
    real = manager.compile_params

    def slow_compile(tokenizer, params):
        if params.regex == SLOW:
            assert release.wait(timeout=60), "the test never released the compile"
        return real(tokenizer, params)

    monkeypatch.setattr(manager, "compile_params", slow_compile)
    engine = llm.engine
    so = StructuredOutputsParams(regex=SLOW)
    engine.add_request("slow", "go", SamplingParams(structured_outputs=so, max_tokens=20))
    engine.add_request("free", "go", SamplingParams(max_tokens=10, ignore_eos=True))
    tokens = 0
    for _ in range(10):
        for out in engine.step():
            if out.request_id == "free":
                tokens = len(out.outputs[0].token_ids)
            assert out.request_id != "slow", "the slow request produced output while compiling"
    assert tokens == 10, "the free request decoded to its end meanwhile"
    assert engine.scheduler.request_status("slow") == "WAITING"
    release.set()
    finished = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished = out.outputs[0]
    assert finished.finish_reason == "stop" and re.fullmatch(SLOW, finished.text)
