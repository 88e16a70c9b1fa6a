"""A cluster simulation: K replicas, each the real Rust scheduler and prefix cache (KV events
on), behind the real router core, with a step-time model instead of a forward pass, to compare
routing policies at replica counts this machine cannot run for real.

Step time = `base + per_token * batched tokens` (calibrate both from measured step times, e.g.
`pagedllm bench`'s; the defaults are this machine's 56M model on 1 thread, roughly). Requests
arrive as a Poisson process; a step's events reach the router when the step ends, before the
requests it finished are. Policies: the core's four, plus `approx` (`ApproximateRouter`):
cache-aware scoring over a record of what was sent where (SGLang's approximate tree, as block
hashes) instead of the replicas' events, so it cannot see evictions. It lives here, beside the
only thing that uses it: the baseline the event-driven router is measured against.

    python -m pagedllm.router.sim --replicas 8 16 64 [--workload shared_prefix|multi_turn|long_chat]
        [--blocks B] [--seeds N] [--first-seed S] [--affinity-weight A] [--divert-ratio D]
"""

from __future__ import annotations

import argparse
import heapq
import random
import statistics

import numpy as np

from pagedllm._core import KV_EVENT_STORED, Router, Scheduler, hash_block_chain

POLICIES = ("cache_aware", "approx", "least_loaded", "round_robin")
# conversations per replica, turns, tokens per turn. long_chat: histories of up to 512 tokens
# (32 blocks), 4 per replica: more than a replica's cache holds at the default --blocks, so
# evictions decide what is cached (None: shared_prefix, sized by --groups-per-replica)
WORKLOADS = {"shared_prefix": None, "multi_turn": (8, 4, 96), "long_chat": (4, 8, 64)}


def shared_prefix(groups: int, questions: int, prefix: int, question: int, seed: int = 0):
    """SGLang's generated-shared-prefix: `groups` system prompts x `questions` questions each."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(groups):
        system = [rng.randrange(1, 30000) for _ in range(prefix)]
        prompts += [
            system + [rng.randrange(1, 30000) for _ in range(question)] for _ in range(questions)
        ]
    rng.shuffle(prompts)
    return prompts


def multi_turn(convs: int, turns: int, turn_len: int, seed: int = 0):
    """Conversations whose every turn repeats the history: turn t of all, then t + 1."""
    rng = random.Random(seed)
    histories = [[] for _ in range(convs)]
    prompts = []
    for _ in range(turns):
        order = list(range(convs))
        rng.shuffle(order)
        for c in order:
            histories[c] = histories[c] + [rng.randrange(1, 30000) for _ in range(turn_len)]
            prompts.append(list(histories[c]))
    return prompts


class ApproximateRouter:
    """SGLang's approximate tree, as block hashes: the router core's `cache_aware` scoring over a
    record of where each prompt was sent, kept for good (the replicas' events are never read,
    so an eviction is never seen), fed to the core's index as the replica's own stored blocks.
    Its remembered blocks are all it knows: no affinity, no pending blocks, no diverting (each
    is a use of the events' exact view). `knobs`: the core's other keyword arguments."""

    def __init__(self, replicas: int, block_size: int, **knobs) -> None:
        exact_only = {"affinity_weight": 0.0, "divert_ratio": 0.0, "pending_ttl": 0.0}
        self.core = Router(replicas, block_size, "cache_aware", **{**knobs, **exact_only})
        self.block_size = block_size

    def route(self, token_ids: list[int], now: float = 0.0) -> tuple[int, int, int, int, int]:
        """The core's decision; the prompt's reusable blocks are recorded on its replica."""
        decision = self.core.route(token_ids, now=now)
        replica, bs = decision[0], self.block_size
        reusable = (len(token_ids) - 1) // bs * bs  # the last token is always computed
        hashes = np.asarray(hash_block_chain(token_ids[:reusable], bs), np.uint64)
        if len(hashes):
            seq = self.core.next_seq(replica)
            stored = np.array([KV_EVENT_STORED], np.uint8), np.array([0, len(hashes)], np.uint32)
            self.core.apply_events(replica, seq, *stored, hashes)
        return decision

    def finish(self, ticket: int) -> None:
        self.core.finish(ticket)

    def set_load(self, replica: int, waiting: int, running: int, kv_usage: float) -> None:
        self.core.set_load(replica, waiting, running, kv_usage)


def simulate(
    prompts,
    *,
    replicas: int,
    policy: str,
    rate: float,
    blocks: int,
    out: int = 16,
    base: float = 0.02,
    per_token: float = 0.0004,
    block_size: int = 16,
    seed: int = 0,
    **knobs,
):
    """Runs the trace; returns hit rate (cached / prompt tokens), TTFT p50 / p99 and tokens/s.
    `knobs`: the router core's keyword arguments (its defaults where absent or None)."""
    rng = random.Random(seed)
    approx = policy == "approx"
    knobs = {k: v for k, v in knobs.items() if v is not None}
    if approx:
        router = ApproximateRouter(replicas, block_size, **knobs)
    else:
        router = Router(replicas, block_size, policy, **knobs)
    scheds = []
    for _ in range(replicas):
        s = Scheduler(
            block_size=block_size,
            num_gpu_blocks=blocks,
            max_model_len=4096,
            max_num_seqs=64,
            max_num_batched_tokens=2048,
        )
        s.set_kv_events(not approx)
        scheds.append(s)
    seqs = [0] * replicas
    t, arrivals = 0.0, []
    for p in prompts:
        t += rng.expovariate(rate)
        arrivals.append((t, p))
    events: list = [(a, 0, i) for i, (a, _) in enumerate(arrivals)]  # (time, kind, what)
    heapq.heapify(events)
    busy = [False] * replicas
    arrival_of, home, first, tickets = {}, {}, {}, {}
    prompt_tokens = cached = generated = 0
    now = 0.0

    def start_step(r: int) -> None:
        s = scheds[r]
        if busy[r] or not s.has_unfinished_requests():
            return
        step = s.schedule(now)
        busy[r] = True
        heapq.heappush(events, (now + base + per_token * step.num_batched_tokens, 1, (r, step)))

    while events:
        now, kind, what = heapq.heappop(events)
        if kind == 0:
            _, prompt = arrivals[what]
            rid = f"q{what}"
            r, _, _, _, tickets[rid] = router.route(prompt, now=now)
            scheds[r].add_request(rid, prompt, max_tokens=out, ignore_eos=True, arrival_time=now)
            arrival_of[rid], home[rid] = now, r
            prompt_tokens += len(prompt)
            start_step(r)
            continue
        r, step = what
        s = scheds[r]
        for rid in step.sample_request_ids:
            if rid not in first:
                first[rid] = now
                cached += s.num_cached_tokens(rid) or 0
        generated += step.num_samples
        finished = s.update_from_output(step, np.full(step.num_samples, 7, np.int64))
        if not approx:
            kinds, starts, _, _, hashes, _ = s.drain_kv_events()
            if len(kinds):
                router.apply_events(r, seqs[r], kinds, starts, hashes)
                seqs[r] += 1
        for done_rid, _, _, _, done in finished:
            if done:
                router.finish(tickets.pop(done_rid))
        stats = s.get_stats()
        router.set_load(r, stats["num_waiting"], stats["num_running"], stats["kv_usage"])
        busy[r] = False
        start_step(r)
    ttfts = sorted(first[rid] - arrival_of[rid] for rid in first)
    return {
        "hit_rate": cached / max(prompt_tokens, 1),
        "ttft_p50": statistics.median(ttfts),
        "ttft_p99": ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))],
        "tok_s": generated / now,
    }


def trace(args: argparse.Namespace, k: int, seed: int) -> list[list[int]]:
    """The command line's workload for `k` replicas, drawn with `seed`."""
    if args.workload == "shared_prefix":
        return shared_prefix(args.groups_per_replica * k, 8, 512, 32, seed=seed)
    convs, turns, turn_len = WORKLOADS[args.workload]
    return multi_turn(
        (args.convs_per_replica or convs) * k,
        args.turns or turns,
        args.turn_len or turn_len,
        seed=seed,
    )


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--replicas", type=int, nargs="+", default=[8, 16, 64])
    ap.add_argument("--workload", choices=list(WORKLOADS), default="shared_prefix")
    ap.add_argument("--groups-per-replica", type=int, default=4)
    ap.add_argument(
        "--convs-per-replica", type=int, help="multi_turn / long_chat: conversations per replica"
    )
    ap.add_argument("--turns", type=int, help="multi_turn / long_chat: turns per conversation")
    ap.add_argument("--turn-len", type=int, help="multi_turn / long_chat: tokens per turn")
    ap.add_argument("--blocks", type=int, default=128, help="KV blocks per replica")
    ap.add_argument("--rate-per-replica", type=float, default=4.0, help="requests/s")
    ap.add_argument("--policies", nargs="+", default=list(POLICIES))
    ap.add_argument(
        "--token-weight",
        type=float,
        help="cache_aware / approx: the prefill-cost weight (default: the router core's)",
    )
    ap.add_argument(
        "--affinity-weight",
        type=float,
        help="cache_aware: what a block counts for on the replica it was last routed to once "
        "that replica evicted it (default: the router core's)",
    )
    ap.add_argument(
        "--divert-ratio",
        type=float,
        help="cache_aware: leave the best-scored replica for the one with the least prefill "
        "ahead when the best's is over this many times that; 0: never (default: the core's)",
    )
    ap.add_argument("--load-weight", type=float, help="cache_aware / approx (default: the core's)")
    ap.add_argument(
        "--first-seed",
        type=int,
        default=0,
        help="the seeds are first-seed .. first-seed + seeds - 1 (tune on other seeds than "
        "those reported)",
    )
    ap.add_argument(
        "--seeds",
        type=int,
        default=1,
        help="runs per row, each with its own trace and arrivals; the row is their mean (one "
        "run's p99 rests on its few slowest requests)",
    )
    args = ap.parse_args(argv)
    seeds = range(args.first_seed, args.first_seed + args.seeds)
    knobs = {"token_weight": args.token_weight, "load_weight": args.load_weight}
    print("| replicas | policy | hit rate | TTFT p50 (s) | TTFT p99 (s) | tok/s |")
    print("|---|---|---|---|---|---|")
    for k in args.replicas:
        traces = [(seed, trace(args, k, seed)) for seed in seeds]
        for policy in args.policies:
            runs = [
                simulate(
                    prompts,
                    replicas=k,
                    policy=policy,
                    blocks=args.blocks,
                    rate=args.rate_per_replica * k,
                    seed=seed,
                    affinity_weight=args.affinity_weight,
                    divert_ratio=args.divert_ratio,
                    **knobs,
                )
                for seed, prompts in traces
            ]
            m = {key: statistics.mean(r[key] for r in runs) for key in runs[0]}
            print(
                f"| {k} | {policy} | {m['hit_rate']:.3f} | {m['ttft_p50']:.3f} "
                f"| {m['ttft_p99']:.3f} | {m['tok_s']:.0f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
