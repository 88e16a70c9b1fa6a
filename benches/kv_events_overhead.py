"""What publishing KV events costs a decode step at 1024 running (issue 25 item 2).

Two schedulers in the steady-decode state of `steady_state.py` (1024 requests, 512-token
prompts, block size 16, prefix caching on): one with KV events off, one with them on, whose
every step is drained and published (`Scheduler.drain_kv_events` -> `KVEventPublisher.publish`:
the Rust encoding to vLLM's msgpack, the ZMQ send, the replay buffer and the snapshot mirror)
with a subscriber reading them in another process. Rounds of `STEPS` steps alternate between the
two; the medians of the per-step times are printed. The scheduler alone is the worst case: an
engine's step adds the model's forward, which dwarfs both.

    PYTHONPATH=python python benches/kv_events_overhead.py [rounds]
    PYTHONPATH=python python benches/kv_events_overhead.py engine [rounds]

`engine`: the same A/B over whole `LLMEngine.step()`s (the built-in tiny model on CPU, 1 torch
thread, 1024 requests decoding, 32-token prompts), two engines alternating rounds of 8 steps.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

from pagedllm._core import Scheduler
from pagedllm.kv_events import KVEventsConfig
from pagedllm.kv_events.publisher import KVEventPublisher

from steady_state import prefilled

STEPS = 64
# the subscriber: counts batches and bytes until terminated, then prints both
READER = """
import signal, sys, zmq
n = size = 0
def done(*_):
    print(n, size, flush=True); sys.exit(0)
signal.signal(signal.SIGTERM, done)
sub = zmq.Context().socket(zmq.SUB)
sub.setsockopt(zmq.SUBSCRIBE, b"")
sub.connect(sys.argv[1])
while True:
    frames = sub.recv_multipart()
    n += 1
    size += len(frames[2])
"""


def decode_round(s: Scheduler, publisher: KVEventPublisher | None) -> float:
    sampled = np.full(1024, 7, dtype=np.int64)
    t0 = time.perf_counter()
    for _ in range(STEPS):
        out = s.schedule()
        s.update_from_output(out, sampled[: out.num_samples])
        if publisher is not None:
            publisher.publish(s.drain_kv_events())
    return (time.perf_counter() - t0) / STEPS


def main(rounds: int = 7) -> None:
    folder = tempfile.mkdtemp()
    config = KVEventsConfig(
        enable_kv_cache_events=True,
        publisher="zmq",
        endpoint=f"ipc://{folder}/pub",
        replay_endpoint=f"ipc://{folder}/replay",
    )
    publisher = KVEventPublisher(config, 16, medium="CPU")
    reader = subprocess.Popen(
        [sys.executable, "-c", READER, config.endpoint], text=True, stdout=subprocess.PIPE
    )
    off = prefilled(Scheduler, 16, True)
    on = prefilled(Scheduler, 16, True)
    on.set_kv_events(True)
    on.drain_kv_events()  # the prefill's registrations are not part of the measurement
    times: dict[str, list[float]] = {"off": [], "on": []}
    for _ in range(rounds):
        times["off"].append(decode_round(off, None))
        times["on"].append(decode_round(on, publisher))
    time.sleep(0.5)
    publisher.close()
    reader.terminate()
    received = [int(x) for x in (reader.communicate()[0].split() or [0, 0])[-2:]]
    med = {k: statistics.median(v) * 1e6 for k, v in times.items()}
    print(f"rounds {rounds} x {STEPS} decode steps, 1024 running, block 16, prefix caching on")
    print(
        f"events off: median {med['off']:.1f} us/step  (rounds: "
        f"{', '.join(f'{t * 1e6:.0f}' for t in times['off'])})"
    )
    print(
        f"events on:  median {med['on']:.1f} us/step  (rounds: "
        f"{', '.join(f'{t * 1e6:.0f}' for t in times['on'])})"
    )
    print(
        f"difference: {med['on'] - med['off']:+.1f} us/step "
        f"({(med['on'] / med['off'] - 1) * 100:+.1f} %)"
    )
    print(f"batches received {received[0]}, mean {received[1] / max(received[0], 1):.0f} bytes")


def engine_round(engine, steps: int = 8) -> float:
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    return (time.perf_counter() - t0) / steps


def main_engine(rounds: int = 7) -> None:
    from pagedllm import EngineArgs, LLMEngine, SamplingParams

    folder = tempfile.mkdtemp()
    engines = {}
    for name in ("off", "on"):
        events = None
        if name == "on":
            events = {
                "enable_kv_cache_events": True,
                "publisher": "zmq",
                "endpoint": f"ipc://{folder}/pub",
                "replay_endpoint": f"ipc://{folder}/replay",
            }
        engine = LLMEngine.from_engine_args(
            EngineArgs(
                device="cpu",
                cpu_threads=1,
                max_num_seqs=1024,
                max_model_len=512,
                max_num_batched_tokens=8192,
                num_gpu_blocks=1024 * 20,
                kv_events_config=events,
            )
        )
        params = SamplingParams(max_tokens=400, ignore_eos=True)
        rng = np.random.default_rng(0)
        for i in range(1024):
            prompt = {"prompt_token_ids": rng.integers(0, 256, 32).tolist()}
            engine.add_request(f"r{i}", prompt, params)
        while engine.scheduler.num_waiting():
            engine.step()
        engines[name] = engine
    times: dict[str, list[float]] = {"off": [], "on": []}
    for _ in range(rounds):
        for name, engine in engines.items():
            times[name].append(engine_round(engine))
    for engine in engines.values():
        engine.shutdown()
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    print(f"engine steps, {rounds} rounds x 8, 1024 running, tiny model, 1 thread")
    for name in ("off", "on"):
        rounds_ms = ", ".join(f"{t * 1e3:.1f}" for t in times[name])
        print(f"events {name}: median {med[name]:.2f} ms/step  (rounds: {rounds_ms})")
    print(f"difference: {med['on'] - med['off']:+.2f} ms/step")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "engine":
        main_engine(int(sys.argv[2]) if len(sys.argv) > 2 else 7)
    else:
        main(int(sys.argv[1]) if len(sys.argv) > 1 else 7)
