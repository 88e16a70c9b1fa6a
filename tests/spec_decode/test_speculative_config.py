"""`SpeculativeConfig.from_dict`: vLLM's keys, defaults, and a ValueError naming what is wrong."""

from __future__ import annotations

import pytest

from pagedllm import Scheduler, _core
from pagedllm.spec_decode import SpeculativeConfig


def test_ngram_lookup_bounds_default_and_mirror_each_other():
    c = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3})
    assert (c.prompt_lookup_max, c.prompt_lookup_min) == (4, 1)
    c = SpeculativeConfig.from_dict(
        {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5}
    )
    assert (c.prompt_lookup_max, c.prompt_lookup_min) == (5, 5)


def test_draft_model_takes_a_model_folder():
    c = SpeculativeConfig.from_dict({"model": "/ckpt", "num_speculative_tokens": 2})
    assert (c.method, c.model, c.num_speculative_tokens) == ("draft_model", "/ckpt", 2)
    assert SpeculativeConfig.from_dict(None) is None


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "ngram"}, "num_speculative_tokens"),
        ({"method": "medusa", "num_speculative_tokens": 2}, "method must be one of"),
        (
            {
                "method": "ngram",
                "num_speculative_tokens": 2,
                "prompt_lookup_min": 3,
                "prompt_lookup_max": 2,
            },
            "prompt_lookup_min",
        ),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "needs 'model'"),
        ({"method": "ngram", "num_speculative_tokens": 2, "temperature": 1}, "unknown key"),
        ("ngram", "must be a dict"),
    ],
)
def test_bad_configurations_are_value_errors(value, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.from_dict(value)


def test_draft_vocabulary_must_match_the_target():
    c = SpeculativeConfig.from_dict({"model": "/ckpt", "num_speculative_tokens": 2})
    c.check_draft_vocab(256, 256)
    with pytest.raises(ValueError, match="vocabulary"):
        c.check_draft_vocab(256, 512)


def test_ngram_lookup_defaults_are_the_proposers():
    c = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3})
    assert (c.prompt_lookup_max, c.prompt_lookup_min) == _core.ngram_lookup_bounds()
    # a scheduler given no bounds proposes with the same ones: a bad pair names the same rule
    with pytest.raises(ValueError, match=r"prompt_lookup_min \(3\) must be <= prompt_lookup_max"):
        Scheduler(
            num_gpu_blocks=8, num_speculative_tokens=2, prompt_lookup_min=3, prompt_lookup_max=2
        )
    with pytest.raises(ValueError, match=r"speculative_config: prompt_lookup_min \(3\) must"):
        SpeculativeConfig.from_dict(
            {
                "method": "ngram",
                "num_speculative_tokens": 2,
                "prompt_lookup_min": 3,
                "prompt_lookup_max": 2,
            }
        )
