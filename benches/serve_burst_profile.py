"""Where `pagedllm serve`'s time goes under a load of `pagedllm bench serve` (default: the
burst, 64 requests at once, 256 characters in / 128 tokens out): every engine step timed inside
the server (wall and the engine thread's CPU, `LLMEngine.step` wrapped), the CPU each of the
server's threads used during the load (`/proc`), and the client's figures.

    python benches/serve_burst_profile.py --model /tmp/llama56m -- --dtype float32

Arguments after `--` go to `pagedllm serve`. The engine thread is the busiest one; the event
loop (HTTP, SSE, the hand-off of each step's outputs) the next.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile

from serve_thread_cpu import thread_cpu

from pagedllm.cli.serve_compare import free_port, server_process

# runs in the server process: `LLMEngine.step` timed, the records written at exit
_SERVER = """
import atexit, json, sys, time
from pagedllm.engine import llm_engine
records = []
step = llm_engine.LLMEngine.step
def timed(self):
    wall, cpu = time.perf_counter(), time.thread_time()
    outputs = step(self)
    records.append((time.perf_counter() - wall, time.thread_time() - cpu, len(outputs)))
    return outputs
llm_engine.LLMEngine.step = timed
atexit.register(lambda: json.dump(records, open(sys.argv[1], "w")))
from pagedllm.cli.app import main
sys.exit(main(sys.argv[2:]))
"""


def _pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(p / 100 * len(ordered)) - 1))]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="/tmp/llama56m")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--request-rate", type=float, default=math.inf)
    p.add_argument("serve_args", nargs="*", help="after --: extra `pagedllm serve` arguments")
    args = p.parse_args()

    from pagedllm.cli.bench_serve import run_bench_serve

    port = free_port()
    steps_file = os.path.join(tempfile.mkdtemp(), "steps.json")
    cmd = [sys.executable, "-c", _SERVER, steps_file, "serve", "--model", args.model]
    cmd += ["--port", str(port), "--max-model-len", "1024", *args.serve_args]
    with server_process("pagedllm", cmd, port) as server:
        load = [os.getloadavg()[0]]
        before = thread_cpu(server.pid)
        result = run_bench_serve(
            base_url=f"http://127.0.0.1:{port}",
            num_prompts=args.num_prompts,
            input_len=args.input_len,
            output_len=args.output_len,
            request_rate=args.request_rate,
            progress=False,
        )
        after = thread_cpu(server.pid)
        load.append(os.getloadavg()[0])
    with open(steps_file) as f:
        steps = json.load(f)
    os.unlink(steps_file)
    os.rmdir(os.path.dirname(steps_file))
    used = sorted((after[k] - before.get(k, 0.0) for k in after), reverse=True)
    decode = [s for s in steps if s[2] == max(s[2] for s in steps)]
    report = {
        "load_average": load,
        "output_tok_s": round(result["output_throughput"], 1),
        "ttft_ms": {k: round(result["ttft_ms"][k]) for k in ("p50", "p99")},
        "itl_ms": {k: round(result["itl_ms"][k], 1) for k in ("p50", "p99")},
        "thread_cpu_s": [round(x, 2) for x in used if x > 0.05],  # engine thread first
        "steps": len(steps),
        "step_wall_s": round(sum(s[0] for s in steps), 2),
        "step_cpu_s": round(sum(s[1] for s in steps), 2),
        "first_steps_cpu_s_outputs": [(round(s[1], 2), s[2]) for s in steps[:6]],
        "full_batch_step_cpu_ms_p50": round(statistics.median(s[1] for s in decode) * 1e3, 1),
        "full_batch_step_wall_ms": {
            "p50": round(_pct([s[0] for s in decode], 50) * 1e3, 1),
            "p99": round(_pct([s[0] for s in decode], 99) * 1e3, 1),
        },
    }
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
