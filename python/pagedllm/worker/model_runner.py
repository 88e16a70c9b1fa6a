"""Turns one scheduler step into tensors, runs the model over the paged cache, returns logits.

Everything per token arrives from Rust as numpy arrays; this module only moves them to the
device (no per-token Python).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import numpy as np
import torch

from pagedllm import _core
from pagedllm.attention.kv_groups import KVGroupLayout
from pagedllm.attention.paged import AttentionMetadata, LayerGroups
from pagedllm.models import cpu_forward
from pagedllm.sampling.verification import has_drafts, verification_logits_rows
from pagedllm.worker import weight_pages
from pagedllm.worker.cache_engine import CacheEngine
from pagedllm.worker.cpu_threads import configure_cpu_threads

if TYPE_CHECKING:
    from pagedllm.lora.manager import LoRAManager
    from pagedllm.sampling.prompt_logprobs import PromptRows
    from pagedllm.worker.cuda_graphs import DecodeCudaGraphs

# prompt logprobs: logits rows computed at once (bounds the [rows, V] float32 buffers)
PROMPT_LOGITS_SLICE = 256


def _to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    tensor = torch.from_numpy(np.ascontiguousarray(array))
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        cache_engine: CacheEngine,
        device: torch.device,
        lora: LoRAManager | None = None,
        *,
        cpu_threads: int | None = None,
        fused_cpu_forward: bool = True,
        kv_layout: KVGroupLayout | None = None,
    ) -> None:
        self.model = model
        # hybrid KV groups: each layer reads its group's block tables (None: one group)
        self.kv_layout = kv_layout if kv_layout is not None and kv_layout.is_hybrid else None
        self.cache_engine = cache_engine
        self.device = device
        # multi-LoRA: puts the step's adapters in device slots, builds its token segments
        self.lora = lora
        # decode-only steps replay these when set (the engine captures them on CUDA)
        self.cuda_graphs: DecodeCudaGraphs | None = None
        # CPU: torch's intra-op threads (worker/cpu_threads.py), the cores shared by the
        # model's tensor-parallel ranks; None on CUDA
        self.cpu_threads = None
        # CPU: the Rust kernels' instruction-set level and the machine's flags
        # (`_core.cpu_isa`); asked here so that a bad PAGEDLLM_CPU_ISA stops the engine's start
        self.cpu_isa: tuple[str, list[str]] | None = None
        if device.type == "cpu":
            ranks = getattr(getattr(model, "tp", None), "size", 1)
            self.cpu_threads = configure_cpu_threads(cpu_threads, ranks)
            self.cpu_isa = _core.cpu_isa()
        # CPU: the layers in one Rust call a step where the model qualifies (bit-identical to
        # the layer-by-layer forward, without its per-kernel Python; models/cpu_forward.py)
        self.cpu_forward = None
        if device.type == "cpu" and isinstance(model, torch.nn.Module):
            # the weights each decode step streams, on huge pages (worker/weight_pages.py)
            weight_pages.move_weights(model)
        if fused_cpu_forward and device.type == "cpu" and cache_engine is not None:
            self.cpu_forward = cpu_forward.build(
                model, cache_engine.kv_cache, lora=lora is not None
            )

    def prepare(self, step) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """Input ids, positions, attention metadata and the hidden-state rows to sample from."""
        device = self.device
        query_start_loc = step.query_start_loc
        num_tokens = step.num_tokens
        seq_lens = step.seq_lens
        meta = AttentionMetadata(
            slot_mapping=_to_device(step.slot_mapping, device),
            query_start_loc=_to_device(query_start_loc, device),
            seq_lens=_to_device(seq_lens, device),
            block_tables=_to_device(step.block_tables, device),
            max_query_len=int(num_tokens.max()),
            max_seq_len=int(seq_lens.max()),
            is_decode_only=bool(step.is_decode_only),
        )
        if self.kv_layout is not None:
            meta.layer_groups = self._layer_groups(step, meta)
        if self.lora is not None:
            self.lora.prepare_step(step.lora_ids, num_tokens)
        # The logits of a sequence come from the hidden state of its last token this step.
        last_token_rows = query_start_loc[1:].astype(np.int64) - 1
        sample_rows = last_token_rows[step.sample_rows]
        if has_drafts(step):
            # speculative decoding: a sample with drafts is scored at each of them too
            num_drafts = step.spec_num_draft_tokens[step.sample_rows]
            sample_rows = verification_logits_rows(sample_rows, num_drafts)
        return (
            _to_device(step.input_ids, device),
            _to_device(step.positions, device),
            meta,
            _to_device(sample_rows, device),
        )

    def _layer_groups(self, step, meta: AttentionMetadata) -> LayerGroups:
        """Each KV group's metadata: the step's, with the group's KV slots and block tables
        (a window group's released blocks are -1: no kernel reads them)."""
        device, layout = self.device, self.kv_layout
        tables, slots = step.kv_group_tables, step.kv_group_slots
        metas = tuple(
            dataclasses.replace(
                meta,
                slot_mapping=_to_device(slots[g], device),
                block_tables=_to_device(tables[g], device),
            )
            for g in range(len(layout.windows))
        )
        return LayerGroups(layout.layer_slot, layout.layer_group, metas)

    def execute_block_ops(self, step) -> None:
        """The step's swaps and copy-on-write copies, before its forward."""
        self.cache_engine.execute(
            step.blocks_to_swap_out, step.blocks_to_swap_in, step.blocks_to_copy
        )

    def prepare_step(self, step):
        """Run the step's block operations and build its inputs (None: nothing to compute)."""
        self.execute_block_ops(step)
        if step.num_seqs == 0:
            return None
        return self.prepare(step)

    @torch.inference_mode()
    def forward_hidden(self, inputs) -> torch.Tensor:
        """The final (normed) hidden states `[T, E]` of every row of the step: what the pooling
        runner pools (its requests end after their prefill; no logits are computed)."""
        input_ids, positions, meta, _ = inputs
        return self.model(input_ids, positions, self.cache_engine.kv_cache, meta)

    @torch.inference_mode()
    def forward(self, inputs, prompt: PromptRows | None = None) -> torch.Tensor | None:
        """Run the model; float32 logits [K, V] of the rows to sample (None when K = 0); with
        draft tokens, [sum(d + 1), V]: each sample's rows from its first scored position on.
        `prompt`: rows whose logits prompt logprobs need, handed to `prompt.take` in slices."""
        input_ids, positions, meta, sample_rows = inputs
        graphs = self.cuda_graphs
        if graphs is not None and graphs.can_run(input_ids, meta):
            hidden = graphs.run(input_ids, positions, meta)
        elif self.cpu_forward is not None:
            if prompt is None and self.cpu_forward.head_rows is not None:
                # embedding, layers and LM head in one call (models/cpu_forward.py)
                kv_cache = self.cache_engine.kv_cache
                return self.cpu_forward.logits(input_ids, positions, kv_cache, meta, sample_rows)
            hidden = self.cpu_forward(input_ids, positions, self.cache_engine.kv_cache, meta)
        else:
            hidden = self.model(input_ids, positions, self.cache_engine.kv_cache, meta)
        if prompt is not None:
            rows = _to_device(prompt.rows, self.device)
            for start in range(0, len(rows), PROMPT_LOGITS_SLICE):
                picked = hidden.index_select(0, rows[start : start + PROMPT_LOGITS_SLICE])
                prompt.take(self.model.compute_logits(picked), start)
        if sample_rows.numel() == 0:
            return None
        return self.model.compute_logits(hidden.index_select(0, sample_rows))
