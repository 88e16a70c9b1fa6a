"""`worker.Worker` and what a step carries to the other ranks: the step's input fields are named
once, by Rust (`[input]` in bindings/step_output.rs), and every rank is built by one `Worker`."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

from pagedllm import EngineArgs, LLMEngine, SamplingParams
from pagedllm._core import SCHEDULER_OUTPUT_FIELDS, STEP_INPUT_ARRAYS, STEP_INPUT_SCALARS, Scheduler
from pagedllm.attention.kv_groups import kv_group_layout
from pagedllm.worker.model_runner import ModelRunner
from pagedllm.worker.worker import STEP_FIELDS, StepArrays, StepMessage, Worker

from model_factory import save_tiny_checkpoint


def _decode_step(kv_groups=None):
    s = Scheduler(block_size=4, num_gpu_blocks=16, max_num_seqs=4, max_model_len=32)
    if kv_groups is not None:
        s.set_kv_groups(kv_groups)
    s.add_request("a", [1, 2, 3, 4, 5], max_tokens=4)
    s.add_request("b", [6, 7], max_tokens=4)
    first = s.schedule()
    s.update_from_output(first, np.full(first.num_samples, 9, dtype=np.int64))
    return s, s.schedule()


def test_the_step_fields_are_the_ones_rust_marks_as_inputs():
    assert (*STEP_INPUT_SCALARS, *STEP_INPUT_ARRAYS) == STEP_FIELDS
    assert set(STEP_FIELDS) <= set(SCHEDULER_OUTPUT_FIELDS)
    assert {"input_ids", "block_tables", "num_seqs", "is_decode_only"} <= set(STEP_FIELDS)


class _Recorder:
    """A step that records which of its fields are read."""

    def __init__(self, step) -> None:
        self._step, self.read = step, set()

    def __getattr__(self, name):
        self.read.add(name)
        return getattr(self._step, name)


@pytest.mark.parametrize("layers", [(0, 0), (0, 4)], ids=["full", "hybrid"])
def test_the_runner_reads_only_fields_a_step_carries_to_other_ranks(layers):
    layout = kv_group_layout(layers, 2, 32)
    _, step = _decode_step(list(layout.windows))
    runner = ModelRunner.__new__(ModelRunner)  # prepare needs no model
    runner.device, runner.lora = torch.device("cpu"), None
    runner.kv_layout = layout if layout.is_hybrid else None
    recorder = _Recorder(step)
    runner.prepare(recorder)
    assert recorder.read and recorder.read <= set(STEP_FIELDS)
    assert ("kv_group_tables" in recorder.read) == layout.is_hybrid


def test_a_hybrid_step_gives_each_layer_its_groups_tables():
    layout = kv_group_layout((0, 4), 2, 32)
    _, step = _decode_step(list(layout.windows))
    runner = ModelRunner.__new__(ModelRunner)
    runner.device, runner.lora, runner.kv_layout = torch.device("cpu"), None, layout
    meta = runner.prepare(step)[2]
    for layer, group in enumerate(layout.layer_group):
        slot, layer_meta = meta.for_layer(layer)
        assert slot == 0  # one layer per group: every layer is a block's only slot
        np.testing.assert_array_equal(layer_meta.block_tables, step.kv_group_tables[group])
        np.testing.assert_array_equal(layer_meta.slot_mapping, step.kv_group_slots[group])


def test_step_arrays_name_a_missing_field():
    with pytest.raises(TypeError, match="num_seqs"):
        StepArrays(**{name: 0 for name in STEP_FIELDS if name != "num_seqs"})


def test_a_step_message_pickles_with_its_arrays():
    _, step = _decode_step()
    arrays = StepArrays.of(step)
    arrays.lora_loads = ((1, "adapter"),)
    back = pickle.loads(pickle.dumps(StepMessage([], arrays, np.arange(3))))
    for name in STEP_FIELDS:
        np.testing.assert_array_equal(getattr(back.arrays, name), getattr(step, name))
    assert back.arrays.lora_loads == ((1, "adapter"),)
    np.testing.assert_array_equal(back.prompt_rows, np.arange(3))


def test_rank_zero_is_a_worker_whose_runner_the_engine_runs(tmp_path):
    folder = save_tiny_checkpoint(tmp_path, "llama", seed=3)
    engine = LLMEngine(EngineArgs(model=str(folder), device="cpu", cpu_threads=1, max_model_len=64))
    assert isinstance(engine.worker, Worker) and engine.worker.tp.rank == 0
    assert engine.runner is engine.worker.runner
    assert engine.model is engine.worker.model
    assert engine.cache_engine is engine.worker.cache_engine
    engine.add_request("a", {"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=2))
    while engine.has_unfinished_requests():
        engine.step()
