"""`LLM.chat` with tools: the same plan as the server, the parsed calls on each completion."""

from __future__ import annotations

import json

import jsonschema
import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.structured_output import StructuredOutputsParams

ADD = {
    "type": "object",
    "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["a"],
    "additionalProperties": False,
}
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": ADD}}]
MESSAGES = [{"role": "user", "content": "2 + 2?"}]


@pytest.fixture(scope="module")
def llm():
    return LLM(max_model_len=1024, num_gpu_blocks=256, max_num_seqs=8)


def test_required_calls_are_parsed_onto_each_completion(llm):
    params = SamplingParams(temperature=1.0, seed=3, n=4, max_tokens=60)
    (output,) = llm.chat(
        MESSAGES,
        params,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        use_tqdm=False,
    )
    for completion in output.outputs:
        assert completion.finish_reason == "tool_calls" and completion.content is None
        (call,) = completion.tool_calls
        assert call.name == "add" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.arguments), ADD)


def test_auto_with_a_tool_parser_reads_calls_from_the_text(llm):
    forced = r'<tool_call>\n\{"name": "add", "arguments": \{"a": 4\}\}\n</tool_call>'
    params = SamplingParams(max_tokens=80, structured_outputs=StructuredOutputsParams(regex=forced))
    (output,) = llm.chat(MESSAGES, params, tools=TOOLS, tool_parser="hermes", use_tqdm=False)
    (completion,) = output.outputs
    assert [(c.name, c.arguments) for c in completion.tool_calls] == [("add", '{"a": 4}')]
    assert completion.finish_reason == "tool_calls"


def test_tools_are_rendered_into_the_prompt(llm):
    params = SamplingParams(max_tokens=1)
    (with_tools,) = llm.chat(MESSAGES, params, tools=TOOLS, use_tqdm=False)
    (without,) = llm.chat(MESSAGES, params, use_tqdm=False)
    assert json.dumps(TOOLS[0]) in with_tools.prompt and "add" not in without.prompt
    assert with_tools.outputs[0].tool_calls is None  # tool_choice "none": nothing parsed


def test_chat_template_kwargs_reach_the_template(llm):
    template = "{{ greeting }} {{ messages[0]['content'] }}"
    (output,) = llm.chat(
        MESSAGES,
        SamplingParams(max_tokens=1),
        chat_template=template,
        chat_template_kwargs={"greeting": "hello"},
        use_tqdm=False,
    )
    assert output.prompt == "hello 2 + 2?"


def test_auto_needs_a_tool_parser_only_when_asked_for(llm):
    with pytest.raises(ValueError, match="--enable-auto-tool-choice"):
        llm.chat(MESSAGES, tools=TOOLS, tool_choice="auto", use_tqdm=False)
