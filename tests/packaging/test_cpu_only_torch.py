"""A CPU-only torch (the `whl/cpu` build) ships without triton: the engine must run on the CPU
without ever importing it."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

# triton made unimportable the way a CPU-only torch install leaves it: a finder that refuses it
PROBE = textwrap.dedent("""
    import importlib.abc, sys

    class NoTriton(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "triton" or name.startswith("triton."):
                raise ModuleNotFoundError(f"No module named {name!r}")
            return None

    sys.meta_path.insert(0, NoTriton())
    from pagedllm import LLM, SamplingParams

    llm = LLM("pagedllm/tiny-random", device="cpu", max_model_len=64)
    out = llm.generate(["hello"], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4, out
    assert not any(m == "triton" or m.startswith("triton.") for m in sys.modules)
    print("ok")
""")


def test_the_cpu_path_generates_without_triton_installed():
    env = dict(os.environ, PAGEDLLM_DEBUG="1")
    run = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, timeout=300
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip().endswith("ok")
