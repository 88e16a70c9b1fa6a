"""A causal LM run as a reranker by two of its tokens (Qwen3-Reranker's recipe), as vLLM does it
under `hf_overrides` (`{"architectures": ["Qwen3ForSequenceClassification"],
"classifier_from_token": ["no", "yes"], "is_original_qwen3_reranker": true}`).

The checkpoint is a plain `*ForCausalLM` that answers a templated (query, document) prompt with
"yes" or "no"; its relevance is the sigmoid of the log-odds of the two tokens at the last
position, sigmoid(logit[yes] - logit[no]). As vLLM's `from_2_way_softmax` loader does, the
difference of the two rows of `lm_head` becomes a one-label classification head, so the pooling
engine reads only the last row's hidden state (the prefix cache is shared) and computes no
logits over the vocabulary. The keys and their types are checked with the engine's arguments
(`EngineArgs._validate_hf_overrides`); what needs the checkpoint is checked here.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from pagedllm.models.config import ModelConfig
from pagedllm.models.loader import index_checkpoint
from pagedllm.models.sequence_classification import is_sequence_classification

_CAUSAL = "ForCausalLM"
_CLASSIFICATION = "ForSequenceClassification"


@dataclass(frozen=True)
class TokenClassifier:
    """The two tokens of `classifier_from_token`: the score is sigmoid(logit[true_token] -
    logit[false_token]) at the last position."""

    false_token: str
    true_token: str


def token_classifier(cfg: ModelConfig, overrides: dict | None) -> TokenClassifier | None:
    """The reranker `overrides` (already checked by `EngineArgs`) make of checkpoint `cfg`, or
    None without them. ValueError naming the field when the checkpoint cannot take them."""
    if not overrides:
        return None
    (architecture,) = overrides["architectures"]
    if is_sequence_classification(cfg) or not cfg.architecture.endswith(_CAUSAL):
        raise ValueError(
            f"hf_overrides.architectures: {cfg.path} is a {cfg.architecture}, not a causal LM; "
            "classifier_from_token builds a reranker from a *ForCausalLM's lm_head (a "
            "*ForSequenceClassification checkpoint scores with its own head, no overrides)"
        )
    family = cfg.architecture.removesuffix(_CAUSAL)
    if architecture != family + _CLASSIFICATION:
        raise ValueError(
            f"hf_overrides.architectures: {architecture!r} does not match the checkpoint's "
            f"{cfg.architecture} (expected {family + _CLASSIFICATION!r})"
        )
    if cfg.path is None or not Path(cfg.path).is_dir():
        raise ValueError(
            f"hf_overrides: {cfg.path or 'the built-in model'} is not a safetensors checkpoint "
            "folder, whose lm_head rows the reranker's head is built from"
        )
    false_token, true_token = overrides["classifier_from_token"]
    return TokenClassifier(false_token, true_token)


def token_ids(tokenizer, classifier: TokenClassifier) -> tuple[int, int]:
    """The vocabulary ids of (false, true) token; each must be one entry of the vocabulary, as
    vLLM's `convert_tokens_to_ids` reads it (e.g. "yes", or "Ġyes" for " yes")."""
    backend = getattr(tokenizer, "backend", None)
    if backend is None or not hasattr(backend, "get_vocab"):
        raise ValueError(
            "hf_overrides.classifier_from_token needs the checkpoint's tokenizer (its vocabulary)"
        )
    vocab = backend.get_vocab()
    ids = []
    for token in (classifier.false_token, classifier.true_token):
        if token not in vocab:
            raise ValueError(
                f"hf_overrides.classifier_from_token: {token!r} is not a single token of the "
                "vocabulary (give vocabulary entries, e.g. 'yes'; a leading space is 'Ġ')"
            )
        ids.append(int(vocab[token]))
    return ids[0], ids[1]


def token_classifier_head(
    cfg: ModelConfig, model: torch.nn.Module, ids: tuple[int, int]
) -> torch.nn.Linear:
    """The one-label head lm_head[true] - lm_head[false] (float32 difference, then the model's
    dtype), read from the checkpoint's files: the loaded lm_head may be packed for the CPU
    kernels."""
    tensors = index_checkpoint(Path(cfg.path))
    name = "lm_head.weight"
    if name not in tensors or cfg.tie_word_embeddings:
        name = "model.embed_tokens.weight"
    info = tensors[name]
    false_id, true_id = ids
    if max(ids) >= info.shape[0]:
        raise ValueError(
            f"hf_overrides.classifier_from_token: token id {max(ids)} is past the {info.shape[0]} "
            f"rows of {name}"
        )
    with safe_open(info.file, framework="pt") as handle:
        rows = handle.get_slice(name)
        true_row = rows[true_id : true_id + 1].float()
        false_row = rows[false_id : false_id + 1].float()
    embedding = model.model.embed_tokens.weight
    head = torch.nn.Linear(cfg.hidden_size, 1, bias=False)
    head.weight = torch.nn.Parameter(
        (true_row - false_row).to(device=embedding.device, dtype=embedding.dtype),
        requires_grad=False,
    )
    return head.eval()
