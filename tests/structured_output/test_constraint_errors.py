"""Bad constraints: `LLM.generate` raises ValueError naming the problem before anything is
queued; through the engine, the request ends with the error while the others are served."""

from __future__ import annotations

import pytest

from pagedllm import SamplingParams, StructuredOutputsParams

BAD = {
    "schema": (StructuredOutputsParams(json={"type": "strin"}), "invalid JSON schema: .*strin"),
    "regex": (StructuredOutputsParams(regex="a(b"), "invalid regex: .*unclosed group"),
    "grammar": (StructuredOutputsParams(grammar="start: foo"), "invalid grammar: .*foo"),
    # llguidance would drop the lone backslash and answer "" for `\`
    "trailing backslash": (
        StructuredOutputsParams(regex="ab\\"),
        "invalid regex: .*unfinished escape",
    ),
    # the same in a schema, where the unanchored pattern `\` would allow any string
    "pattern with a trailing backslash": (
        StructuredOutputsParams(json={"properties": {"a": {"type": "string", "pattern": "\\"}}}),
        "invalid JSON schema: pattern '.*' ends in an unfinished escape",
    ),
    # compiles, but no output satisfies it: it used to answer "" with `stop`
    "self-reference": (
        StructuredOutputsParams(json={"$ref": "#"}),
        "invalid JSON schema: no output satisfies it",
    ),
    # compile, then go past llguidance's limits on their first token: used to end `abort`
    # with a 50 KB engine dump
    "2,000 optional properties": (
        # any JSON value: only an object (its first token `{`) goes past the limits
        StructuredOutputsParams(json={"properties": {f"p{i}": {} for i in range(2000)}}),
        "JSON schema too large or complex for the grammar engine .*max is 2000",
    ),
    "huge repetition": (
        StructuredOutputsParams(regex="a{1000000}"),
        "regex too large or complex for the grammar engine",
    ),
}


@pytest.mark.parametrize("what", list(BAD))
def test_generate_raises_naming_the_problem_and_queues_nothing(llm, what):
    so, message = BAD[what]
    params = [SamplingParams(max_tokens=4), SamplingParams(structured_outputs=so)]
    with pytest.raises(
        ValueError, match=rf"(?s)sampling_params\[1\]\.structured_outputs: {message}"
    ) as info:
        llm.generate(["fine", "bad"], params, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    assert len(str(info.value)) < 500  # llguidance's messages are cut short
    (out,) = llm.generate(["next"], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 3


def test_engine_ends_a_request_whose_grammar_fails_and_keeps_serving(llm):
    engine = llm.engine
    engine.add_request("free", "abc", SamplingParams(max_tokens=6, ignore_eos=True))
    so = StructuredOutputsParams(regex="x{2,1}")
    engine.add_request("bad", "abc", SamplingParams(structured_outputs=so))
    engine.add_request("good", "abc", SamplingParams(structured_outputs=BAD_FREE, max_tokens=8))
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.outputs[0]
        engine.scheduler.check_invariants()
    bad = finished["bad"]
    assert bad.finish_reason == "abort" and bad.token_ids == []
    assert bad.stop_reason.startswith("structured output: invalid regex")
    assert len(finished["free"].token_ids) == 6
    assert finished["good"].finish_reason == "stop" and finished["good"].text in ("yes", "no")
    stats = engine.get_stats()
    assert stats["num_free_gpu_blocks"] == stats["num_gpu_blocks"]
    assert not engine.structured_output.live and not engine.structured_output.has_pending


BAD_FREE = StructuredOutputsParams(choice=["yes", "no"])


def test_engine_ends_a_request_past_the_grammar_limits_with_a_short_reason(llm):
    # through add_request the compile's first-step check ends it before any token, and the
    # reason is a line, not llguidance's dump of its state and grammar
    engine = llm.engine
    so = StructuredOutputsParams(regex="a{1000000}")
    engine.add_request("huge", "abc", SamplingParams(structured_outputs=so))
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.finished]
    (out,) = [o.outputs[0] for o in outputs]
    assert out.finish_reason == "abort" and out.token_ids == []
    assert out.stop_reason.startswith("structured output: regex too large or complex")
    assert len(out.stop_reason) < 500


def test_a_choice_list_of_2000_items_is_served(llm):
    # the choices share their first tokens: as grammar alternatives they went past
    # llguidance's 2,000 items per row on the first token; as one lexeme they are fine
    choices = [f"item {i}" for i in range(2000)]
    so = StructuredOutputsParams(choice=choices)
    (out,) = llm.generate(["pick"], SamplingParams(max_tokens=16, structured_outputs=so))
    assert out.outputs[0].text in choices and out.outputs[0].finish_reason == "stop"


def test_structured_outputs_need_a_tokenizer():
    from pagedllm import LLMEngine
    from pagedllm.config import EngineArgs

    engine = LLMEngine(
        EngineArgs(device="cpu", skip_tokenizer_init=True, max_model_len=64, num_gpu_blocks=16)
    )
    so = StructuredOutputsParams(regex="a")
    with pytest.raises(ValueError, match="structured_outputs needs a tokenizer"):
        engine.add_request("r", {"prompt_token_ids": [1, 2]}, SamplingParams(structured_outputs=so))
    assert not engine.has_unfinished_requests()


def test_compiled_grammars_are_cached_and_bounded(monkeypatch, llm):
    from pagedllm.structured_output import manager as manager_module

    manager = llm.engine.structured_output
    monkeypatch.setattr(manager_module, "CACHE_SIZE", 2)
    first = manager.compile(StructuredOutputsParams(regex="cache-a"))
    assert manager.compile(StructuredOutputsParams(regex="cache-a")) is first
    for spec in ("cache-b", "cache-c"):
        manager.compile(StructuredOutputsParams(regex=spec)).result()
    assert manager.compile(StructuredOutputsParams(regex="cache-a")) is not first


def test_a_compile_error_quoting_a_long_grammar_is_cut_short(llm):
    # llguidance quotes the grammar's line (here 5 KB); the error names the problem in a line
    so = StructuredOutputsParams(grammar='start: "' + "x" * 5000 + '" | foo')
    with pytest.raises(ValueError, match='invalid grammar: .*unknown name: "foo"') as info:
        llm.generate(["bad"], SamplingParams(structured_outputs=so), use_tqdm=False)
    assert len(str(info.value)) < 500 and "\n" not in str(info.value)
