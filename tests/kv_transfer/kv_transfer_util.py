"""Helpers of the KV transfer tests."""

from __future__ import annotations

import threading

import numpy as np

from pagedllm import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def make_disk_llm(path, **kw) -> LLM:
    """An engine with a small device cache over the disk tier in `path`."""
    kw.setdefault("kv_offloading_size", 0.01)
    kw.setdefault("num_gpu_blocks", 24)
    kw.setdefault("max_model_len", 80)
    return LLM(
        device="cpu",
        block_size=4,
        swap_space=0.01,
        kv_offloading_backend="disk",
        kv_offloading_path=str(path),
        **kw,
    )


def make_plain_llm(**kw) -> LLM:
    """The same engine without a tier (the reference outputs)."""
    return LLM(
        device="cpu", block_size=4, num_gpu_blocks=24, swap_space=0.01, max_model_len=80, **kw
    )


def prompt(seed: int = 0, n: int = 48) -> list[int]:
    return np.random.default_rng(seed).integers(2, 250, size=n).tolist()


def generate(llm: LLM, tokens: list[int]):
    """One greedy request, then steps until its saves are reported."""
    out = llm.generate({"prompt_token_ids": tokens}, GREEDY, use_tqdm=False)[0]
    engine = llm.llm_engine
    while engine.has_unfinished_requests():  # the saves' reports
        engine.step()
    return out


def block_files(path) -> list:
    return sorted(p for p in path.iterdir() if p.suffix == ".kvblock")


class GatedLoads:
    """Holds the copy thread's loads until `release()` (a slow tier)."""

    def __init__(self, llm: LLM) -> None:
        self.gate = threading.Event()
        connector = llm.llm_engine.kv_transfer
        load = connector._load

        def gated(*args):
            if len(args[0]):
                self.gate.wait(10)
            return load(*args)

        connector._load = gated

    def release(self) -> None:
        self.gate.set()
