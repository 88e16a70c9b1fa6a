"""`data_parallel_size` / `data_parallel_backend` (vLLM's names): checked with the other knobs;
one LLMEngine is one replica, so more than one is refused there with where replicas run."""

from __future__ import annotations

import pytest

from pagedllm import EngineArgs, LLMEngine


def test_a_data_parallel_size_below_one_is_refused():
    with pytest.raises(ValueError, match="data_parallel_size must be a positive integer"):
        EngineArgs(data_parallel_size=0)


def test_an_unknown_backend_is_refused_naming_the_known_ones():
    with pytest.raises(ValueError, match="data_parallel_backend"):
        EngineArgs(data_parallel_backend="slurm")


def test_one_engine_refuses_several_replicas_naming_serve_dp():
    with pytest.raises(ValueError, match="pagedllm serve -dp N"):
        LLMEngine.from_engine_args(EngineArgs(device="cpu", data_parallel_size=2))
