"""vLLM's side of `pagedllm bench --compare-vllm-python PATH`, run as a script by that interpreter.

It imports only the standard library and vLLM (the other interpreter has no pagedllm). Protocol:
one JSON object per line on stdin, one reply per line on stdout prefixed with `MARKER` (vLLM logs
to stdout too; other lines are ignored):
- first line, the workload: {"model", "dtype", "max_model_len", "seed", "prompts": [[ids]],
  "max_tokens": [int], "tensor_parallel_size": int (optional, 1)} -> {"ready": true, "version":
  vLLM's version} after loading and a warm-up;
- {"cmd": "run"} -> {"elapsed_s", "generated_tokens", "outputs": [[ids]]}: one timed greedy
  generate of every prompt (EOS ignored), outputs in prompt order;
- {"cmd": "exit"} or end of input -> exit 0.
"""

from __future__ import annotations

import json
import sys
import time

MARKER = "PAGEDLLM-JSON "


def reply(message: dict) -> None:
    sys.stdout.write(MARKER + json.dumps(message) + "\n")
    sys.stdout.flush()


def main() -> int:
    workload = json.loads(sys.stdin.readline())
    import vllm
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=workload["model"],
        dtype=workload["dtype"],
        max_model_len=workload["max_model_len"],
        seed=workload["seed"],
        skip_tokenizer_init=True,
        enforce_eager=True,
        tensor_parallel_size=workload.get("tensor_parallel_size", 1),
    )
    params = [
        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False)
        for n in workload["max_tokens"]
    ]
    prompts = [{"prompt_token_ids": ids} for ids in workload["prompts"]]
    llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up
    reply({"ready": True, "version": vllm.__version__})
    for line in sys.stdin:
        if json.loads(line).get("cmd") != "run":
            break
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        tokens = [list(o.outputs[0].token_ids) for o in outputs]
        reply(
            {
                "elapsed_s": elapsed,
                "generated_tokens": sum(len(t) for t in tokens),
                "outputs": tokens,
            }
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
