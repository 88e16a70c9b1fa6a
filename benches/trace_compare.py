"""Behaviour identity of two scheduler builds: seeded random workloads, every step compared.

Runs the same seeded workloads through two builds of `pagedllm._core` (the reference, e.g. main
before a scheduler change, and the build under test) and compares, step by step, everything the
Python surface shows: every `SchedulerOutput` field (arrays byte for byte, lists, counts),
`update_from_output`'s finished list, `discard_step`'s rollbacks, errors (type and message),
the three queues, `get_stats()`, per-request status and cached tokens, and outputs held across
later steps (read back at the end, as an engine holding a step would).

The workloads cover every strategy, policy and preemption mode (none, recompute, swap), prefix
caching on and off, lookahead slots, delay factor, aborts, discarded steps, stop tokens and stop
strings, n > 1, priorities, shared prompts (prefix hits), prompts longer than the model, tiny
pools that preempt, larger ones with more than 64 decodes per step, and the features the build
has (LoRA adapters with `max_loras`; speculative decoding: the `:spec4` workloads propose n-gram
drafts, or set random ones as a draft model would, before every step and accept a random
prefix of each row's drafts). Compare builds of the same feature level.

Usage (the build under test is whatever `import pagedllm` finds; the reference is a directory
holding another build's `pagedllm` package, e.g. an unpacked wheel):

    git worktree add /tmp/ref <commit> && cd /tmp/ref && maturin build --release -o /tmp/ref-wheel
    mkdir /tmp/ref-pkg && cd /tmp/ref-pkg && unzip -q /tmp/ref-wheel/*.whl
    python benches/trace_compare.py --reference /tmp/ref-pkg [--seeds 4] [--large-seeds 2] \
        [--spec-seeds 1]

It prints one line per workload family and exits non-zero at the first workload whose traces
differ, showing the first differing line of each side. `--emit FILE` writes this build's
digests (used internally for the reference side); `--show NAME` prints one workload's full trace.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import os
import random
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Workload:
    """One seeded run: a scheduler configuration and the seed of its request stream."""

    strategy: str
    policy: str
    preemption_mode: str | None
    caching: bool
    variant: int
    seed: int
    large: bool
    # draft tokens per sequence and step (speculative decoding); 0 = off
    spec: int = 0

    @property
    def name(self) -> str:
        size = "large" if self.large else "small"
        spec = f":spec{self.spec}" if self.spec else ""
        return (
            f"{size}:{self.strategy}:{self.policy}:{self.preemption_mode}:"
            f"caching={self.caching}:v{self.variant}:seed{self.seed}{spec}"
        )

    @staticmethod
    def parse(name: str) -> Workload:
        size, st, po, mode, caching, v, seed, *spec = name.split(":")
        return Workload(
            st,
            po,
            None if mode == "None" else mode,
            caching == "caching=True",
            int(v[1:]),
            int(seed[4:]),
            size == "large",
            int(spec[0][4:]) if spec else 0,
        )


# Small variants: tiny pools (preemption, swap, CoW of forked tails), chunking thresholds,
# lookahead and delay; (budget, max_seqs, max_model_len, threshold, lookahead, delay,
# block_size, device, host, watermark).
SMALL = [
    (32, 6, 40, 0, 0, 0.0, 4, 12, 6, 0.0),
    (48, 8, 48, 8, 0, 0.0, 4, 16, 8, 0.1),
    (20, 4, 30, 0, 1, 0.5, 2, 20, 0, 0.0),
    (32, 6, 40, 0, 0, 0.0, 4, 5, 3, 0.2),
]
# Large variants: 100-200 running (more than 64 decodes per step, the fast path's batches),
# shared prompt heads (prefix hits), enough pressure to preempt late in the run.
LARGE = [
    (512, 160, 96, 0, 0, 0.0, 4, 300, 200, 0.0),
    (256, 200, 80, 16, 0, 0.0, 8, 400, 0, 0.01),
]


def workloads(seeds: int, large_seeds: int, spec_seeds: int) -> Iterator[Workload]:
    from pagedllm._core import POLICIES, PREEMPTION_MODES, SCHEDULING_STRATEGIES, Scheduler

    specs = [0]
    if "num_speculative_tokens" in (Scheduler.__text_signature__ or ""):
        specs.append(4)
    for st, po, mode, caching, spec in itertools.product(
        SCHEDULING_STRATEGIES, POLICIES, PREEMPTION_MODES, (True, False), specs
    ):
        small, large = (seeds, large_seeds) if spec == 0 else (spec_seeds, spec_seeds)
        for v in range(len(SMALL)):
            for seed in range(small):
                yield Workload(st, po, mode, caching, v, seed, False, spec)
        for v in range(len(LARGE)):
            for seed in range(large):
                yield Workload(st, po, mode, caching, v, seed, True, spec)


def _value(x: object) -> object:
    """A JSON-able, exact rendering of a surface value (arrays keep their dtype and shape)."""
    if isinstance(x, np.ndarray):
        return [str(x.dtype), list(x.shape), x.tobytes().hex()]
    if isinstance(x, (list, tuple)):
        return [_value(v) for v in x]
    if isinstance(x, dict):
        return {str(k): _value(v) for k, v in sorted(x.items())}
    if isinstance(x, float):
        return repr(x)
    return x


def _output_fields(out: object) -> list[str]:
    return sorted(n for n in dir(out) if not n.startswith("_"))


def _render_output(out: object, fields: list[str]) -> str:
    row = {}
    for f in fields:
        try:
            v = getattr(out, f)
            row[f] = _value(v() if callable(v) else v)
        except Exception as e:  # an error is part of the behaviour
            row[f] = f"!{type(e).__name__}: {e}"
    return json.dumps(row, sort_keys=True)


def _call(line: list[str], label: str, fn, *args, **kwargs) -> object:
    """Calls `fn`, logging its result (or its error: part of the behaviour)."""
    try:
        r = fn(*args, **kwargs)
    except Exception as e:
        line.append(f"{label} !{type(e).__name__}: {e}")
        return None
    if label == "schedule":  # the output's fields are logged on their own
        line.append(f"{label} step {r.step}")
    else:
        line.append(f"{label} {json.dumps(_value(r))}")
    return r


def run(w: Workload, fields: list[str] | None = None) -> Iterator[str]:
    """The workload's trace, one line at a time."""
    from pagedllm._core import Scheduler

    rng = random.Random(f"{w.name}")
    cfg = (LARGE if w.large else SMALL)[w.variant]
    budget, max_seqs, max_len, threshold, lookahead, delay, bs, dev, host, wm = cfg
    # Features are exercised when the build has them (compare builds of one feature level).
    extra: dict[str, int] = {}
    lora = "max_loras" in (Scheduler.__text_signature__ or "")
    if lora:
        extra["max_loras"] = w.seed % 3  # off, or at most 1 or 2 adapters per step
    if w.spec:
        extra["num_speculative_tokens"] = w.spec
        extra["prompt_lookup_max"] = 1 + w.seed % 3
    try:
        s = Scheduler(
            **extra,
            num_gpu_blocks=dev,
            block_size=bs,
            num_cpu_blocks=host,
            max_num_batched_tokens=budget,
            max_num_seqs=max_seqs,
            max_model_len=max_len,
            scheduling=w.strategy,
            policy=w.policy,
            preemption_mode=w.preemption_mode,
            enable_prefix_caching=w.caching,
            watermark=wm,
            long_prefill_token_threshold=threshold,
            num_lookahead_slots=lookahead,
            delay_factor=delay,
        )
    except Exception as e:
        yield f"new !{type(e).__name__}: {e}"
        return
    num_requests = rng.randint(150, 260) if w.large else 30
    added = 0
    held: list[object] = []
    for step in range(900 if w.large else 300):
        log: list[str] = [f"step {step}"]
        burst = rng.randint(1, 40) if w.large and step < 8 else (1 if rng.random() < 0.5 else 0)
        for _ in range(burst):
            if added >= num_requests:
                break
            shared = rng.random() < 0.35
            n_prompt = rng.randint(1, max_len // 2 if w.large else 24)
            if rng.random() < 0.03:  # longer than the model: ignored or refused
                n_prompt = max_len + rng.randint(0, 3)
            head = [500 + i for i in range(n_prompt)]
            prompt = head if shared else [1000 + 37 * added + i for i in range(n_prompt)]
            kwargs = dict(
                n=rng.choice([1, 1, 1, 2, 3]),
                priority=rng.randint(0, 2),
                arrival_time=step * 0.1 + rng.randint(0, 2),
                max_tokens=rng.randint(1, 40 if w.large else 14),
                min_tokens=rng.randint(0, 1),
                eos_token_id=0,
                stop_token_ids=[5] if rng.random() < 0.25 else None,
                ignore_eos=rng.random() < 0.2,
                extra_key=rng.randint(0, 1),
            )
            if lora:
                kwargs["lora_id"] = rng.randint(0, 3) if w.seed % 3 else 0
            _call(log, f"add q{added}", s.add_request, f"q{added}", prompt, **kwargs)
            added += 1
        if added and rng.random() < 0.08:
            ids = [f"q{rng.randrange(added)}" for _ in range(rng.randint(1, 3))]
            _call(log, f"abort {ids}", s.abort_request, ids)
        if w.spec:
            propose_drafts(s, w, rng, log, added)
        out = _call(log, "schedule", s.schedule, step * 0.05)
        if out is None:
            yield from log
            break
        fields = fields or _output_fields(out)
        if rng.random() < 0.5:  # read now; otherwise the arrays are read lazily, later
            log.append("out " + _render_output(out, fields))
        k = out.num_samples
        if rng.random() < 0.06:
            _call(log, "discard", s.discard_step, out)
        else:
            vocab = 8 if not w.large else 64
            sampled = np.array([rng.randrange(vocab) for _ in range(k)], dtype=np.int64)
            hits = None
            if rng.random() < 0.5:
                hits = np.array([rng.random() < 0.05 for _ in range(k)], dtype=np.bool_)
            if w.spec:
                sampled, runs = accept_drafts(out, sampled, rng)
                _call(log, "update", s.update_from_output, out, sampled, hits, num_tokens=runs)
            else:
                _call(log, "update", s.update_from_output, out, sampled, hits)
        if rng.random() < 0.2:
            held.append(out)
        _call(log, "invariants", s.check_invariants)
        log.append(f"queues {s.waiting_ids()} {s.running_ids()} {s.swapped_ids()}")
        log.append(f"stats {json.dumps(_value(s.get_stats()))}")
        if added:
            probe = f"q{rng.randrange(added)}"
            log.append(f"probe {probe} {s.request_status(probe)} {s.num_cached_tokens(probe)}")
        yield from log
        if added >= num_requests and not s.has_unfinished_requests():
            break
    for k, out in enumerate(held):
        yield f"held {k} " + _render_output(out, fields or _output_fields(out))
    yield f"end {s.has_unfinished_requests()} {json.dumps(_value(s.get_stats()))}"


def propose_drafts(s, w: Workload, rng: random.Random, log: list[str], added: int) -> None:
    """Drafts for the next step: the n-gram proposer's, or (one step in four) random runs for
    random sequence ids, some of them not running, as a draft model's would come."""
    if rng.random() < 0.75:
        _call(log, "propose", s.propose_drafts)
        return
    ids = sorted({rng.randrange(3 * added + 1) for _ in range(rng.randint(0, 12))})
    counts = [rng.randint(0, w.spec + 1) for _ in ids]
    tokens = [rng.randrange(8) for _ in range(sum(counts))]
    _call(log, "set_drafts", s.set_drafts, ids, counts, tokens)


def accept_drafts(out, sampled: np.ndarray, rng: random.Random) -> tuple[np.ndarray, np.ndarray]:
    """Each sample's run: a random prefix of its row's drafts, then its sampled token."""
    drafts = out.spec_num_draft_tokens
    ids = out.spec_draft_token_ids
    starts = np.concatenate([[0], np.cumsum(drafts)]) if len(drafts) else np.zeros(1, np.int64)
    tokens: list[int] = []
    runs: list[int] = []
    for k, row in enumerate(out.sample_rows):
        d = int(drafts[row]) if len(drafts) else 0
        a = rng.randint(0, d)
        o = int(starts[row])
        tokens.extend(int(t) for t in ids[o : o + a])
        tokens.append(int(sampled[k]))
        runs.append(a + 1)
    return np.array(tokens, dtype=np.int64), np.array(runs, dtype=np.int64)


def digest(w: Workload) -> str:
    h = hashlib.sha256()
    for line in run(w):
        h.update(line.encode())
        h.update(b"\n")
    return h.hexdigest()


def emit(path: str, names: list[str]) -> None:
    import pagedllm

    with open(path, "w") as f:
        f.write(f"{pagedllm.__file__}\n")
        for name in names:
            f.write(f"{name} {digest(Workload.parse(name))}\n")


def reference(ref_dir: str, args: list[str]) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([ref_dir, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    # The script's own folder would otherwise put nothing in front; -P keeps the current
    # directory (a source checkout) from shadowing the reference package.
    return subprocess.run(
        [sys.executable, "-P", __file__, *args], env=env, capture_output=True, text=True
    )


def first_difference(ref_dir: str, name: str) -> str:
    ours = list(run(Workload.parse(name)))
    theirs = reference(ref_dir, ["--show", name]).stdout.splitlines()
    for i, (a, b) in enumerate(itertools.zip_longest(theirs, ours, fillvalue="<end>")):
        if a != b:
            return f"line {i}:\n  reference: {a[:2000]}\n  this build: {b[:2000]}"
    return "identical on a rerun (nondeterminism?)"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reference", help="directory holding the reference build's pagedllm")
    p.add_argument("--seeds", type=int, default=4, help="seeds per small workload")
    p.add_argument("--large-seeds", type=int, default=1, help="seeds per large workload")
    p.add_argument(
        "--spec-seeds", type=int, default=1, help="seeds per workload with drafts (each size)"
    )
    p.add_argument("--emit", help=argparse.SUPPRESS)
    p.add_argument("--names", help=argparse.SUPPRESS)
    p.add_argument("--show", help="print one workload's trace (by name) and exit")
    a = p.parse_args()
    if a.show:
        for line in run(Workload.parse(a.show)):
            print(line)
        return 0
    if a.emit:
        with open(a.names) as f:
            emit(a.emit, f.read().split())
        return 0
    if not a.reference:
        p.error("--reference is required")
    import pagedllm

    names = [w.name for w in workloads(a.seeds, a.large_seeds, a.spec_seeds)]
    tmp = f"/tmp/trace_compare.{os.getpid()}"
    with open(f"{tmp}.names", "w") as f:
        f.write("\n".join(names))
    r = reference(a.reference, ["--emit", f"{tmp}.ref", "--names", f"{tmp}.names"])
    if r.returncode != 0:
        print(r.stderr, file=sys.stderr)
        return 2
    with open(f"{tmp}.ref") as f:
        ref_file, *rows = f.read().splitlines()
    ref = dict(row.split() for row in rows)
    print(f"this build: {pagedllm.__file__}\nreference:  {ref_file}\n{len(names)} workloads")
    if ref_file == pagedllm.__file__:
        print("the reference imported this build: check --reference", file=sys.stderr)
        return 2
    families: dict[str, int] = {}
    for name in names:
        if ref[name] != digest(Workload.parse(name)):
            print(f"DIFFERENT: {name}\n{first_difference(a.reference, name)}")
            return 1
        parts = name.split(":")
        fam = ":".join(parts[:5] + parts[7:])
        families[fam] = families.get(fam, 0) + 1
    for fam, count in families.items():
        print(f"identical  {fam}  ({count} workloads)")
    print(f"all {len(names)} workloads identical")
    return 0


if __name__ == "__main__":
    sys.exit(main())
