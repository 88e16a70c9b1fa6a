"""The per-step control plane of the `mp` tensor-parallel executor: from rank 0 holding a
scheduler step to a worker holding its `StepArrays` (rank 0's `StepArrays.of` + encode + ring
publish, the worker's wake-up, receive and `decode_step`), at 1 / 64 / 1024 running decode
requests. Against it, the transport it replaced: the same step pickled down a pipe.

A worker process receives each step and stamps the moment its arrays are ready
(`time.perf_counter_ns`: CLOCK_MONOTONIC, one clock for both processes); rank 0 stamps the
moment it starts sending. Rank 0 waits for the worker's answer before the next step (as the
executor does), then idles `--idle-ms` (rank 0's own forward and sampling: the worker's wait goes
past its spin into a futex sleep, so its wake-up is counted) — `--idle-ms 0` shows the
back-to-back cost. Both transports alternate in rounds; medians over all steps.

    PYTHONPATH=python python benches/tp_control_plane_bench.py [--steps 200] [--idle-ms 2]
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import time

import numpy as np

from pagedllm._core import Scheduler, ShmRingReader, ShmRingWriter
from pagedllm.executor import multiproc
from pagedllm.executor.multiproc import StepArrays, decode_step

RUNNING = (1, 64, 1024)
PROMPT = 512


def decode_step_of(running: int):
    """A decode step of `running` sequences with 512-token contexts (block size 16)."""
    s = Scheduler(
        block_size=16,
        max_num_seqs=running,
        max_model_len=2048,
        max_num_batched_tokens=16384,
        num_gpu_blocks=running * (2048 // 16 + 1),
    )
    rng = np.random.default_rng(0)
    for i in range(running):
        s.add_request(f"r{i}", rng.integers(0, 50_000, PROMPT).tolist(), max_tokens=1024)
    while True:
        out = s.schedule()
        s.update_from_output(out, np.full(out.num_samples, 7, dtype=np.int64))
        if out.is_decode_only and out.num_seqs == running:
            return s.schedule()


def _worker(ring_name: str, conn) -> None:
    ring = ShmRingReader(ring_name, 1)
    conn.send("attached")
    while (command := conn.recv())[0] != "stop":
        transport, steps = command
        for _ in range(steps):
            if transport == "pipe":
                message = conn.recv()
                ready = time.perf_counter_ns()
                assert message[2].num_seqs > 0
            else:
                tag, ints, items = ring.receive()
                _, arrays, _ = decode_step(ints, items)
                ready = time.perf_counter_ns()
                assert arrays.num_seqs > 0
                del arrays, items
                ring.ack()
            conn.send(ready)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--idle-ms", type=float, default=2.0)
    args = parser.parse_args()
    context = multiprocessing.get_context("spawn")
    ring = ShmRingWriter(1, multiproc.RING_CHUNKS, multiproc.RING_CHUNK_BYTES)
    ours, theirs = context.Pipe()
    worker = context.Process(target=_worker, args=(ring.name, theirs), daemon=True)
    worker.start()
    assert ours.recv() == "attached"
    ring.unlink()
    print(f"idle between steps: {args.idle_ms:g} ms; medians of {args.steps * args.rounds} steps")
    print(
        "| running decode | step message | ring: rank 0 send | ring: send → worker ready |"
        " pipe (pickle): send → worker ready |"
    )
    print("| --- | --- | --- | --- | --- |")
    for running in RUNNING:
        step = decode_step_of(running)
        size = sum(np.asarray(getattr(step, f)).nbytes for f in multiproc.STEP_FIELDS)
        send, ring_total, pipe_total = [], [], []
        for _ in range(args.rounds):
            ours.send(("ring", args.steps))
            for _ in range(args.steps):
                time.sleep(args.idle_ms / 1000)
                start = time.perf_counter_ns()
                message = ("step", [], StepArrays.of(step), None)
                ring.publish(*multiproc._encode(message), 10.0)
                sent = time.perf_counter_ns()
                ready = ours.recv()
                send.append(sent - start)
                ring_total.append(ready - start)
            ours.send(("pipe", args.steps))
            for _ in range(args.steps):
                time.sleep(args.idle_ms / 1000)
                start = time.perf_counter_ns()
                ours.send(("step", [], StepArrays.of(step), None))
                ready = ours.recv()
                pipe_total.append(ready - start)
        us = [statistics.median(v) / 1000 for v in (send, ring_total, pipe_total)]
        print(
            f"| {running} | {size / 1024:.0f} KB | {us[0]:.1f} µs | {us[1]:.1f} µs |"
            f" {us[2]:.1f} µs |"
        )
    ours.send(("stop", 0))
    worker.join()


if __name__ == "__main__":
    main()
