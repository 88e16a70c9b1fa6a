"""Multi-turn chat with and without the KV offload tier (issue 26), side by side.

`conversations` chats of `turns` turns: each turn sends the whole history (the first user
message, then every reply and user message so far) plus a new user message, and generates a
reply (greedy, EOS ignored). A round submits one turn of every conversation at once; the
device cache (`--num-gpu-blocks`) holds about a quarter of the final histories, so by the
time a conversation comes back its prefix has been evicted from the device. With the tier
(`kv_offloading_size`) it is loaded from host memory instead of computed again.

Runs alternate (off, on, off, on, ...) and the script prints the medians of each: TTFT mean /
p50 / p99 (arrival to first token), output tokens per second, prompt tokens computed and
those served by each tier (at first admission), every token computed (recomputation after
preemption included) and the preemptions, and checks that both configurations produce the
same tokens.

    python benches/make_llama56m.py /tmp/llama56m
    python benches/multi_turn_offload.py --model /tmp/llama56m [--conversations 32 --turns 6 \
        --repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from pagedllm import LLM, SamplingParams
from pagedllm.config import TINY_RANDOM_MODEL


def run(args, offload: bool, disk: str | None = None) -> tuple[dict[str, float], list[list[int]]]:
    """One pass of the workload; `disk`: the disk tier in that directory instead of host memory."""
    tier = {}
    if offload:
        tier = {"kv_offloading_size": args.offload_gib}
    if disk is not None:
        tier.update(kv_offloading_backend="disk", kv_offloading_path=disk)
    llm = LLM(
        args.model,
        device="cpu",
        block_size=16,
        num_gpu_blocks=args.num_gpu_blocks,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        swap_space=0.01,
        **tier,
    )
    vocab = llm.llm_engine.model_config.vocab_size
    rng = np.random.default_rng(0)
    histories = [
        rng.integers(3, vocab, size=args.first).tolist() for _ in range(args.conversations)
    ]
    params = SamplingParams(temperature=0.0, max_tokens=args.reply, ignore_eos=True)
    ttfts, replies = [], []
    prompt_tokens = cached = offloaded = generated = 0
    start = time.perf_counter()
    for turn in range(args.turns):
        if turn:
            for h in histories:
                h.extend(rng.integers(3, vocab, size=args.user).tolist())
        outs = llm.generate([{"prompt_token_ids": h} for h in histories], params, use_tqdm=False)
        for h, out in zip(histories, outs):
            m = out.metrics
            ttfts.append(m.first_token_time - m.arrival_time)
            prompt_tokens += len(out.prompt_token_ids)
            cached += out.num_cached_tokens
            offloaded += m.num_offloaded_cached_tokens
            tokens = out.outputs[0].token_ids
            generated += len(tokens)
            replies.append(tokens)
            h.extend(tokens)
    wall = time.perf_counter() - start
    stats = llm.llm_engine.get_stats()
    llm.llm_engine.shutdown()
    ttfts.sort()
    figures = {
        "ttft_mean_ms": 1000 * statistics.fmean(ttfts),
        "ttft_p50_ms": 1000 * ttfts[len(ttfts) // 2],
        "ttft_p99_ms": 1000 * ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))],
        "output_tok_s": generated / wall,
        "wall_s": wall,
        "prefill_computed": prompt_tokens - cached,
        "cached_device": cached - offloaded,
        "cached_offload": offloaded,
        "hit_rate_pct": 100 * cached / prompt_tokens,
        # every token computed, recomputation after preemptions included
        "batched_tokens": stats["num_batched_tokens_total"],
        "preemptions": stats["num_preemptions"],
        # blocks copied in from the tier, a load repeated after an eviction included
        "tier_loaded_blocks": stats.get("kv_offload_loaded_blocks", 0),
    }
    return figures, replies


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--model",
        default=TINY_RANDOM_MODEL,
        help="a checkpoint folder (the issue's figures: the 56M Llama of "
        "benches/make_llama56m.py); default: the built-in tiny model",
    )
    p.add_argument("--conversations", type=int, default=32)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--first", type=int, default=64, help="tokens of the first user message")
    p.add_argument("--user", type=int, default=32, help="tokens of each later user message")
    p.add_argument("--reply", type=int, default=16, help="tokens of each reply")
    p.add_argument("--num-gpu-blocks", type=int, default=192)
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--offload-gib", type=float, default=0.25)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--restart-replay",
        metavar="DIR",
        help="instead: the workload on the disk tier in DIR (emptied first), then again in a "
        "new engine (a restart); prints both hit rates",
    )
    args = p.parse_args()
    if args.restart_replay:
        restart_replay(args, args.restart_replay)
        return
    results: dict[bool, list[dict[str, float]]] = {False: [], True: []}
    outputs = {}
    run(args, False)  # warm-up (first-call costs), not counted
    for _ in range(args.repeats):
        for offload in (False, True):
            figures, outputs[offload] = run(args, offload)
            results[offload].append(figures)
            print(
                ("tier on " if offload else "tier off"),
                {k: round(v, 2) for k, v in figures.items()},
            )
    assert outputs[False] == outputs[True], "the tier changed the outputs"
    print("\nmedians of", args.repeats, "alternated runs each")
    # off/on: > 1 means the tier helps, except for output_tok_s and the cached tokens; the
    # last column is the median of each pair's ratio (a pair ran in the same minutes)
    print(f"{'':22} {'off':>10} {'on':>10} {'off/on':>8} {'pairs':>8}")
    for key in results[False][0]:
        off = statistics.median(r[key] for r in results[False])
        on = statistics.median(r[key] for r in results[True])
        pairs = [a[key] / b[key] for a, b in zip(results[False], results[True]) if b[key]]
        ratio = off / on if on else float("nan")
        paired = statistics.median(pairs) if pairs else float("nan")
        print(f"{key:22} {off:10.1f} {on:10.1f} {ratio:8.2f} {paired:8.2f}")


def restart_replay(args, directory: str) -> None:
    import shutil

    shutil.rmtree(directory, ignore_errors=True)
    warm, warm_out = run(args, True, disk=directory)
    restarted, restarted_out = run(args, True, disk=directory)
    assert warm_out == restarted_out, "the restart changed the outputs"
    for name, figures in (("warm", warm), ("after restart", restarted)):
        print(name, {k: round(v, 2) for k, v in figures.items()})
    ratio = restarted["hit_rate_pct"] / warm["hit_rate_pct"]
    print(f"hit rate after restart / warm: {ratio:.2f}")


if __name__ == "__main__":
    main()
