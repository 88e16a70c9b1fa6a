"""The built-in random-weight model under a JSON schema, a regex and a choice list, over many
seeds and temperatures, in one batch with free requests: every constrained output parses and
validates, fully matches, or is one of the choices, and finishes with `stop`."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from so_constraints import CHOICES, MAX_TOKENS, REGEX, SCHEMA

from pagedllm import SamplingParams, StructuredOutputsParams

TEMPERATURES = [0.0, 1.0, 1.5]
SEEDS = range(3)


def constrained(so: StructuredOutputsParams, temperature: float, seed: int, **kw):
    kw.setdefault("max_tokens", MAX_TOKENS)
    return SamplingParams(temperature=temperature, seed=seed, structured_outputs=so, **kw)


def check_json(text: str) -> None:
    jsonschema.validate(json.loads(text), SCHEMA)
    assert "\n" not in text and "  " not in text, "whitespace is limited"


CHECKS = {
    "json": (StructuredOutputsParams(json=SCHEMA), check_json),
    "regex": (StructuredOutputsParams(regex=REGEX), lambda t: re.fullmatch(REGEX, t) or 1 / 0),
    "choice": (StructuredOutputsParams(choice=CHOICES), lambda t: CHOICES.index(t)),
}


@pytest.fixture(scope="module")
def mixed_batch(llm):
    """One generate call: every kind x temperature x seed, interleaved with free requests."""
    params, kinds = [], []
    for kind, (so, _) in CHECKS.items():
        for temperature in TEMPERATURES:
            for seed in SEEDS:
                params.append(constrained(so, temperature, seed))
                kinds.append(kind)
                params.append(SamplingParams(temperature=temperature, seed=seed, max_tokens=8))
                kinds.append("free")
    outs = llm.generate([f"prompt {i}:" for i in range(len(params))], params, use_tqdm=False)
    return list(zip(kinds, outs))


@pytest.mark.parametrize("kind", list(CHECKS))
def test_every_constrained_output_is_valid_and_stops(mixed_batch, kind):
    _, check = CHECKS[kind]
    texts = []
    for k, out in mixed_batch:
        if k == kind:
            (completion,) = out.outputs
            assert completion.finish_reason == "stop", completion
            check(completion.text)
            texts.append(completion.text)
    assert len(texts) == len(TEMPERATURES) * len(SEEDS)
    if kind != "choice":  # the random model may well favour one of four choices every time
        assert len(set(texts)) > 1, "sampled outputs differ across seeds"


def test_free_requests_in_the_batch_are_unconstrained(mixed_batch):
    free = [out.outputs[0] for k, out in mixed_batch if k == "free"]
    assert all(c.finish_reason in ("length", "stop") for c in free)
    # random weights, no mask: bytes no constraint above would allow show up
    assert any(not c.text.isascii() or "\x00" <= min(c.text or "a") < " " for c in free)


def test_greedy_constrained_outputs_are_deterministic(llm):
    so = StructuredOutputsParams(regex=REGEX)
    a, b = llm.generate(["same", "same"], constrained(so, 0.0, 0), use_tqdm=False)
    assert a.outputs[0].text == b.outputs[0].text
    assert re.fullmatch(REGEX, a.outputs[0].text)


@pytest.mark.parametrize("kind", ["json", "choice"])
def test_every_sequence_of_n_gt_1_follows_the_constraint(llm, kind):
    so, check = CHECKS[kind]
    (out,) = llm.generate(["n"], constrained(so, 1.2, 7, n=2, best_of=3), use_tqdm=False)
    assert len(out.outputs) == 2
    for completion in out.outputs:
        assert completion.finish_reason == "stop"
        check(completion.text)


def test_json_object_and_grammar_constraints(llm):
    grammar = 'start: "(" NUM ("+" NUM)* ")"\nNUM: /[0-9]{1,3}/'
    outs = llm.generate(
        ["a", "b"],
        [
            constrained(StructuredOutputsParams(json_object=True), 1.0, 3, max_tokens=256),
            constrained(StructuredOutputsParams(grammar=grammar), 1.0, 3),
        ],
        use_tqdm=False,
    )
    obj, expr = (o.outputs[0] for o in outs)
    if obj.finish_reason == "stop":
        assert isinstance(json.loads(obj.text), dict)
    else:  # an unbounded object may run out of tokens; what it wrote is still JSON so far
        assert obj.text.startswith("{")
    assert expr.finish_reason == "stop"
    assert re.fullmatch(r"\([0-9]{1,3}(\+[0-9]{1,3})*\)", expr.text)
