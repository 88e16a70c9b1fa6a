"""What publishing KV events costs a decode step at 1024 running (issue 25 item 2).

Two schedulers in the steady-decode state of `steady_state.py` (1024 requests, 512-token
prompts, block size 16, prefix caching on): one with KV events off, one with them on, whose
every step is drained and published (`Scheduler.drain_kv_events` -> `KVEventPublisher.publish`:
the Rust encoding to vLLM's msgpack, the ZMQ send, the replay buffer and the snapshot mirror)
with a subscriber reading them in another process. Rounds of `STEPS` steps alternate between the
two; the medians of the per-step times are printed. The scheduler alone is the worst case: an
engine's step adds the model's forward, which dwarfs both.

    PYTHONPATH=python python benches/kv_events_overhead.py [rounds]
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


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 7)
