"""The step broadcast of the `mp` executor: a step's arrays through the shared-memory ring as
they left rank 0, steps too large for a chunk through the pipes, and no process or /dev/shm
segment left behind, whether the engine shuts down, a worker is killed or the engine is."""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm._core import Scheduler, ShmRingReader, ShmRingWriter
from pagedllm.config import EngineArgs
from pagedllm.executor import multiproc
from pagedllm.executor.multiproc import (
    EngineDeadError,
    MultiprocExecutor,
    StepArrays,
    decode_step,
)

from model_factory import save_tiny_checkpoint

KNOBS = dict(device="cpu", cpu_threads=1, max_model_len=96, num_gpu_blocks=32)
PROMPTS = [[40 + i + j for j in range(20 + 3 * i)] for i in range(4)]


def _segments(pid: int) -> list[str]:
    return glob.glob(f"/dev/shm/pagedllm-*-{pid}-*")


def _gone(pid: int, within: float = 10.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def _a_step():
    """A mixed scheduler step: two decoding sequences and one prefilling."""
    s = Scheduler(
        block_size=4, max_num_seqs=8, max_model_len=64, max_num_batched_tokens=16, num_gpu_blocks=64
    )
    for i in range(2):
        s.add_request(f"d{i}", list(range(5 + i)), max_tokens=8)
    out = s.schedule()
    s.update_from_output(out, np.full(out.num_samples, 3, dtype=np.int64))
    s.add_request("p", list(range(30)), max_tokens=8)
    return s.schedule()


def test_a_step_arrives_through_the_ring_as_it_left():
    step = _a_step()
    arrays = StepArrays.of(step)
    ops = [(np.array([[1, 2]]), np.zeros((0, 2), np.int64), np.array([[3, 4], [5, 6]]))]
    prompt_rows = np.array([0, 2, 5])
    writer = ShmRingWriter(1, 2, 1 << 16)
    reader = ShmRingReader(writer.name, 1)
    writer.unlink()
    assert writer.publish(*multiproc._encode(("step", ops, arrays, prompt_rows)), 5.0)
    tag, ints, items = reader.receive(5.0)
    assert tag == multiproc.TAG_STEP
    got_ops, got, got_rows = decode_step(ints, items)
    for name in multiproc.STEP_FIELDS:
        sent, received = getattr(arrays, name), getattr(got, name)
        assert np.array_equal(received, sent), name
        assert np.asarray(received).dtype == np.asarray(sent).dtype, name
    assert got.num_seqs == step.num_seqs == 3 and got.is_decode_only is False
    assert [len(o) for o in got_ops] == [3]
    for mine, theirs in zip(got_ops[0], ops[0], strict=True):
        assert np.array_equal(mine, theirs)
    assert np.array_equal(got_rows, prompt_rows)


def test_a_message_without_arrays_or_prompt_rows_arrives_as_none():
    writer = ShmRingWriter(1, 2, 1 << 16)
    reader = ShmRingReader(writer.name, 1)
    writer.unlink()
    assert writer.publish(*multiproc._encode(("step", [], None, None)))
    _, ints, items = reader.receive(5.0)
    assert decode_step(ints, items) == ([], None, None)


def test_a_byte_swapped_array_is_refused_rather_than_misread():
    writer = ShmRingWriter(1, 2, 1 << 16)
    reader = ShmRingReader(writer.name, 1)
    writer.unlink()
    swapped = np.arange(3, dtype=np.int64).astype(np.dtype(np.int64).newbyteorder())
    with pytest.raises(ValueError, match="native byte order"):
        writer.publish(1, [], [swapped], 5.0)
    assert reader.receive(0.05) is None


def test_received_arrays_stay_readable_after_their_reader_is_gone():
    writer = ShmRingWriter(1, 2, 1 << 16)
    reader = ShmRingReader(writer.name, 1)
    writer.unlink()
    assert writer.publish(7, [1], [np.arange(5, dtype=np.float32), None], 5.0)
    tag, ints, (values, absent) = reader.receive(5.0)
    del reader, writer  # the arrays hold the ring's mapping
    assert (tag, ints, absent) == (7, [1], None)
    assert values.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]


def _generate(folder, tp: int) -> list[list[int]]:
    llm = LLM(str(folder), tensor_parallel_size=tp, **KNOBS)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        if tp > 1:
            assert _segments(os.getpid()) == []  # unlinked once every worker mapped them
            pipe_messages = llm.llm_engine.executor.pipe_messages
        else:
            pipe_messages = None
        return [list(o.outputs[0].token_ids) for o in outs], pipe_messages
    finally:
        llm.llm_engine.shutdown()


def test_steps_too_large_for_a_chunk_go_through_the_pipes(tmp_path, monkeypatch):
    folder = save_tiny_checkpoint(tmp_path, "llama", num_key_value_heads=2, seed=5)
    one, _ = _generate(folder, 1)
    monkeypatch.setattr(multiproc, "RING_CHUNK_BYTES", 1024)  # the prefill steps outgrow it
    two, pipe_messages = _generate(folder, 2)
    assert two == one
    assert pipe_messages > 0


def test_a_killed_worker_leaves_no_segment(tmp_path):
    folder = save_tiny_checkpoint(tmp_path, "llama", num_key_value_heads=2, seed=5)
    llm = LLM(str(folder), tensor_parallel_size=2, tp_step_timeout=20.0, **KNOBS)
    engine = llm.llm_engine
    engine.add_request("a", {"prompt_token_ids": PROMPTS[0]}, SamplingParams(max_tokens=30))
    engine.step()
    (proc,) = engine.executor.procs
    os.kill(proc.pid, signal.SIGKILL)
    with pytest.raises(EngineDeadError, match="rank 1"):
        while engine.has_unfinished_requests():
            engine.step()
    assert _gone(proc.pid)
    assert _segments(os.getpid()) == []


ENGINE = """
import os, sys, time
from pagedllm import LLM, SamplingParams
llm = LLM({folder!r}, tensor_parallel_size=2, device="cpu", cpu_threads=1, max_model_len=96,
          num_gpu_blocks=32)
llm.generate([{{"prompt_token_ids": [1, 2, 3]}}], SamplingParams(max_tokens=2), use_tqdm=False)
(proc,) = llm.llm_engine.executor.procs
print(proc.pid, flush=True)
time.sleep(600)
"""


def test_workers_exit_when_the_engine_is_killed(tmp_path):
    folder = save_tiny_checkpoint(tmp_path, "llama", num_key_value_heads=2, seed=5)
    script = textwrap.dedent(ENGINE.format(folder=str(folder)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    engine = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, env=env)
    try:
        worker = int(engine.stdout.readline())
        os.kill(engine.pid, signal.SIGKILL)
        engine.wait()
        # the worker, waiting on the ring, sees rank 0's pid gone and exits
        assert _gone(worker)
        assert _segments(engine.pid) == []
    finally:
        engine.kill()
        engine.wait()


class _RefusingContext:
    """A multiprocessing context whose processes cannot start (e.g. out of pids)."""

    def __init__(self, real) -> None:
        self.Pipe = real.Pipe

    class Process:
        def __init__(self, **kwargs) -> None:
            pass

        def start(self) -> None:
            raise OSError("cannot fork")


def test_a_failed_spawn_leaves_no_segment(tmp_path, monkeypatch):
    folder = save_tiny_checkpoint(tmp_path, "llama", num_key_value_heads=2, seed=5)
    real = multiproc.get_context
    monkeypatch.setattr(multiproc, "get_context", lambda kind: _RefusingContext(real(kind)))
    args = EngineArgs(model=str(folder), tensor_parallel_size=2, **KNOBS)
    with pytest.raises(OSError, match="cannot fork"):
        MultiprocExecutor(args, torch.float32)
    assert _segments(os.getpid()) == []
