"""The pooler's math: hidden states of a prompt -> its embedding or its class scores.

A prompt's prefill may come in chunks (chunked prefill, a token budget per step): mean and CLS
pooling accumulate per chunk, keyed by the chunk's first position, so that a chunk computed
again (a rolled-back step, a preempted request recomputed from position 0) replaces its earlier
sum instead of adding to it. Last-token pooling needs only the final chunk's last row.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from pagedllm.pooling.config import PoolerConfig


class ChunkSums:
    """Per request, the float32 (sum of rows, row count) of each chunk seen so far (MEAN) or the
    row of position 0 (CLS)."""

    def __init__(self, pooling_type: str) -> None:
        self.pooling_type = pooling_type
        self._parts: dict[str, dict[int, tuple[Tensor, int]]] = {}

    def add(self, request_id: str, first_position: int, rows: Tensor) -> None:
        if first_position == 0:  # a new prompt, or one recomputed from the start
            self._parts[request_id] = {}
        parts = self._parts.setdefault(request_id, {})
        if self.pooling_type == "MEAN":
            parts[first_position] = (rows.float().sum(0), rows.shape[0])
        elif first_position == 0:  # CLS
            parts[0] = (rows[0].float(), 1)

    def pop(self, request_id: str) -> Tensor:
        """The pooled state of a prompt whose last chunk was added."""
        parts = self._parts.pop(request_id)
        total = sum(s for s, _ in parts.values())
        return total / sum(n for _, n in parts.values())

    def forget(self, request_id: str) -> None:
        self._parts.pop(request_id, None)


def finish_embedding(config: PoolerConfig, pooled: Tensor, dimensions: int | None) -> Tensor:
    """The embedding of a pooled state (float32, on the CPU): cut to `dimensions` (Matryoshka),
    then normalized when the model normalizes."""
    vector = pooled.float()
    if dimensions is not None:
        vector = vector[..., :dimensions]
    if config.normalize:
        vector = F.normalize(vector, p=2, dim=-1)
    return vector.cpu()


def class_scores(logits: Tensor) -> Tensor:
    """A classification head's logits -> scores (vLLM's): the sigmoid of a single logit, else
    the softmax over the classes. float32."""
    logits = logits.float()
    if logits.shape[-1] == 1:
        return torch.sigmoid(logits)
    return torch.softmax(logits, dim=-1)
