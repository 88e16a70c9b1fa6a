"""Shared-memory names left by an engine killed (SIGKILL) between creating a segment and its ranks
mapping it, with no supervisor above it to remove them: the next start removes them, and never a
live creator's (`distributed/shm_names.py`)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from pagedllm.config import EngineArgs
from pagedllm.distributed.shm_names import remove_stale_segments

from engine_util import running_engine
from model_factory import save_tiny_checkpoint

# a process that creates a segment as rank 0 does at start (the ring), says its name, then waits
# to be killed before it unlinks it: the worst moment
_CREATOR = """
import sys
from pagedllm._core import ShmRingWriter
ring = ShmRingWriter(1, 4, 4096)
print(ring.name, flush=True)
sys.stdin.read()
"""


def _creator() -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", _CREATOR], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    name = proc.stdout.readline().strip()
    assert name, "the creator made no segment"
    return proc, f"/dev/shm/{name.lstrip('/')}"


def _killed_creator() -> str:
    proc, path = _creator()
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert os.path.exists(path)  # left behind: nothing unlinked it
    return path


def test_the_segment_of_a_killed_creator_is_removed_at_the_next_start():
    path = _killed_creator()
    remove_stale_segments()
    assert not os.path.exists(path)


def test_the_segment_of_a_live_creator_is_kept():
    proc, path = _creator()
    try:
        remove_stale_segments()
        assert os.path.exists(path)
    finally:
        proc.kill()
        proc.wait()
        remove_stale_segments()
    assert not os.path.exists(path)


def test_a_two_rank_engine_start_removes_a_killed_engines_segment(tmp_path):
    path = _killed_creator()
    folder = save_tiny_checkpoint(tmp_path, "llama")
    args = EngineArgs(
        model=str(folder),
        tensor_parallel_size=2,
        device="cpu",
        cpu_threads=1,
        max_model_len=64,
        num_gpu_blocks=8,
    )
    with running_engine(args):
        assert not os.path.exists(path)
