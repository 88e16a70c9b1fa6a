"""What a streamed token costs inside `pagedllm serve`, thread by thread: one request at a time
(greedy, fixed lengths), the gaps between its streamed chunks (wall), and the CPU time each of the
server's threads used over the streams (`/proc/<pid>/task/*/stat`), per generated token. Beside
the offline step (`benches/decode_jitter.py --batch 1`) this says how much of the server's time
per output token is the engine's step and how much the server around it.

    python benches/serve_thread_cpu.py --model /tmp/llama56m --requests 4 --output-len 128
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import urllib.request
from pathlib import Path

from pagedllm.cli.serve_compare import free_port, server_process


def thread_cpu(pid: int) -> dict[str, float]:
    """Seconds of CPU (user + system) per thread name of the process."""
    ticks = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except OSError:
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        cpu = (int(fields[11]) + int(fields[12])) / ticks  # utime, stime
        out[f"{name}/{task.name}"] = cpu
    return out


def stream(port: int, model: str, prompt: list[int], max_tokens: int) -> list[float]:
    body = json.dumps(
        {
            "model": model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
        }
    ).encode()
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        data=body,
        headers={"Content-Type": "application/json"},
    )
    times = []
    with urllib.request.urlopen(req, timeout=600) as resp:
        for line in resp:
            if line.startswith(b"data: ") and not line.startswith(b"data: [DONE]"):
                times.append(time.perf_counter())
    return times


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="/tmp/llama56m")
    p.add_argument("--requests", type=int, default=4)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--serve-arg", action="append", default=[])
    args = p.parse_args()
    port = free_port()
    cmd = [sys.executable, "-m", "pagedllm.cli", "serve", "--model", args.model]
    cmd += ["--port", str(port), *args.serve_arg]
    with server_process("pagedllm", cmd, port) as server:
        prompt = [(13 * j + 7) % 30000 + 100 for j in range(args.input_len)]
        stream(port, args.model, prompt, 8)  # warm-up
        before = thread_cpu(server.pid)
        gaps: list[float] = []
        tokens = 0
        for i in range(args.requests):
            times = stream(port, args.model, [t + i for t in prompt], args.output_len)
            gaps += [b - a for a, b in zip(times, times[1:])]
            tokens += len(times)
        after = thread_cpu(server.pid)
        per_token = {
            name: round((after[name] - before.get(name, 0.0)) / tokens * 1e3, 2)
            for name in after
            if after[name] - before.get(name, 0.0) > 0.01  # threads that did work
        }
        report = {
            "tokens": tokens,
            "itl_ms": {
                "p50": round(statistics.median(gaps) * 1e3, 2),
                "mean": round(statistics.fmean(gaps) * 1e3, 2),
            },
            "cpu_ms_per_token_by_thread": dict(sorted(per_token.items(), key=lambda kv: -kv[1])),
            "cpu_ms_per_token_total": round(sum(per_token.values()), 2),
        }
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
