"""Which KV layer groups an engine's cache has: the model's sliding windows form their own
groups (`attention/kv_groups.py`: a window group keeps only the blocks its window reads), unless
a part of the engine needs one block table per sequence over the whole context. Rank 0's engine
(the scheduler's groups, the cache's size) and every rank's worker (the cache's shape, each
layer's tables) ask it the same question."""

from __future__ import annotations

from pagedllm.attention.kv_groups import KVGroupLayout, kv_group_layout
from pagedllm.config import EngineArgs
from pagedllm.models import ModelConfig


def kv_layout(args: EngineArgs, cfg: ModelConfig, max_model_len: int) -> KVGroupLayout:
    """The cache's layer groups for this model under these arguments (one group of every layer
    where `EngineArgs.hybrid_kv_off_reason` says why)."""
    windows = () if args.hybrid_kv_off_reason else cfg.layer_windows
    return kv_group_layout(windows, cfg.num_layers, max_model_len)
