"""Routing policies side by side on 2 data-parallel replicas (issue 25's measurement).

For each policy, `pagedllm serve -dp 2 --routing-policy P` (1 torch thread per replica) serves
SGLang's generated-shared-prefix workload: GROUPS groups, each a long shared system prompt,
QUESTIONS short questions per group, in a shuffled order (or in rounds: --order), CONCURRENCY
at a time, streamed with
usage. The KV cache of a replica is sized by one rule (`rule_blocks`, unless --blocks says
otherwise): it holds 60 % of the groups' prefixes plus the blocks of its share of the requests
in flight, so one replica cannot hold them all, two can with room for an uneven split, and a
policy that sends every group to both replicas (round robin) thrashes where one that partitions
the groups (cache_aware) does not.
Reported per policy: prefix hit rate (cached / prompt tokens, from the responses' usage), TTFT
p50 / p99, output tokens per second, and where the time went: the prompt tokens the replicas
computed (prompt - cached) and the CPU seconds the replicas and the router process used during
the run (from /proc's schedstat; `busy` = replicas' CPU seconds / (2 x wall), `starved` = their
seconds runnable but waiting for a CPU / (2 x wall): on a shared machine the second is what
other processes took from them).

    PYTHONPATH=python python benches/router_policies.py [--model DIR] [--groups 8] ...

With `--vllm-python PY` the replicas are two vLLM servers run by that interpreter instead (one
core each, the same cache rule in vLLM's 32-token blocks), behind `pagedllm router
--external-replica`: the router over another engine's KV events.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import statistics
import sys
import time
from collections import OrderedDict
from dataclasses import dataclass

import httpx

from pagedllm.cli.serve_compare import free_port, server_process

POLICIES = ("cache_aware", "round_robin", "least_loaded")


def workload(args) -> list[str]:
    """`shuffled`: every question of every group in one random order. `rounds`: users taking
    turns: in each round every group sends its next question, the groups in a fresh random
    order (a replica's LRU cache then meets all the groups between two visits of one: what a
    policy that spreads a group over the replicas pays for)."""
    rng = random.Random(0)
    groups = []
    for g in range(args.groups):
        words = [f"w{rng.randrange(10_000)}" for _ in range(args.prefix_len // 6)]
        prefix = f"System {g}: " + " ".join(words)
        groups.append(
            [
                f"{prefix[: args.prefix_len]}\nQuestion {q}: what about item {q * 7}?"
                for q in range(args.questions)
            ]
        )
    if args.order_seed is not None:  # another order of the same prompts
        rng = random.Random(args.order_seed)
    if args.order == "shuffled":
        prompts = [p for group in groups for p in group]
        rng.shuffle(prompts)
        return prompts
    prompts = []
    for q in range(args.questions):
        turn = [group[q] for group in groups]
        rng.shuffle(turn)
        prompts.extend(turn)
    return prompts


# the share of the groups' prefixes one replica's cache holds (over 1/2: two hold them all with
# room for an uneven split; well under 1: one cannot)
PREFIX_SHARE = 0.6


def rule_blocks(args, prompts: list[str], block_size: int = 16) -> int:
    """KV blocks per replica by the rule above: ceil(share x groups) prefixes (share:
    `--prefix-share`, PREFIX_SHARE unless given), plus for each request in flight
    (`concurrency`, all on one replica at worst) the blocks beyond its prefix (its question and
    output)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(args.model, "tokenizer.json"))
    lens = [len(tok.encode(p).ids) for p in prompts]
    # the shared part: the tokens the prompts of group 0 have in common
    group0 = [tok.encode(p).ids for p in prompts if p.startswith("System 0:")]
    shared = next(
        (i for i, col in enumerate(zip(*group0)) if len(set(col)) > 1), min(map(len, group0))
    )
    prefix_blocks = shared // block_size
    request_blocks = -(-(max(lens) + args.max_tokens) // block_size)
    prefixes = math.ceil(round(args.prefix_share * args.groups, 6))  # 0.6 x 10: 6, not 7
    return prefixes * prefix_blocks + args.concurrency * (request_blocks - prefix_blocks)


def lru_hits(order: list[int], capacity: int, rng: random.Random) -> dict[str, int]:
    """Prefix hits of requests for groups `order` routed one at a time to 2 replicas, each an
    LRU cache of `capacity` whole prefixes: cache_aware keeps a group where its first request
    went (those alternating), round_robin alternates, least_loaded picks at random."""
    hits = {"cache_aware": 0, "round_robin": 0, "least_loaded": 0}
    for policy in hits:
        caches = [OrderedDict(), OrderedDict()]
        home, turn = {}, 0
        for g in order:
            if policy == "least_loaded":
                r = rng.randrange(2)
            elif policy == "round_robin" or g not in home:
                r, turn = turn, 1 - turn
                home.setdefault(g, r)
            r = home[g] if policy == "cache_aware" else r
            cache = caches[r]
            if g in cache:
                hits[policy] += 1
                cache.move_to_end(g)
            else:
                cache[g] = None
                if len(cache) > capacity:
                    cache.popitem(last=False)
    return hits


def lru_model(args, capacity: int, seeds: int = 500) -> dict[str, float]:
    """`lru_hits`'s hit rates over `seeds` random orders of `workload`'s shape."""
    hits = {"cache_aware": 0, "round_robin": 0, "least_loaded": 0}
    total = 0
    for seed in range(seeds):
        rng = random.Random(seed)
        order = []
        for _ in range(args.questions):
            turn = list(range(args.groups))
            rng.shuffle(turn)
            order += turn
        if args.order == "shuffled":
            rng.shuffle(order)
        total += len(order)
        for policy, h in lru_hits(order, capacity, rng).items():
            hits[policy] += h
    return {policy: h / total for policy, h in hits.items()}


def bench_order(args) -> list[int]:
    """The groups of `workload`'s prompts in the order it sends them (always the same)."""
    return [int(p.split(":", 1)[0].removeprefix("System ")) for p in workload(args)]


async def one(client, url, model, prompt, max_tokens) -> tuple[float, int, int, int]:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    ttft, usage = None, {}
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if ttft is None and chunk.get("choices"):
                    ttft = time.perf_counter() - t0
                usage = chunk.get("usage") or usage
    except httpx.HTTPError as exc:  # counted as failed, so one broken stream ends no run
        print(f"request failed: {exc!r}", file=sys.stderr, flush=True)
        return None
    if not usage:  # ended without its usage chunk (an error event)
        return None
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return ttft or 0.0, usage.get("prompt_tokens", 0), cached, usage.get("completion_tokens", 0)


async def drive(url, args, prompts) -> dict:
    sem = asyncio.Semaphore(args.concurrency)
    async with httpx.AsyncClient(timeout=600) as client:

        async def bounded(p):
            async with sem:
                return await one(client, url, args.served_model, p, args.max_tokens)

        t0 = time.perf_counter()
        answers = await asyncio.gather(*(bounded(p) for p in prompts))
        wall = time.perf_counter() - t0
    results = [a for a in answers if a is not None] or [(0.0, 0, 0, 0)]
    ttfts = sorted(r[0] for r in results)
    prompt_tokens = sum(r[1] for r in results)
    return {
        "hit_rate": sum(r[2] for r in results) / max(prompt_tokens, 1),
        "ttft_p50": statistics.median(ttfts),
        "ttft_p99": ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))],
        "out_tok_s": sum(r[3] for r in results) / wall,
        "wall_s": wall,
        "prompt_tokens": prompt_tokens / max(len(results), 1),
        "computed_tokens": prompt_tokens - sum(r[2] for r in results),
        "failed": answers.count(None),
    }


def sched_seconds(pid: int) -> tuple[float, float]:
    """(seconds on a CPU, seconds runnable but waiting for one) of process `pid`'s threads so
    far, from /proc's schedstat; (0, 0) once it is gone."""
    run = wait = 0
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0.0, 0.0
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                fields = f.read().split()
        except OSError:
            continue  # the thread ended
        run += int(fields[0])
        wait += int(fields[1])
    return run / 1e9, wait / 1e9


def descendants(pid: int) -> list[int]:
    """The processes under `pid` (serve -dp's replicas), from /proc's children lists."""
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/task/{p}/children") as f:
                kids = [int(k) for k in f.read().split()]
        except OSError:
            kids = []
        found += kids
        todo += kids
    return found


def cpu_split(pid: int, replica_pids: list[int]) -> tuple[float, float, float]:
    """(the router process's CPU seconds, its replicas' CPU seconds together, the replicas'
    seconds runnable but waiting for a CPU together)."""
    router = sched_seconds(pid)[0]
    replicas = [sched_seconds(p) for p in replica_pids]
    return router, sum(r[0] for r in replicas), sum(r[1] for r in replicas)


def run_policy(policy: str, args, prompts, log: str | None, fleet=None) -> dict:
    """One run of `policy`: `serve -dp 2`, or with `fleet` (`vllm_fleet`'s) `pagedllm router`
    in front of those vLLM servers, their prefix caches emptied first."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    if fleet is None:
        cmd = [sys.executable, "-m", "pagedllm.cli", "serve", "-dp", "2", "--port", str(port)]
        cmd += [
            "--model",
            args.model,
            "--cpu-threads",
            "1",
            "--served-model-name",
            args.served_model,
        ]
        cmd += ["--max-model-len", str(args.max_model_len), "--num-gpu-blocks", str(args.blocks)]
    else:
        for server in fleet:
            httpx.post(f"{server.url}/reset_prefix_cache", timeout=30).raise_for_status()
        cmd = [sys.executable, "-m", "pagedllm.cli", "router", "--port", str(port)]
        cmd += ["--block-size", str(VLLM_BLOCK)]
        for server in fleet:
            cmd += ["--external-replica", server.url, server.events, server.replay]
    cmd += ["--routing-policy", policy, "--log-level", "warning"]
    with server_process("pagedllm", cmd, port, log=log) as proc:
        time.sleep(1.5)  # the router's first polls and subscriptions (and replays)
        replicas = descendants(proc.pid) if fleet is None else fleet_pids(fleet)
        before = cpu_split(proc.pid, replicas)
        result = asyncio.run(drive(url, args, prompts))
        router, run, wait = (b - a for a, b in zip(before, cpu_split(proc.pid, replicas)))
        result["router_cpu_s"] = router
        result["busy"] = run / (2 * result["wall_s"])
        result["starved"] = wait / (2 * result["wall_s"])
        metrics = httpx.get(f"{url}/metrics", timeout=10).text
        result["routed"] = "/".join(
            line.split()[1].split(".")[0]
            for line in metrics.splitlines()
            if line.startswith("pagedllm_router:routed_requests_total")
        )
    return result


# vLLM's CPU backend takes blocks of a multiple of 32 tokens only
VLLM_BLOCK = 32


@dataclass
class VLLMServer:
    url: str
    events: str
    replay: str
    pid: int


@contextlib.contextmanager
def vllm_fleet(args):
    """Two vLLM servers from `--vllm-python`, each on a core of its own, `args.blocks` blocks of
    32 tokens (`--num-gpu-blocks-override`), KV events on TCP,
    `cached_tokens` in its usage, the dev-mode `/reset_prefix_cache`; yields them."""
    blocks = args.blocks
    with contextlib.ExitStack() as stack:
        fleet = []
        for core in range(2):
            port, pub, replay = free_port(), free_port(), free_port()
            events = {
                "enable_kv_cache_events": True,
                "publisher": "zmq",
                "endpoint": f"tcp://127.0.0.1:{pub}",
                "replay_endpoint": f"tcp://127.0.0.1:{replay}",
            }
            cmd = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server"]
            cmd += ["--model", args.model, "--served-model-name", args.served_model]
            cmd += ["--port", str(port), "--max-model-len", str(args.max_model_len)]
            cmd += ["--block-size", str(VLLM_BLOCK), "--num-gpu-blocks-override", str(blocks)]
            cmd += ["--enable-prefix-caching", "--enable-prompt-tokens-details"]
            cmd += ["--kv-events-config", json.dumps(events)]
            env = {
                **os.environ,
                "VLLM_CPU_KVCACHE_SPACE": "1",
                "VLLM_CPU_OMP_THREADS_BIND": str(core),
                "VLLM_SERVER_DEV_MODE": "1",
            }
            log = args.serve_log and os.path.join(args.serve_log, f"vllm-{core}.log")
            proc = stack.enter_context(server_process("vllm", cmd, port, env=env, log=log))
            url = f"http://127.0.0.1:{port}"
            fleet.append(VLLMServer(url, events["endpoint"], events["replay_endpoint"], proc.pid))
        warm_up(args, fleet)
        print(f"2 vLLM servers ({args.vllm_python}), {blocks} blocks of {VLLM_BLOCK} each")
        yield fleet


def warm_up(args, fleet: list[VLLMServer]) -> None:
    """A burst like the workload's (other text) on each server before any run: vLLM's CPU
    backend compiles its graphs on the first batches of each shape (tens of seconds when its
    compile cache is cold), which would otherwise fall on the first policy's run."""
    text = " ".join(f"warm-up {i}" for i in range(args.prefix_len // 10))
    prompts = [f"Warm-up {i}: {text}" for i in range(args.concurrency)]
    for server in fleet:
        asyncio.run(drive(server.url, args, prompts))


def fleet_pids(fleet: list[VLLMServer]) -> list[int]:
    return [pid for server in fleet for pid in (server.pid, *descendants(server.pid))]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="pagedllm/tiny-random")
    ap.add_argument("--served-model", default="m")
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--questions", type=int, default=8)
    ap.add_argument("--prefix-len", type=int, default=384, help="characters of shared prompt")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--blocks", type=int, help="KV blocks per replica (default: by `rule_blocks`)")
    ap.add_argument(
        "--prefix-share",
        type=float,
        default=PREFIX_SHARE,
        help="the share of the groups' prefixes one replica's cache holds in `rule_blocks`",
    )
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--policies", nargs="+", default=list(POLICIES))
    ap.add_argument("--order", choices=("shuffled", "rounds"), default="shuffled")
    ap.add_argument(
        "--order-seed",
        type=int,
        help="draw the request order from this seed (default: the one order every run sends)",
    )
    ap.add_argument("--serve-log", help="folder for each serve's output (default: discarded)")
    ap.add_argument(
        "--lru-model",
        type=int,
        metavar="C",
        help="print the hit rates of an LRU model with caches of C prefixes instead of running",
    )
    ap.add_argument(
        "--rounds", type=int, default=1, help="runs of every policy, interleaved (medians)"
    )
    ap.add_argument(
        "--vllm-python",
        help="route over 2 vLLM servers run by this interpreter (`pagedllm router "
        "--external-replica`) instead of `serve -dp 2`",
    )
    args = ap.parse_args()
    if args.serve_log:
        os.makedirs(args.serve_log, exist_ok=True)
    if args.lru_model is not None:
        rates = lru_model(args, args.lru_model)
        print(f"{args.groups} x {args.questions} ({args.order}), {args.lru_model} prefixes:")
        print(", ".join(f"{policy} {rate:.3f}" for policy, rate in rates.items()))
        # the bench sends one fixed order: what round robin meets there, routed in that order
        order = bench_order(args)
        own = lru_hits(order, args.lru_model, random.Random(0))
        last, same = {}, 0
        for i, g in enumerate(order):
            same += last.get(g) == i % 2
            last[g] = i % 2
        repeats = len(order) - len(set(order))
        print(
            f"this bench's own order: cache_aware {own['cache_aware'] / len(order):.3f}, "
            f"round_robin {own['round_robin'] / len(order):.3f}; round robin sends {same} of "
            f"{repeats} repeats where the group's previous request went"
        )
        return
    prompts = workload(args)
    block_size = VLLM_BLOCK if args.vllm_python else 16
    if args.blocks is None:
        args.blocks = rule_blocks(args, prompts, block_size)
    print(
        f"{len(prompts)} requests ({args.groups} groups x {args.questions}, {args.order}), "
        f"prefix {args.prefix_len} chars, {args.max_tokens} out, concurrency "
        f"{args.concurrency}, {args.blocks} blocks of {block_size} per replica, model {args.model}"
    )
    print(
        "| round | policy | prefix hit rate | TTFT p50 (s) | TTFT p99 (s) | output tok/s "
        "| wall (s) | prompt tokens computed | replicas busy / starved | router CPU (s) "
        "| routed per replica |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    runs: dict[str, list[dict]] = {p: [] for p in args.policies}
    with contextlib.ExitStack() as stack:
        fleet = stack.enter_context(vllm_fleet(args)) if args.vllm_python else None
        run_rounds(args, prompts, runs, fleet)
    report(args, runs)


def run_rounds(args, prompts, runs: dict[str, list[dict]], fleet) -> None:
    for i in range(args.rounds):
        # the policies in a rotated order each round, so the machine's swings hit all alike
        k = i % len(args.policies)
        for policy in args.policies[k:] + args.policies[:k]:
            log = args.serve_log and os.path.join(args.serve_log, f"{i + 1}-{policy}.log")
            r = run_policy(policy, args, prompts, log, fleet)
            failed = f" ({r['failed']} failed)" if r["failed"] else ""
            runs[policy].append(r)
            print(
                f"| {i + 1} | {policy} | {r['hit_rate']:.3f} | {r['ttft_p50']:.3f} "
                f"| {r['ttft_p99']:.3f} | {r['out_tok_s']:.1f} | {r['wall_s']:.1f} "
                f"| {r['computed_tokens']} | {r['busy']:.2f} / {r['starved']:.2f} "
                f"| {r['router_cpu_s']:.1f} "
                f"| {r['routed']}{failed} |",
                flush=True,
            )


def report(args, runs: dict[str, list[dict]]) -> None:
    if args.rounds > 1:
        print("\nmedians over the rounds:\n")
        print(
            "| policy | prefix hit rate | TTFT p50 (s) | TTFT p99 (s) | output tok/s "
            "| prompt tokens computed | replicas busy / starved |"
        )
        print("|---|---|---|---|---|---|---|")
        keys = ("hit_rate", "ttft_p50", "ttft_p99", "out_tok_s", "computed_tokens", "busy")
        keys += ("starved",)
        for policy, rs in runs.items():
            med = {key: statistics.median(r[key] for r in rs) for key in keys}
            print(
                f"| {policy} | {med['hit_rate']:.3f} | {med['ttft_p50']:.3f} "
                f"| {med['ttft_p99']:.3f} | {med['out_tok_s']:.1f} "
                f"| {med['computed_tokens']:.0f} | {med['busy']:.2f} / {med['starved']:.2f} |",
                flush=True,
            )
    first = next(iter(runs.values()))[0]
    print(f"\n{first['prompt_tokens']:.0f} prompt tokens per request (mean)")


if __name__ == "__main__":
    main()
