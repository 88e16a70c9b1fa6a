"""Which KV layer groups an engine's cache has: the model's sliding windows form their own
groups (`attention/kv_groups.py`: a window group keeps only the blocks its window reads), unless
a part of the engine needs one block table per sequence over the whole context. Rank 0's engine
(the scheduler's groups, the cache's size) and every rank's worker (the cache's shape, each
layer's tables) ask it the same question."""

from __future__ import annotations

from pagedllm.attention.kv_groups import KVGroupLayout, kv_group_layout
from pagedllm.config import EngineArgs
from pagedllm.models import ModelConfig
from pagedllm.spec_decode.config import SpeculativeConfig


def hybrid_kv_off_reason(args: EngineArgs) -> str | None:
    """Why the cache keeps every layer's blocks for the whole context even for a model with
    sliding windows (None: it need not). The offload tier and KV connectors move one block
    table per sequence, and a draft model reads the target's table over the whole context."""
    if args.resolved_kv_offloading_backend is not None:
        return "the KV offload tier (kv_offloading_size) moves one block table per sequence"
    spec = SpeculativeConfig.from_dict(args.speculative_config)
    if spec is not None and spec.method == "draft_model":
        return "a draft model (speculative_config) reads the target's table over the whole context"
    return None


def kv_layout(args: EngineArgs, cfg: ModelConfig, max_model_len: int) -> KVGroupLayout:
    """The cache's layer groups for this model under these arguments."""
    windows = () if hybrid_kv_off_reason(args) else cfg.layer_windows
    return kv_group_layout(windows, cfg.num_layers, max_model_len)
