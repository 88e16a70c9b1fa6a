"""The CPU kernels' instruction-set level (`rust/src/cpu/isa.rs`, `_core.cpu_isa`): detected from
the machine, forced lower by `PAGEDLLM_CPU_ISA`, honoured by the kernels, refused at engine start
when it is not a level. Each case runs in a fresh interpreter: the level is decided once per
process (and this one may itself run forced)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from model_factory import save_tiny_checkpoint

LEVELS = ("portable", "avx2", "avx512", "amx")
# the flags each level needs besides those of the levels below it (isa.rs `level_of`)
NEEDS = {
    "avx2": {"avx2", "fma"},
    "avx512": {"avx512f", "avx512bw", "avx512vl"},
    "amx": {"amx-tile", "amx-int8", "amx-bf16"},
}


def _run(code: str, isa: str | None, *args: str) -> subprocess.CompletedProcess:
    """`code` in a fresh interpreter with PAGEDLLM_CPU_ISA set to `isa` (None: unset)."""
    env = {k: v for k, v in os.environ.items() if k != "PAGEDLLM_CPU_ISA"}
    if isa is not None:
        env["PAGEDLLM_CPU_ISA"] = isa
    return subprocess.run(
        [sys.executable, "-c", code, *args], env=env, capture_output=True, text=True, timeout=120
    )


def _cpu_isa(isa: str | None) -> tuple[str, list[str]]:
    done = _run("import json; from pagedllm import _core; print(json.dumps(_core.cpu_isa()))", isa)
    assert done.returncode == 0, done.stderr
    return tuple(json.loads(done.stdout))


def test_the_detected_level_is_the_highest_whose_flags_the_machine_has():
    level, flags = _cpu_isa(None)
    want = "portable"
    for name in LEVELS[1:]:
        if not NEEDS[name] <= set(flags):
            break
        want = name
    assert level == want, flags


def test_a_forced_level_is_reported_with_the_machines_flags():
    _, flags = _cpu_isa(None)
    assert _cpu_isa("portable") == ("portable", flags)


# numpy only (no torch import): `_core.cpu_linear` over panels built here, the output's bytes
_LINEAR = """
import sys, numpy as np
from pagedllm import _core
rng = np.random.default_rng(0)
w = rng.standard_normal((64, 256), dtype=np.float32)
x = rng.standard_normal((7, 256), dtype=np.float32)
panels = np.ascontiguousarray(w.reshape(4, 16, 256).transpose(0, 2, 1))
out = np.empty((7, 64), dtype=np.float32)
_core.cpu_linear(x, panels, None, out, 1)
sys.stdout.write(out.tobytes().hex())
"""


def _linear_at(isa: str | None) -> np.ndarray:
    done = _run(_LINEAR, isa)
    assert done.returncode == 0, done.stderr
    return np.frombuffer(bytes.fromhex(done.stdout), dtype=np.float32)


def test_the_kernels_run_at_the_forced_level():
    level, _ = _cpu_isa(None)
    portable, detected = _linear_at("portable"), _linear_at(None)
    # both the product within float32 rounding; bit for bit apart exactly where the machine's
    # level fuses multiply-add and portable does not
    np.testing.assert_allclose(portable, detected, rtol=1e-5, atol=1e-5)
    assert np.array_equal(portable, detected) == (level == "portable")


def test_engine_start_names_a_value_that_is_not_a_level(tmp_path):
    folder = save_tiny_checkpoint(tmp_path, "llama")
    start = f"from pagedllm import LLM; LLM({str(folder)!r}, device='cpu', num_gpu_blocks=8)"
    done = _run(start, "sse4")
    assert done.returncode != 0
    assert 'PAGEDLLM_CPU_ISA="sse4" is not a CPU ISA level' in done.stderr
    assert "this machine supports up to" in done.stderr


_GREEDY = """
import json, sys
from pagedllm import LLM, SamplingParams
llm = LLM(sys.argv[1], dtype="float32", device="cpu", block_size=4, max_num_batched_tokens=16)
params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0)
prompts = [[5, 17, 99], list(range(20, 41)), list(range(100, 140))]
outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
print(json.dumps({
    "stats": llm.llm_engine.get_stats()["cpu_isa"],
    "tokens": [o.outputs[0].token_ids for o in outs],
    "logprobs": [o.outputs[0].cumulative_logprob for o in outs],
}))
"""


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("llama"), "llama", seed=3)


def test_forced_portable_gives_the_greedy_tokens_of_the_detected_level(checkpoint):
    runs = {}
    for isa in ("portable", None):
        done = _run(_GREEDY, isa, str(checkpoint))
        assert done.returncode == 0, done.stderr
        runs[isa] = json.loads(done.stdout.splitlines()[-1])
    assert runs["portable"]["stats"] == "portable"
    assert runs[None]["stats"] == _cpu_isa(None)[0]
    assert runs["portable"]["tokens"] == runs[None]["tokens"]
    # fused and unfused multiply-add round differently: the logprobs agree to float32 noise
    assert runs["portable"]["logprobs"] == pytest.approx(runs[None]["logprobs"], rel=1e-5, abs=1e-5)


def test_float32_greedy_tokens_and_logprobs_are_bit_identical_at_every_simd_level(checkpoint):
    # the SIMD kernels keep AVX2's order of sums at every level above it (issue 40: greedy
    # outputs identical across ISA levels for float32), so the logprobs agree exactly too
    machine = _cpu_isa(None)[0]
    simd = list(LEVELS[1 : LEVELS.index(machine) + 1])
    runs = {}
    for isa in simd:
        done = _run(_GREEDY, isa, str(checkpoint))
        assert done.returncode == 0, done.stderr
        runs[isa] = json.loads(done.stdout.splitlines()[-1])
        assert runs[isa]["stats"] == isa
    for isa in simd[1:]:
        assert runs[isa]["tokens"] == runs["avx2"]["tokens"], isa
        assert runs[isa]["logprobs"] == runs["avx2"]["logprobs"], isa
    # what was compared: every SIMD level this machine runs, from avx2 up (none on a machine
    # without AVX2, one where AVX2 is the highest)
    assert list(runs) == simd
