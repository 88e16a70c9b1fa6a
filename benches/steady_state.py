"""The steady-decode setup the scheduler benchmarks share (issue 9 §8): 1024 single-sequence
requests with 512-token random prompts, prefilled until every one of them decodes."""

from __future__ import annotations

import numpy as np

RUNNING, PROMPT, MAX_MODEL_LEN, VOCAB = 1024, 512, 2048, 50_000


def prompts() -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [rng.integers(0, VOCAB, PROMPT).tolist() for _ in range(RUNNING)]


def prefilled(scheduler_class, block_size: int, caching: bool):
    """A `Scheduler` (the class of the build under test) with every request decoding."""
    s = scheduler_class(
        block_size=block_size,
        max_num_seqs=RUNNING,
        max_model_len=MAX_MODEL_LEN,
        max_num_batched_tokens=16384,
        enable_prefix_caching=caching,
        num_gpu_blocks=RUNNING * (MAX_MODEL_LEN // block_size + 1),
    )
    for i, p in enumerate(prompts()):
        s.add_request(f"r{i}", p, max_tokens=1024, ignore_eos=True)
    while True:
        out = s.schedule()
        s.update_from_output(out, np.full(out.num_samples, 7, dtype=np.int64))
        if out.is_decode_only and out.num_seqs == RUNNING:
            return s
