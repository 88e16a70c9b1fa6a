"""The decoder of the pooling runner: a causal LM's layers whose final hidden states are pooled
(embeddings), or a `*ForSequenceClassification` checkpoint's with its classification head
(`score.weight`, `[num_labels, hidden_size]`, no bias, as transformers saves it).

The head is applied to the last token's final (normed) hidden state, as transformers'
`*ForSequenceClassification` does for an unpadded prompt; the engine's pooler (pagedllm.pooling)
picks the rows. The decoder itself is the generating one (`DecoderForCausalLM`): a
classification checkpoint has no `lm_head.weight`, so it is loaded as if its head were tied to
the embedding (never used: the pooling runner computes no logits).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from safetensors import safe_open

from pagedllm.checkpoint.errors import CheckpointError
from pagedllm.distributed.layers import TPShard
from pagedllm.kernels import cpu_linear
from pagedllm.models.config import SEQUENCE_CLASSIFICATION_ARCHITECTURES, ModelConfig
from pagedllm.models.decoder import DecoderForCausalLM
from pagedllm.models.fused_linear import SINGLE
from pagedllm.models.loader import (
    _materialize,
    check_checkpoint,
    index_checkpoint,
    load_model,
    load_model_config,
    resolve_device,
    resolve_dtype,
)

SCORE_WEIGHT = "score.weight"


def is_sequence_classification(cfg: ModelConfig) -> bool:
    return cfg.architecture in SEQUENCE_CLASSIFICATION_ARCHITECTURES


def pooling_task(cfg: ModelConfig, convert: str) -> str:
    """ "classify" (the checkpoint's classification head scores the prompt) or "embed" (the
    pooled hidden state is the result): `convert` when given, else the architecture's."""
    if convert != "auto":
        return convert
    return "classify" if is_sequence_classification(cfg) else "embed"


def check_generating(cfg: ModelConfig) -> None:
    """ValueError for a classification checkpoint run to generate: it has no LM head."""
    if is_sequence_classification(cfg):
        raise ValueError(
            f"{cfg.path}: {cfg.architecture} is a classification model, it generates no text; "
            "run it with runner='pooling' (pagedllm serve --runner pooling)"
        )


def load_pooling_model(
    model: str | Path,
    *,
    convert: str = "auto",
    dtype: str | torch.dtype = "auto",
    device: str | torch.device | None = "auto",
    tp: TPShard = SINGLE,
    pack_for_cpu: bool = False,
    quantization: str | None = None,
) -> DecoderForCausalLM:
    """The decoder for pooling; with task "classify" (`pooling_task`) its `score` head is a
    `torch.nn.Linear` (`score` is None for "embed"). A classify task on a checkpoint without
    `score.weight` is a CheckpointError naming it."""
    cfg = load_model_config(model)
    task = pooling_task(cfg, convert)
    if not is_sequence_classification(cfg) or cfg.path is None:
        built = load_model(
            model,
            dtype=dtype,
            device=device,
            tp=tp,
            pack_for_cpu=pack_for_cpu,
            quantization=quantization,
        )
    else:
        built = _load_headless(cfg, dtype, device, tp, pack_for_cpu, quantization)
    built.score = _score_head(built, cfg) if task == "classify" else None
    return built


def _load_headless(cfg, dtype, device, tp, pack_for_cpu, quantization) -> DecoderForCausalLM:
    if quantization is not None or tp.size > 1:
        raise ValueError(
            f"{cfg.architecture}: quantization and tensor parallelism are for causal LMs only"
        )
    target = resolve_device(device)
    tensors = index_checkpoint(Path(cfg.path))
    headless = dataclasses.replace(cfg, tie_word_embeddings=True)  # no lm_head.weight to read
    check_checkpoint(headless, tensors)
    built = _materialize(headless, tensors, target, resolve_dtype(dtype, cfg, target), tp)
    if pack_for_cpu:
        cpu_linear.pack_linears(built)
    return built


def _score_head(model: DecoderForCausalLM, cfg: ModelConfig) -> torch.nn.Linear:
    """`score.weight` of the checkpoint as a bias-free linear layer in the model's dtype."""
    if cfg.path is None:
        raise CheckpointError(f"{cfg.architecture}: a built-in model has no '{SCORE_WEIGHT}'")
    tensors = index_checkpoint(Path(cfg.path))
    info = tensors.get(SCORE_WEIGHT)
    if info is None:
        raise CheckpointError(
            f"{cfg.path}: task 'classify' needs the classification head '{SCORE_WEIGHT}', "
            "which the safetensors files lack"
        )
    if len(info.shape) != 2 or info.shape[1] != cfg.hidden_size:
        raise CheckpointError(
            f"{info.file}: tensor '{SCORE_WEIGHT}' has shape {list(info.shape)}, expected "
            f"[num_labels, {cfg.hidden_size}]"
        )
    embedding = model.model.embed_tokens.weight
    with safe_open(info.file, framework="pt") as handle:
        weight = handle.get_tensor(SCORE_WEIGHT)
    head = torch.nn.Linear(info.shape[1], info.shape[0], bias=False)
    head.weight = torch.nn.Parameter(
        weight.to(device=embedding.device, dtype=embedding.dtype), requires_grad=False
    )
    return head.eval()
