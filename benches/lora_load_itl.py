"""Inter-token latency of a stream while LoRA adapters are loaded and unloaded at run time
(issue 44: "adapter load/unload while a stream runs: its ITL p99 not above 1.5x without the
load").

Starts `pagedllm serve MODEL --enable-lora --allow-runtime-lora-updating` in a process of its
own, then alternates pairs of one greedy stream of `--tokens` tokens (the base model): "quiet"
alone, "loading" while a thread loads and unloads a random rank-`--rank` PEFT adapter (every
projection) until the stream ends, back to back or `--interval` seconds apart. Per stream: the
gaps between its chunks (ITL) and their p50 / p99; per pair the ratio loading / quiet; the
medians of the ratios are the figures (a busy machine: only ratios of alternated pairs mean
anything).

    python benches/make_llama56m.py /tmp/llama56m
    python benches/lora_load_itl.py /tmp/llama56m --pairs 5 --tokens 256
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

LOAD, UNLOAD = "/v1/load_lora_adapter", "/v1/unload_lora_adapter"
PROMPT = "the quick brown fox jumps over the lazy dog " * 4


def save_adapter(model: str, folder: Path, rank: int) -> Path:
    """A random PEFT adapter on every projection of `model`, saved by peft."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    config = LoraConfig(
        r=rank, lora_alpha=2 * rank, target_modules=targets, init_lora_weights=False
    )
    get_peft_model(base, config).save_pretrained(folder)
    return folder


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str, port: int, rank: int) -> subprocess.Popen:
    command = [
        sys.executable, "-m", "pagedllm.cli", "serve", "--model", model, "--port", str(port),
        "--served-model-name", "base", "--enable-lora", "--allow-runtime-lora-updating",
        "--max-loras", "2", "--max-lora-rank", str(rank), "--max-model-len", "1024",
    ]  # fmt: skip
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(server.stderr.read().decode(errors="replace")[-3000:])
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    server.kill()
    raise RuntimeError("the server did not start")


def stream_gaps(url: str, tokens: int) -> list[float]:
    """The gaps (s) between one greedy stream's chunks, after its first."""
    body = {
        "model": "base", "prompt": PROMPT, "max_tokens": tokens, "temperature": 0,
        "ignore_eos": True, "stream": True,
    }  # fmt: skip
    arrivals = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["text"]:
                arrivals.append(time.perf_counter())
    return [b - a for a, b in zip(arrivals, arrivals[1:])]


def churn(url: str, adapter: Path, stop: threading.Event, counts: dict, interval: float) -> None:
    """Loads and unloads the adapter (each time under a name of its own) until `stop`, waiting
    `interval` seconds after each pair (0: back to back)."""
    with httpx.Client(timeout=120) as client:
        while not stop.wait(interval if counts["loads"] else 0.05):
            name = f"a{counts['loads']}"
            r = client.post(f"{url}{LOAD}", json={"lora_name": name, "lora_path": str(adapter)})
            r.raise_for_status()
            client.post(f"{url}{UNLOAD}", json={"lora_name": name}).raise_for_status()
            counts["loads"] += 1


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--interval", type=float, default=0.0, help="s between load/unload pairs")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        adapter = save_adapter(args.model, Path(tmp) / "adapter", args.rank)
        size = sum(f.stat().st_size for f in adapter.iterdir())
        port = free_port()
        server = start_server(args.model, port, args.rank)
        url = f"http://127.0.0.1:{port}"
        try:
            stream_gaps(url, 16)  # warm-up
            rows = []
            for pair in range(args.pairs):
                quiet = stream_gaps(url, args.tokens)
                stop, counts = threading.Event(), {"loads": 0}
                loader = threading.Thread(
                    target=churn, args=(url, adapter, stop, counts, args.interval)
                )
                loader.start()
                loading = stream_gaps(url, args.tokens)
                stop.set()
                loader.join()
                row = {
                    "pair": pair,
                    "loads": counts["loads"],
                    "quiet_p50_ms": 1e3 * percentile(quiet, 0.5),
                    "quiet_p99_ms": 1e3 * percentile(quiet, 0.99),
                    "loading_p50_ms": 1e3 * percentile(loading, 0.5),
                    "loading_p99_ms": 1e3 * percentile(loading, 0.99),
                }
                row["p99_ratio"] = row["loading_p99_ms"] / row["quiet_p99_ms"]
                row["p50_ratio"] = row["loading_p50_ms"] / row["quiet_p50_ms"]
                rows.append(row)
                print(json.dumps({k: round(v, 3) for k, v in row.items()}), flush=True)
        finally:
            server.terminate()
            server.wait(30)
    print(
        json.dumps(
            {
                "adapter_bytes": size,
                "rank": args.rank,
                "interval_s": args.interval,
                "tokens": args.tokens,
                "pairs": args.pairs,
                "median_p99_ratio": round(statistics.median(r["p99_ratio"] for r in rows), 3),
                "median_p50_ratio": round(statistics.median(r["p50_ratio"] for r in rows), 3),
                "loads_per_stream": statistics.median(r["loads"] for r in rows),
                "load_average": os.getloadavg()[0],
            }
        )
    )


if __name__ == "__main__":
    main()
