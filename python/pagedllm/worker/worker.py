"""`Worker`: one rank of the model — its shard, its LoRA slots, its paged KV cache and the runner
over them. Every rank is built by it: rank 0 in the engine process, ranks 1..N-1 in the `mp`
executor's processes or the `ray` executor's actors (what carries their messages differs, not
what they are). With one rank, the shard is the whole model.

A step travels to the other ranks as a `StepMessage`: the block operations since the last one,
the step's inputs (`StepArrays`) and the rows prompt logprobs need. The inputs are the
`SchedulerOutput` fields the runner reads; Rust marks them (`[input]` in
`bindings/step_output.rs`) and names them (`_core.STEP_INPUT_SCALARS`, `STEP_INPUT_ARRAYS`):
nothing here restates the list.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import NamedTuple

import numpy as np
import torch

from pagedllm._core import STEP_INPUT_ARRAYS, STEP_INPUT_SCALARS, cpu_isa
from pagedllm.config import EngineArgs
from pagedllm.distributed.layers import TPShard
from pagedllm.kernels.reference import kv_format, kv_storage_dtype
from pagedllm.models import ModelConfig, load_model
from pagedllm.models.sequence_classification import load_pooling_model
from pagedllm.worker import kv_calibration
from pagedllm.worker.cache_engine import CacheEngine
from pagedllm.worker.kv_layout import kv_layout
from pagedllm.worker.model_runner import ModelRunner

# the step fields `ModelRunner.prepare` reads: the scalars (a bool, an int), then the arrays
STEP_SCALARS: tuple[str, ...] = tuple(STEP_INPUT_SCALARS)
STEP_ARRAYS: tuple[str, ...] = tuple(STEP_INPUT_ARRAYS)
STEP_FIELDS: tuple[str, ...] = STEP_SCALARS + STEP_ARRAYS


def _step_arrays_of(cls, step):
    """The inputs of `step` (a `SchedulerOutput`, or a `StepRows` group of one)."""
    return cls(*[getattr(step, name) for name in STEP_FIELDS])


# A step's inputs as plain values (what travels to the other ranks): the fields `STEP_FIELDS`
# names, in that order, and `lora_loads`: the (slot, LoRARequest) loads rank 0 made for the step
# since the last one, which the other ranks repeat. A dataclass made from Rust's names (its
# generated `__init__`: a worker builds one per step).
StepArrays = dataclasses.make_dataclass(
    "StepArrays",
    [
        *((name, object) for name in STEP_FIELDS),
        ("lora_loads", tuple, dataclasses.field(default=())),
    ],
    namespace={"of": classmethod(_step_arrays_of)},
    eq=False,
    slots=True,
)
StepArrays.__module__ = __name__  # where pickle finds it (Ray, the pipes)
StepArrays.__doc__ = "A step's inputs as plain values (what travels to the other ranks)."


class StepMessage(NamedTuple):
    """One step for the other ranks: `block_ops` (each a step's (swap out, swap in, copy)
    arrays, run in order before the forward), the forward's inputs (None: block operations only)
    and the rows prompt logprobs need (None: none)."""

    block_ops: list
    arrays: StepArrays | None
    prompt_rows: np.ndarray | None


def step_block_ops(step) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """A step's (swap out, swap in, copy) block operations; None when it has none."""
    ops = (step.blocks_to_swap_out, step.blocks_to_swap_in, step.blocks_to_copy)
    return ops if any(len(op) for op in ops) else None


def check_lora_supported(cfg: ModelConfig) -> None:
    """ValueError when `enable_lora` cannot serve this model (checked before any rank loads)."""
    if cfg.moe is not None:
        raise ValueError(
            f"enable_lora: {cfg.architecture} is a mixture of experts; LoRA "
            "adapters are not supported on its experts or its other projections yet"
        )


class _DiscardPromptRows:
    """Stand-in for `PromptRows` on ranks other than 0: the same logits slices run (the LM head is
    a collective) and are dropped (only rank 0 gets logits)."""

    def __init__(self, rows: np.ndarray) -> None:
        self.rows = rows

    def take(self, logits, start: int) -> None:
        pass


class Worker:
    """Rank `rank` of `args.tensor_parallel_size`: loads its shard (and, with `enable_lora`, its
    LoRA slots) when built; `init_cache` then allocates the KV cache rank 0 planned (every rank
    holds as many blocks) and the runner. The rank must be in the tensor-parallel group already
    (the executor puts it there): loading a shard runs no collective, a forward does."""

    def __init__(
        self, args: EngineArgs, rank: int, *, dtype: torch.dtype, device: torch.device
    ) -> None:
        self.args, self.dtype, self.device = args, dtype, device
        if device.type == "cpu":
            cpu_isa()  # a PAGEDLLM_CPU_ISA that is no level stops the start before the load
        self.tp = TPShard(rank, args.tensor_parallel_size, args.enable_expert_parallel)
        load = load_model
        if args.runner == "pooling":  # its decoder may carry a classification head instead
            load = partial(load_pooling_model, convert=args.convert)
        self.model = load(
            args.model,
            dtype=dtype,
            device=device,
            tp=self.tp,
            pack_for_cpu=True,
            quantization=args.quantization,
        )
        self.lora = self._lora_manager() if args.enable_lora else None
        self.cache_engine: CacheEngine | None = None
        self.runner: ModelRunner | None = None
        self.kv_layout = None  # the cache's layer groups (`init_cache`)

    def _lora_manager(self):
        check_lora_supported(self.model.config)
        from pagedllm.lora.manager import LoRAManager

        args = self.args
        return LoRAManager(
            self.model,
            max_loras=args.max_loras,
            max_lora_rank=args.max_lora_rank,
            max_cpu_loras=args.resolved_max_cpu_loras,
            dtype=self.dtype,
            device=self.device,
        )

    def init_cache(self, num_gpu_blocks: int, num_cpu_blocks: int) -> ModelRunner:
        """This rank's KV cache (its KV heads, the planned block counts, a block per layer
        group: `worker/kv_layout.py`) and its runner."""
        cfg, args = self.model.config, self.args
        # rank 0 checked max_model_len against the model (engine/kv_sizing.py) before any rank
        max_model_len = args.max_model_len or cfg.max_position_embeddings
        self.kv_layout = kv_layout(args, cfg, max_model_len)
        calibration = None
        quantized = kv_format(kv_storage_dtype(args.kv_cache_dtype, self.dtype)) != "auto"
        # a quantized cache's key transform, from a forward over a float cache of its own
        # before the quantized one takes the memory (`worker/kv_calibration.py`); every rank
        # runs it at once (`Executor.start_workers`): the forward's collectives need them all
        if quantized:
            calibration = kv_calibration.calibrate(
                self.model,
                dtype=self.dtype,
                device=self.device,
                block_size=args.block_size,
                max_model_len=max_model_len,
                tokens=kv_calibration.calibration_tokens(),
                vocab_size=cfg.vocab_size,
            )
            kv_calibration.set_transforms(self.model, calibration)
        self.cache_engine = CacheEngine(
            num_layers=self.kv_layout.layers_per_block,
            num_kv_heads=self.tp.kv_heads(cfg.num_kv_heads),
            head_dim=cfg.head_dim,
            block_size=args.block_size,
            num_gpu_blocks=num_gpu_blocks,
            num_cpu_blocks=num_cpu_blocks,
            dtype=self.dtype,
            device=self.device,
            kv_cache_dtype=args.kv_cache_dtype,
            kv_layout=self.kv_layout if self.kv_layout.is_hybrid else None,
            key_calibration=calibration,
        )
        self.runner = ModelRunner(
            self.model,
            self.cache_engine,
            self.device,
            self.lora,
            cpu_threads=args.cpu_threads,
            fused_cpu_forward=not args.enforce_eager,
            kv_layout=self.kv_layout,
        )
        return self.runner

    def capture_cuda_graphs(self, max_model_len: int) -> None:
        """CUDA: decode steps replay captured graphs from now on (not with LoRA or
        `enforce_eager`; nothing on the CPU)."""
        from pagedllm.worker.cuda_graphs import DecodeCudaGraphs, decode_graphs_enabled

        args = self.args
        if self.kv_layout.is_hybrid:  # the graphs are captured over one block table per step
            return
        if not decode_graphs_enabled(
            self.device, enforce_eager=args.enforce_eager, lora=self.lora is not None
        ):
            return
        self.runner.cuda_graphs = DecodeCudaGraphs(
            self.model,
            self.cache_engine.kv_cache,
            max_num_seqs=args.max_num_seqs,
            max_model_len=max_model_len,
            block_size=args.block_size,
        ).capture()

    def execute(self, message: StepMessage) -> None:
        """Rank 0's step on this rank: its block operations, then its forward (if any); the
        logits are rank 0's only."""
        for ops in message.block_ops:
            self.cache_engine.execute(*ops)
        arrays = message.arrays
        if arrays is None:
            return
        if arrays.lora_loads:
            self.lora.place(arrays.lora_loads)
        rows = message.prompt_rows
        prompt = _DiscardPromptRows(rows) if rows is not None else None
        self.runner.forward(self.runner.prepare(arrays), prompt)
