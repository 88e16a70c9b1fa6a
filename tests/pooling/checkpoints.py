"""Tiny random pooling checkpoints and their `transformers` references, shared by the pooling
tests and the pooling server's tests (import as `pooling.checkpoints`).

- `save_embedding_checkpoint(folder, pooling=..., normalize=..., matryoshka=...)`: a Qwen3 causal
  LM; with `pooling` ("mean", "cls", "lasttoken") the sentence-transformers module files
  (`modules.json`, `1_Pooling/config.json`, a `Normalize` module) beside it.
- `save_reranker_checkpoint(folder, family)`: a `*ForSequenceClassification` with one label.
- `reference_embedding` / `reference_score`: what transformers' forward and the pooling
  config's math give.
- `token_reranker_overrides(false, true)`: vLLM's hf_overrides making a causal Qwen3 a
  Qwen3-Reranker (the tiny vocabulary has no "yes"/"no": two of its tokens stand in);
  `reference_token_score`: sigmoid(logits[-1, true] - logits[-1, false]) of transformers'
  causal LM.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoModel, AutoModelForCausalLM, AutoModelForSequenceClassification

from model_factory import (
    randomize_weights,
    save_tiny_checkpoint,
    save_tiny_tokenizer,
    tiny_hf_config,
)

ST = "sentence_transformers.models."


def save_embedding_checkpoint(
    folder: str | Path,
    *,
    pooling: str | None = None,
    normalize: bool = True,
    matryoshka: bool = False,
    seed: int = 0,
) -> Path:
    folder = save_tiny_checkpoint(folder, "qwen3", seed=seed)
    if pooling is not None:
        modules = [
            {"idx": 0, "name": "0", "path": "", "type": ST + "Transformer"},
            {"idx": 1, "name": "1", "path": "1_Pooling", "type": ST + "Pooling"},
        ]
        if normalize:
            modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": ST + "Normalize"})
        (folder / "modules.json").write_text(json.dumps(modules))
        (folder / "1_Pooling").mkdir()
        config = {
            "word_embedding_dimension": 64,
            "pooling_mode_cls_token": pooling == "cls",
            "pooling_mode_mean_tokens": pooling == "mean",
            "pooling_mode_max_tokens": False,
            "pooling_mode_mean_sqrt_len_tokens": False,
            "pooling_mode_weightedmean_tokens": False,
            "pooling_mode_lasttoken": pooling == "lasttoken",
        }
        (folder / "1_Pooling" / "config.json").write_text(json.dumps(config))
    if matryoshka:
        path = folder / "config.json"
        raw = json.loads(path.read_text())
        raw["is_matryoshka"] = True
        path.write_text(json.dumps(raw))
    return folder


def save_reranker_checkpoint(folder: str | Path, family: str = "qwen3", seed: int = 0) -> Path:
    folder = Path(folder)
    config = tiny_hf_config(family, num_labels=1)
    config.architectures = [
        f"{type(config).__name__.removesuffix('Config')}ForSequenceClassification"
    ]
    model = AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
    randomize_weights(model, seed)
    model.eval().save_pretrained(folder, safe_serialization=True)
    save_tiny_tokenizer(folder)
    return folder


@torch.no_grad()
def reference_embedding(folder: Path, ids: list[int], pooling: str = "lasttoken", normalize=True):
    """transformers' final hidden states pooled as sentence-transformers would."""
    model = AutoModel.from_pretrained(folder, dtype=torch.float32).eval()
    hidden = model(torch.tensor([ids])).last_hidden_state[0]
    pooled = {"lasttoken": hidden[-1], "mean": hidden.mean(0), "cls": hidden[0]}[pooling]
    return F.normalize(pooled, dim=-1) if normalize else pooled


@torch.no_grad()
def reference_score(folder: Path, ids: list[int]) -> float:
    """The sigmoid of transformers' single classification logit for the unpadded prompt."""
    model = AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float32)
    logits = model.eval()(torch.tensor([ids])).logits
    return float(torch.sigmoid(logits[0, 0]))


def token_reranker_overrides(false_token: str = "lo", true_token: str = "he") -> dict:
    return {
        "architectures": ["Qwen3ForSequenceClassification"],
        "classifier_from_token": [false_token, true_token],
        "is_original_qwen3_reranker": True,
    }


@torch.no_grad()
def reference_token_score(folder: Path, ids: list[int], false_id: int, true_id: int) -> float:
    """Qwen3-Reranker's score by transformers' causal LM: the sigmoid of the true token's
    log-odds against the false one at the last position."""
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    logits = model(torch.tensor([ids])).logits[0, -1]
    return float(torch.sigmoid(logits[true_id] - logits[false_id]))


def cosine(a, b) -> float:
    return float(F.cosine_similarity(torch.as_tensor(a).float(), torch.as_tensor(b).float(), dim=0))
