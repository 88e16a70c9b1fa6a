"""All-reduce of 2 ranks on this host: the shared-memory all-reduce (`parallel_state.all_reduce`
over `_core.ShmAllReduce`) against gloo (`torch.distributed.all_reduce`), float32, 4 KB to 32 MB.

Both run in the same two processes, alternated round by round; each round times a burst of
reduces (per-op time = burst time / burst size) and the table shows the medians over the rounds.

    PYTHONPATH=python python benches/allreduce_bench.py [--rounds 7]
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import time

import torch
import torch.distributed as dist

from pagedllm.distributed import parallel_state

SIZES = [4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 32 << 20]


def _burst(size: int) -> int:
    return max(3, min(200, (8 << 20) // size))


def _rank(rank: int, rendezvous, rounds: int, results) -> None:
    torch.set_num_threads(1)
    parallel_state.init_tensor_parallel(
        rank, 2, rendezvous, device=torch.device("cpu"), timeout_s=120.0, startup_timeout_s=120.0
    )
    assert parallel_state.uses_shm_allreduce()
    ways = {"shm": parallel_state.all_reduce, "gloo": dist.all_reduce}
    table = {}
    for size in SIZES:
        x = torch.ones(size // 4)
        n = _burst(size)
        for way in ways.values():  # warm-up
            way(x)
        times = {name: [] for name in ways}
        for _ in range(rounds):
            for name, way in ways.items():
                dist.barrier()
                start = time.perf_counter()
                for _ in range(n):
                    way(x)
                times[name].append((time.perf_counter() - start) / n)
        table[size] = {name: statistics.median(t) for name, t in times.items()}
    if rank == 0:
        results.put(table)
    parallel_state.destroy_tensor_parallel()


def _human(size: int) -> str:
    return f"{size >> 20} MB" if size >= 1 << 20 else f"{size >> 10} KB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    store = parallel_state.open_rendezvous(2, 120.0)  # held here while the ranks meet
    rendezvous = parallel_state.Rendezvous("127.0.0.1", store.port)
    procs = [
        context.Process(target=_rank, args=(r, rendezvous, args.rounds, results)) for r in range(2)
    ]
    for proc in procs:
        proc.start()
    table = results.get()
    for proc in procs:
        proc.join()
    print("| size | shm all-reduce | gloo all-reduce | gloo / shm |")
    print("| --- | --- | --- | --- |")
    for size, row in table.items():
        shm, gloo = row["shm"] * 1e6, row["gloo"] * 1e6
        print(f"| {_human(size)} | {shm:.1f} µs | {gloo:.1f} µs | {gloo / shm:.1f}× |")


if __name__ == "__main__":
    main()
