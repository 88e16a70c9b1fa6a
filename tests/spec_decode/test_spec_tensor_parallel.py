"""Speculative decoding under tensor parallelism (2 CPU ranks): n-gram drafts and a draft model
(run whole on rank 0) verified on the sharded target give one rank's greedy tokens."""

from __future__ import annotations

import pytest

import spec_util
from model_factory import save_tiny_checkpoint, save_truncated_checkpoint
from spec_util import assert_ran_clean, token_ids

MAX_NEW = 12
# repeats for the n-gram lookup to find
PROMPTS = [[5, 17, 99, 3] * 3, list(range(20, 41)), [7] * 9 + [11, 12, 13]]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("target"), "llama", seed=3)


def _generate(target, config, tp: int):
    llm, outs = spec_util.generate(
        target,
        config,
        PROMPTS,
        MAX_NEW,
        tensor_parallel_size=tp,
        cpu_threads=1,
        num_gpu_blocks=64,
    )
    try:
        assert_ran_clean(llm, accepted=True)
        return token_ids(outs)
    finally:
        llm.llm_engine.shutdown()


def test_ngram_speculation_under_two_ranks_gives_the_tokens_of_one(target):
    config = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    assert _generate(target, config, 2) == _generate(target, config, 1)


def test_a_draft_model_under_two_ranks_gives_the_tokens_of_one(target, tmp_path):
    # the target's first layer: it agrees with the target on some tokens only
    draft = save_truncated_checkpoint(target, tmp_path / "draft", 1)
    config = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3}
    assert _generate(target, config, 2) == _generate(target, config, 1)
