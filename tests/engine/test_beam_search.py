"""`LLM.beam_search` (engine/beam_search.py): equal to transformers' beam search where their
semantics agree (`ignore_eos`), to a reference of vLLM's semantics with EOS and a length
penalty, on shared copy-on-write blocks; bad parameters name the field."""

from __future__ import annotations

import math

import pytest
import torch

from pagedllm import LLM
from pagedllm.sampling_params import BeamSearchParams

from model_factory import save_tiny_checkpoint

MAX_NEW = 6
PROMPTS = [[5, 17, 99, 3, 42], list(range(20, 39))]


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def checkpoint(request, tmp_path_factory):
    folder = save_tiny_checkpoint(tmp_path_factory.mktemp(request.param), request.param, seed=5)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return folder, model


def build(folder, **kwargs) -> LLM:
    kwargs.setdefault("block_size", 4)
    return LLM(str(folder), dtype="float32", device="cpu", enforce_eager=True, **kwargs)


def hf_beam_search(model, prompt, width, max_new, length_penalty=1.0):
    """transformers' beams (no EOS: every beam runs `max_new` tokens), best first, with their
    cumulative logprobs."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new,
            num_beams=width,
            num_return_sequences=width,
            do_sample=False,
            early_stopping=False,
            length_penalty=length_penalty,
            eos_token_id=None,
            pad_token_id=0,
        )
    return [row[len(prompt) :].tolist() for row in out], [
        cum_logprob(model, row, len(prompt)) for row in out
    ]


def cum_logprob(model, row, prompt_len) -> float:
    """The output's log-probability under `model`, teacher-forced."""
    with torch.no_grad():
        logprobs = model(row[None]).logits[0].float().log_softmax(-1)
    return float(sum(logprobs[i - 1, row[i]] for i in range(prompt_len, len(row))))


@pytest.mark.parametrize("width", [1, 2, 4])
def test_beams_equal_transformers_without_eos(checkpoint, width):
    folder, model = checkpoint
    llm = build(folder)
    params = BeamSearchParams(beam_width=width, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS], params)
    for prompt, out in zip(PROMPTS, outs):
        tokens, cums = hf_beam_search(model, prompt, width, MAX_NEW)
        assert [s.tokens[len(prompt) :] for s in out.sequences] == tokens
        assert [s.tokens[: len(prompt)] for s in out.sequences] == [prompt] * width
        for seq, cum in zip(out.sequences, cums):
            assert seq.cum_logprob == pytest.approx(cum, abs=1e-4)
            assert seq.cum_logprob == pytest.approx(
                sum(lp.logprob for d in seq.logprobs for lp in d.values()), abs=1e-4
            )
    stats = llm.engine.scheduler.get_stats()
    assert stats["num_free_gpu_blocks"] == stats["num_gpu_blocks"]


def vllm_reference(model, prompt, width, max_new, eos_ids, length_penalty):
    """vLLM's `LLM.beam_search` loop, each beam recomputed in full by transformers: per step
    every beam's top 2 * width tokens; EOS ones finish, the best `width` others run on; the
    best of all by cum_logprob / len(prompt + output) ** length_penalty."""
    beams, done = [(list(prompt), 0.0)], []
    for _ in range(max_new):
        candidates = []
        for tokens, cum in beams:
            with torch.no_grad():
                logits = model(torch.tensor([tokens])).logits[0, -1]
            top = logits.float().log_softmax(-1).topk(2 * width)
            for lp, token in zip(top.values.tolist(), top.indices.tolist()):
                beam = (tokens + [token], cum + lp)
                (done if token in eos_ids else candidates).append(beam)
        beams = sorted(candidates, key=lambda b: -b[1])[:width]

    def score(beam):
        tokens, cum = beam
        length = len(tokens) - (1 if tokens[-1] in eos_ids else 0)
        return cum / length**length_penalty

    return [b[0] for b in sorted(done + beams, key=score, reverse=True)[:width]]


@pytest.mark.parametrize("length_penalty", [1.0, 0.0, 2.0])
def test_beams_with_eos_follow_vllms_semantics(tmp_path, length_penalty):
    from transformers import AutoModelForCausalLM

    prompt = [5, 17, 99, 3, 42]
    folder = save_tiny_checkpoint(tmp_path / "a", "llama", seed=5)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():  # the prompt's second best next token ends a sequence: EOS matters
        eos = int(model(torch.tensor([prompt])).logits[0, -1].topk(2).indices[1])
    folder = save_tiny_checkpoint(tmp_path / "b", "llama", seed=5, eos_token_id=eos)
    llm = build(folder)
    eos_ids = set(llm.engine.eos_token_ids)
    assert eos in eos_ids
    params = BeamSearchParams(beam_width=3, max_tokens=MAX_NEW, length_penalty=length_penalty)
    (out,) = llm.beam_search({"prompt_token_ids": prompt}, params)
    expected = vllm_reference(model, prompt, 3, MAX_NEW, eos_ids, length_penalty)
    assert [s.tokens for s in out.sequences] == expected
    assert any(s.finish_reason == "stop" for s in out.sequences) or length_penalty == 2.0


def peak_blocks(llm, prompt, width) -> int:
    engine = llm.engine
    total = engine.scheduler.get_stats()["num_gpu_blocks"]
    params = BeamSearchParams(beam_width=width, max_tokens=8, ignore_eos=True)
    engine.add_request(f"w{width}", {"prompt_token_ids": prompt}, params)
    peak = 0
    while engine.has_unfinished_requests():
        engine.step()
        peak = max(peak, total - engine.scheduler.get_stats()["num_free_gpu_blocks"])
    return peak


def test_beams_share_the_prompts_blocks(checkpoint):
    folder, _ = checkpoint
    llm = build(folder, block_size=16, enable_prefix_caching=False)
    prompt = [(7 * i) % 290 + 2 for i in range(200)]
    one, four = peak_blocks(llm, prompt, 1), peak_blocks(llm, prompt, 4)
    print(f"peak KV blocks: width 1 {one}, width 4 {four}")
    assert four <= 1.5 * one, (one, four)
    assert four < 2 * math.ceil(200 / 16)  # re-submitting the prompt would need 4x


def test_bad_beam_parameters_name_the_field():
    with pytest.raises(ValueError, match="beam_width"):
        BeamSearchParams(beam_width=0, max_tokens=4)
    with pytest.raises(ValueError, match="max_tokens"):
        BeamSearchParams(beam_width=2, max_tokens=0)
    with pytest.raises(ValueError, match="temperature"):
        BeamSearchParams(beam_width=2, max_tokens=4, temperature=0.7)
    with pytest.raises(ValueError, match="length_penalty"):
        BeamSearchParams(beam_width=2, max_tokens=4, length_penalty=float("nan"))


def test_a_beam_width_over_max_num_seqs_is_refused(checkpoint):
    folder, _ = checkpoint
    llm = build(folder, max_num_seqs=2)
    with pytest.raises(ValueError, match="beam_width=4 is over max_num_seqs=2"):
        llm.beam_search("hello", BeamSearchParams(beam_width=4, max_tokens=4))
    assert not llm.engine.has_unfinished_requests()


def run_engine(engine, requests) -> tuple[dict, int]:
    """Adds `requests` (id -> (prompt, params)), steps until done: (id -> final output, steps)."""
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
    finals, steps = {}, 0
    while engine.has_unfinished_requests():
        steps += 1
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    return finals, steps


def test_beams_and_other_requests_share_each_step(checkpoint):
    from pagedllm import SamplingParams

    folder, _ = checkpoint
    beam = (PROMPTS[1], BeamSearchParams(beam_width=4, max_tokens=MAX_NEW, ignore_eos=True))
    greedy = (PROMPTS[0], SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True))
    alone = {
        rid: run_engine(build(folder).engine, {rid: r})[0][rid]
        for rid, r in [("b", beam), ("g", greedy)]
    }
    together, steps = run_engine(build(folder).engine, {"b": beam, "g": greedy})
    assert steps == MAX_NEW  # prefill + 5 decode steps: every beam and the other request each step
    for rid in ("b", "g"):
        assert [c.token_ids for c in together[rid].outputs] == [
            c.token_ids for c in alone[rid].outputs
        ]


def test_an_aborted_beam_search_gives_back_its_blocks(checkpoint):
    folder, _ = checkpoint
    engine = build(folder).engine
    params = BeamSearchParams(beam_width=4, max_tokens=MAX_NEW, ignore_eos=True)
    engine.add_request("b", {"prompt_token_ids": PROMPTS[1]}, params)
    engine.step()
    engine.step()
    engine.abort_request("b")
    (out,) = engine.step()
    assert out.finished and out.outputs[0].finish_reason == "abort"
    stats = engine.scheduler.get_stats()
    assert stats["num_free_gpu_blocks"] == stats["num_gpu_blocks"]
    engine.add_request("c", {"prompt_token_ids": PROMPTS[0]}, params)
    assert set(engine.beams.states) == {"c"}  # the aborted search is forgotten


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_beams_survive_preemption(checkpoint, mode):
    folder, _ = checkpoint
    prompts = [{"prompt_token_ids": list(range(s, s + 19))} for s in (20, 50, 80)]
    params = BeamSearchParams(beam_width=4, max_tokens=12, ignore_eos=True)
    roomy = build(folder).beam_search(prompts, params)
    tight = build(folder, num_gpu_blocks=24, max_model_len=64, preemption_mode=mode)
    outs = tight.beam_search(prompts, params)
    assert tight.engine.get_stats()[f"num_preemptions_{mode}"] > 0
    assert [[s.tokens for s in o.sequences] for o in outs] == [
        [s.tokens for s in o.sequences] for o in roomy
    ]
