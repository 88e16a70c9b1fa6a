"""LoRA through the engine's steps: at most `max_loras` adapters per step (read from each step's
output), everyone finishes, and prefix-cache blocks are never shared across adapters."""

from __future__ import annotations

from lora_util import PARAMS, PROMPTS


def record_steps(llm) -> list[tuple[list[str], list[int]]]:
    """Wraps the model runner so each computed step's (request ids, lora_ids) is recorded."""
    runner, seen = llm.engine.runner, []
    prepare_step = runner.prepare_step

    def recording(step):
        seen.append((list(step.request_ids), step.lora_ids.tolist()))
        return prepare_step(step)

    runner.prepare_step = recording
    return seen


def test_max_loras_1_interleaves_two_adapters_and_everyone_finishes(llama_world):
    w = llama_world
    llm = w.llm(max_loras=1)
    steps = record_steps(llm)
    alpha, beta = w.requests["alpha"], w.requests["beta"]
    # the adapters alternate in arrival order, base-model requests between them
    loras = [alpha, beta, None, alpha, beta, None, alpha, beta]
    prompts = [{"prompt_token_ids": PROMPTS[i % 3]} for i in range(len(loras))]
    outs = llm.generate(prompts, PARAMS, lora_request=loras, use_tqdm=False)
    names = [None if r is None else r.lora_name for r in loras]
    w.check(outs, [(n, tuple(p["prompt_token_ids"])) for n, p in zip(names, prompts)])
    for _, lora_ids in steps:
        assert len(set(lora_ids) - {0}) <= 1, f"two adapters in one step: {lora_ids}"
    used = {i for _, ids in steps for i in ids}
    assert used == {0, alpha.lora_int_id, beta.lora_int_id}
    # base-model requests behind a waiting adapter were not held back: the first step ran the
    # base requests along with the first adapter's
    first_ids, first_loras = steps[0]
    assert 0 in first_loras and alpha.lora_int_id in first_loras


def test_rows_report_their_adapter(llama_world):
    w = llama_world
    llm = w.llm()
    steps = record_steps(llm)
    loras = [w.requests["beta"], None, w.requests["alpha"]]
    llm.generate(
        [{"prompt_token_ids": p} for p in PROMPTS], PARAMS, lora_request=loras, use_tqdm=False
    )
    want = {str(i): 0 if r is None else r.lora_int_id for i, r in enumerate(loras)}
    for request_ids, lora_ids in steps:
        assert lora_ids == [want[r] for r in request_ids]


def test_a_prompt_cached_under_one_adapter_is_no_hit_for_another_or_the_base(llama_world):
    w = llama_world
    llm = w.llm(enable_prefix_caching=True)
    prompt = {"prompt_token_ids": PROMPTS[1]}  # 19 tokens: 4 full blocks
    alpha, beta = w.requests["alpha"], w.requests["beta"]
    first = llm.generate(prompt, PARAMS, lora_request=alpha, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    for lora, hit in [(None, False), (beta, False), (alpha, True)]:
        out = llm.generate(prompt, PARAMS, lora_request=lora, use_tqdm=False)[0]
        assert (out.num_cached_tokens > 0) == hit, f"adapter {lora and lora.lora_name}"
        name = None if lora is None else lora.lora_name
        w.check([out], [(name, tuple(PROMPTS[1]))])


def test_steps_without_adapters_skip_the_lora_products(llama_world):
    llm = llama_world.llm()
    manager = llm.engine.lora
    seen = []
    prepare = manager.prepare_step

    def spy(lora_ids, num_tokens):
        prepare(lora_ids, num_tokens)
        seen.append(manager.state.segments)

    manager.prepare_step = spy
    llm.engine.runner.lora = manager
    llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False)
    assert seen and all(s is None for s in seen)
    assert manager.slots.resident() == []
