"""End-to-end decode at long context over a quantized KV cache, pagedllm against vLLM's CPU backend
(`kv_cache_dtype` auto / fp8 on both; int8 on pagedllm), side by side in one run, rounds
alternated engine by engine. One prompt of `--context` tokens (real text, repeated), greedy;
a warm-up generate leaves the prompt's blocks in the prefix cache, so each round's generates of
1 token and of 1 + `--decode` tokens compute only the prompt's last partial block before they
decode, and the decode time is their difference: ms per decoded token.

    python benches/kv_quant_vs_vllm.py --model /work/models/kvq-smollm2-f32 \
        --vllm-python /work/vllm-venv/bin/python [--context 6000] [--decode 128] [--rounds 3]
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

from pagedllm import LLM, SamplingParams

MARKER = "KVQ-JSON "
# vLLM's side, run by its interpreter (no pagedllm there): loads the engine, then per line of
# stdin {"max_tokens": n} times one greedy generate of the prompt and answers on stdout
_DRIVER = r"""
import json, sys, time
w = json.loads(sys.stdin.readline())
from vllm import LLM, SamplingParams
llm = LLM(model=w["model"], dtype="float32", max_model_len=w["max_model_len"], seed=0,
          kv_cache_dtype=w["kv_cache_dtype"], enforce_eager=True, enable_prefix_caching=True)
prompt = [{"prompt_token_ids": w["prompt"]}]
def run(n):
    p = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    start = time.perf_counter()
    out = llm.generate(prompt, p, use_tqdm=False)
    return time.perf_counter() - start, list(out[0].outputs[0].token_ids)
run(2)
print("KVQ-JSON " + json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    s, ids = run(json.loads(line)["max_tokens"])
    print("KVQ-JSON " + json.dumps({"elapsed_s": s, "ids": ids}), flush=True)
"""


class _Vllm:
    def __init__(self, python: str, **workload) -> None:
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1")
        self.proc = subprocess.Popen(
            [python, "-c", _DRIVER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=env,
        )
        self._ask(workload)

    def _ask(self, message: dict) -> dict:
        self.proc.stdin.write(json.dumps(message) + "\n")
        self.proc.stdin.flush()
        for line in self.proc.stdout:
            if line.startswith(MARKER):
                return json.loads(line[len(MARKER) :])
        raise RuntimeError(f"vLLM exited with status {self.proc.wait()}")

    def generate(self, max_tokens: int) -> tuple[float, list[int]]:
        answer = self._ask({"max_tokens": max_tokens})
        return answer["elapsed_s"], answer["ids"]

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=120)


class _Ours:
    def __init__(self, model: str, kv: str, max_model_len: int) -> None:
        self.llm = LLM(
            model,
            dtype="float32",
            kv_cache_dtype=kv,
            max_model_len=max_model_len,
            enable_prefix_caching=True,
        )
        self.prompt: list[dict] = []

    def load(self, prompt: list[int]) -> None:
        self.prompt = [{"prompt_token_ids": prompt}]
        self.generate(2)  # warm-up

    def generate(self, max_tokens: int) -> tuple[float, list[int]]:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        start = time.perf_counter()
        out = self.llm.generate(self.prompt, params, use_tqdm=False)
        return time.perf_counter() - start, list(out[0].outputs[0].token_ids)

    def close(self) -> None:
        self.llm.llm_engine.shutdown()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--vllm-python", required=True)
    p.add_argument("--context", type=int, default=6000)
    p.add_argument("--decode", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--text", type=Path, default=Path(__file__).parents[1] / "docs/ARCHITECTURE.md")
    args = p.parse_args()
    max_len = args.context + args.decode + 16
    ours = {
        name: _Ours(args.model, kv, max_len)
        for name, kv in [
            ("pagedllm auto", "auto"),
            ("pagedllm fp8_e4m3", "fp8_e4m3"),
            ("pagedllm int8", "int8"),
        ]
    }
    ids = ours["pagedllm auto"].llm.get_tokenizer().encode(args.text.read_text())
    prompt = (ids * (args.context // len(ids) + 1))[: args.context]
    engines: dict = {}
    for name, kv in [("vLLM auto", "auto"), ("vLLM fp8", "fp8")]:
        engines[name] = _Vllm(
            args.vllm_python,
            model=args.model,
            max_model_len=max_len,
            kv_cache_dtype=kv,
            prompt=prompt,
        )
    for name, engine in ours.items():
        engine.load(prompt)
        engines[name] = engine
    per_token: dict = {name: [] for name in engines}
    outputs: dict = {}
    for r in range(args.rounds):
        for name, engine in engines.items():
            prefill_s, _ = engine.generate(1)
            total_s, ids = engine.generate(1 + args.decode)
            per_token[name].append(1e3 * (total_s - prefill_s) / args.decode)
            outputs[name] = ids
            print(
                json.dumps(
                    {
                        "round": r,
                        "engine": name,
                        "decode_ms_per_token": round(per_token[name][-1], 3),
                        "prefill_s": round(prefill_s, 3),
                    }
                ),
                flush=True,
            )
    for name, times in per_token.items():
        med = statistics.median(times)
        same = outputs[name] == outputs["pagedllm auto"]
        print(
            json.dumps(
                {
                    "engine": name,
                    "median_decode_ms_per_token": round(med, 3),
                    "greedy_equals_pagedllm_auto": same,
                }
            )
        )
    for engine in engines.values():
        engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
