"""Decoder models (Llama, Qwen2, Qwen3) over the paged KV cache, and their checkpoint loader.

Engine entry points: `load_model_config(name)` (cheap, validates config.json), `load_model(name,
dtype=..., device=...)` (the module; its ModelConfig is `.config`). `name` is a checkpoint folder
or the built-in `pagedllm/tiny-random`.
"""

from pagedllm.checkpoint.errors import CheckpointError, CheckpointNotFoundError
from pagedllm.models.config import SUPPORTED_ARCHITECTURES, ModelConfig, RopeConfig
from pagedllm.models.decoder import DecoderForCausalLM
from pagedllm.models.loader import load_model, load_model_config, resolve_device, resolve_dtype
from pagedllm.models.tiny_random import MODEL_NAME as TINY_RANDOM_MODEL
from pagedllm.models.tiny_random import build_tiny_random, tiny_random_config

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "TINY_RANDOM_MODEL",
    "CheckpointError",
    "CheckpointNotFoundError",
    "DecoderForCausalLM",
    "ModelConfig",
    "RopeConfig",
    "build_tiny_random",
    "load_model",
    "load_model_config",
    "resolve_device",
    "resolve_dtype",
    "tiny_random_config",
]
