"""Shared by the speculative-decoding tests: greedy generation over a fixed prompt set, and the
check that a run verified drafts and left nothing behind."""

from __future__ import annotations

from pagedllm import LLM, SamplingParams


def generate(folder, speculative_config, prompts, max_new, *, n=1, params=None, **engine_kwargs):
    """(LLM, outputs) of `prompts` on the checkpoint `folder` (float32 CPU, block 4), greedy
    with `max_new` tokens each unless `params` says otherwise."""
    llm = LLM(
        str(folder),
        dtype="float32",
        device="cpu",
        block_size=4,
        speculative_config=speculative_config,
        **engine_kwargs,
    )
    params = params or SamplingParams(n=n, temperature=0.0, max_tokens=max_new, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return llm, outs


def token_ids(outs):
    return [[c.token_ids for c in o.outputs] for o in outs]


def assert_ran_clean(llm, *, accepted=False, rejected=False) -> dict:
    """Drafts were verified (`accepted`: some of them accepted; `rejected`: some rejected too);
    every block went back; invariants hold. Returns the engine's stats."""
    stats = llm.llm_engine.get_stats()
    drafts = stats["spec_decode_num_draft_tokens"]
    assert drafts > 0
    if accepted:
        assert stats["spec_decode_num_accepted_tokens"] > 0
    if rejected:
        assert stats["spec_decode_num_accepted_tokens"] < drafts
    llm.llm_engine.scheduler.check_invariants()
    assert llm.llm_engine.scheduler.get_stats()["num_running"] == 0
    assert stats["num_free_gpu_blocks"] == stats["num_gpu_blocks"]
    return stats
