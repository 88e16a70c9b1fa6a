"""Sharded layers for tensor parallelism (nano-vllm's set, with vLLM's KV-head replication).

Rank r of `size` holds: column-parallel layers' output columns r (q/k/v heads, gate/up rows) —
outputs stay sharded; row-parallel layers' input columns r, summed over the ranks (all-reduce);
rows r of the vocabulary (padded to a multiple of 64) for the embedding and the LM head, whose
logits are gathered to rank 0 only. When there are fewer KV heads than ranks, each KV head is
replicated on `size // num_kv_heads` consecutive ranks.

The shapes and slices (`TPShard`) are the one rule the loader reads each rank's weights by.
With one rank the layers are the plain ones: no collective, no vocabulary padding (as
nano-vllm's), so the decoder builds the same layers whatever the rank count.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pagedllm.distributed import parallel_state
from pagedllm.kernels import cpu_linear

if TYPE_CHECKING:
    from pagedllm.kernels.cpu_quant import QuantWeight

VOCAB_PADDING = 64


def check_tensor_parallel(num_heads: int, num_kv_heads: int, tp: int) -> None:
    """The head counts a model must have to be sharded over `tp` ranks (ValueError otherwise)."""
    if num_heads % tp:
        raise ValueError(
            f"tensor_parallel_size={tp} must divide the model's num_attention_heads={num_heads}"
        )
    if num_kv_heads % tp and tp % num_kv_heads:
        raise ValueError(
            f"tensor_parallel_size={tp} must divide the model's num_key_value_heads="
            f"{num_kv_heads} or be a multiple of it"
        )


@dataclass(frozen=True)
class TPShard:
    """One rank's place in the group, and the slices of the model it holds."""

    rank: int
    size: int
    # mixture of experts (`enable_expert_parallel`): each rank holds 1/size of the experts whole
    # instead of a 1/size slice of every expert (`models.moe`)
    expert_parallel: bool = False

    def all_reduce(self, partial: Tensor) -> Tensor:
        """The sum of the ranks' `partial` terms (itself with one rank: no collective)."""
        return partial if self.size == 1 else parallel_state.all_reduce(partial)

    def split(self, total: int) -> slice:
        """This rank's equal part of `total` (which `size` divides)."""
        part = total // self.size
        return slice(self.rank * part, (self.rank + 1) * part)

    def kv_heads(self, num_kv_heads: int) -> int:
        """KV heads this rank holds (1 when they are replicated)."""
        return max(1, num_kv_heads // self.size)

    def kv_head_slice(self, num_kv_heads: int) -> slice:
        """The KV heads of this rank: with replication, rank r holds head r // replicas."""
        local = self.kv_heads(num_kv_heads)
        replicas = max(1, self.size // num_kv_heads)
        first = (self.rank // replicas) * local
        return slice(first, first + local)

    def padded_vocab(self, vocab_size: int) -> int:
        if self.size == 1:
            return vocab_size  # one rank holds every row: nothing to split evenly
        multiple = math.lcm(VOCAB_PADDING, self.size)
        return -(-vocab_size // multiple) * multiple

    def vocab_slice(self, vocab_size: int) -> slice:
        """This rank's vocabulary rows (of the padded vocabulary: may reach past `vocab_size`)."""
        return self.split(self.padded_vocab(vocab_size))


def tp_kv_heads(num_kv_heads: int, tp: int) -> int:
    """KV heads per rank's cache (every rank holds the same count)."""
    return TPShard(0, tp).kv_heads(num_kv_heads)


class PackableWeight:
    """A layer whose `weight` the engine may pack once for the CPU's matmul kernel
    (`kernels.cpu_linear.pack_linears`, which may then drop the unpacked copy); `packed` is None
    until then. Its state dict still holds the weight, unpacked.

    Or a layer whose weight is quantized (GGUF types, `quantization="q8_0"`): `quant` is then the
    `kernels.cpu_quant.QuantWeight` its products run through, and `weight` is empty."""

    packed: cpu_linear.PackedWeight | None = None
    quant: QuantWeight | None = None

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)  # type: ignore[misc]
        if self.packed is not None and self.weight.numel() == 0:  # type: ignore[attr-defined]
            destination[prefix + "weight"] = cpu_linear.unpack(self.packed)
        if self.quant is not None:
            from pagedllm.kernels import cpu_quant

            destination[prefix + "weight"] = cpu_quant.dequantize(self.quant)


class Linear(PackableWeight, nn.Linear):
    """`nn.Linear` whose weight may be packed for the CPU (`PackableWeight`)."""

    def forward(self, x: Tensor) -> Tensor:
        return self.matmul(x, self.bias)

    def matmul(self, x: Tensor, bias: Tensor | None) -> Tensor:
        if self.quant is not None:
            return _quant_linear(x, self.quant, bias)
        return cpu_linear.linear(x, self.weight, bias, self.packed)


def _quant_linear(x: Tensor, quant: QuantWeight, bias: Tensor | None) -> Tensor:
    # imported here: only quantized models need the quantized kernels
    from pagedllm.kernels import cpu_quant

    return cpu_quant.quant_linear(x, quant, bias, activations=cpu_quant.ACTIVATIONS)


def _quant_embedding(ids: Tensor, quant: QuantWeight) -> Tensor:
    from pagedllm.kernels import cpu_quant

    return cpu_quant.embedding(ids, quant)


class QuantEmbedding(nn.Module):
    """An embedding table kept quantized: the rows of the step's tokens are dequantized
    (`cpu_quant.embedding`). `weight` is empty (it tells callers the device and dtype)."""

    def __init__(self, quant: QuantWeight) -> None:
        super().__init__()
        self.quant = quant
        self.num_embeddings, self.embedding_dim = quant.out_features, quant.in_features
        self.weight = nn.Parameter(torch.empty(0), requires_grad=False)

    def forward(self, ids: Tensor) -> Tensor:
        return _quant_embedding(ids, self.quant)

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        from pagedllm.kernels import cpu_quant

        destination[prefix + "weight"] = cpu_quant.dequantize(self.quant)


class ColumnParallelLinear(Linear):
    """Named projections side by side (gate/up, q/k/v) whose output columns are split over the
    ranks: each projection keeps its name, with this rank's share of its size (`sizes` are the
    whole model's). Outputs stay sharded. With one rank this is `models.FusedLinear`."""

    def __init__(self, in_features: int, sizes: dict[str, int], tp: TPShard, *, bias: bool) -> None:
        local = {name: size // tp.size for name, size in sizes.items()}
        super().__init__(in_features, sum(local.values()), bias=bias)
        self.output_names = tuple(local)
        self.output_sizes = tuple(local.values())
        self.output_slices: dict[str, slice] = {}
        start = 0
        for name, size in local.items():
            self.output_slices[name] = slice(start, start + size)
            start += size

    def split(self, out: Tensor) -> tuple[Tensor, ...]:
        """The projections' views of a fused output `[..., out_features]`, in order."""
        return out.split(self.output_sizes, dim=-1)

    def part(self, out: Tensor, name: str) -> Tensor:
        """One projection's view of a fused output `[..., out_features]`."""
        return out[..., self.output_slices[name]]


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q/k/v with this rank's q heads and its KV heads (replicated when the ranks outnumber
    the KV heads: each rank then holds one)."""

    def __init__(
        self,
        hidden: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        tp: TPShard,
        *,
        bias: bool,
    ) -> None:
        # sizes are whole-model: a replicated KV head counts as `size` heads' worth
        kv = tp.kv_heads(num_kv_heads) * head_dim * tp.size
        super().__init__(hidden, {"q": num_heads * head_dim, "k": kv, "v": kv}, tp, bias=bias)


class RowParallelLinear(Linear):
    """`in_features` split over the ranks; the partial products are summed (all-reduce). The bias
    is added once, by rank 0."""

    def __init__(self, in_features: int, out_features: int, tp: TPShard, *, bias: bool) -> None:
        super().__init__(in_features // tp.size, out_features, bias=bias)
        self.tp = tp

    def forward(self, x: Tensor) -> Tensor:
        return self.reduce(self.partial(x))

    def reduce(self, partial: Tensor) -> Tensor:
        """The sum of the ranks' `partial` terms (itself with one rank: no collective)."""
        return self.tp.all_reduce(partial)

    def partial(self, x: Tensor) -> Tensor:
        """This rank's term of the sum (LoRA adds its own partial delta before the reduce)."""
        return self.matmul(x, self.bias if self.tp.rank == 0 else None)


class VocabParallelEmbedding(nn.Module):
    """This rank's rows of the padded vocabulary; a token outside them embeds to zeros, and the
    sum over the ranks is the full embedding (exactly: one rank adds its row to zeros)."""

    def __init__(self, vocab_size: int, hidden: int, tp: TPShard) -> None:
        super().__init__()
        rows = tp.vocab_slice(vocab_size)
        self.start, self.stop = rows.start, rows.stop
        self.size = tp.size
        self.weight = nn.Parameter(torch.empty(rows.stop - rows.start, hidden))
        self.quant: QuantWeight | None = None  # a quantized table (its `weight` is then empty)

    def forward(self, ids: Tensor) -> Tensor:
        if self.size == 1:  # every row is this rank's
            if self.quant is not None:
                return _quant_embedding(ids, self.quant)
            return F.embedding(ids, self.weight)
        mine = (ids >= self.start) & (ids < self.stop)
        local = (ids - self.start) * mine
        if self.quant is not None:
            out = _quant_embedding(local, self.quant)
        else:
            out = F.embedding(local, self.weight)
        out.mul_(mine.unsqueeze(-1).to(out.dtype))
        return parallel_state.all_reduce(out)


class ParallelLMHead(PackableWeight, nn.Module):
    """This rank's vocabulary rows of the output head; the logits are gathered to rank 0 (the
    only rank that samples), cut back to `vocab_size`. Other ranks get None."""

    def __init__(self, vocab_size: int, hidden: int, tp: TPShard) -> None:
        super().__init__()
        rows = tp.vocab_slice(vocab_size)
        self.vocab_size = vocab_size
        self.size = tp.size
        self.weight = nn.Parameter(torch.empty(rows.stop - rows.start, hidden))

    def forward(self, hidden: Tensor) -> Tensor | None:
        if self.quant is not None:
            logits = _quant_linear(hidden, self.quant, None)
        else:
            logits = cpu_linear.linear(hidden, self.weight, None, self.packed)
        if self.size == 1:  # the whole vocabulary, on the only rank
            return logits
        logits = parallel_state.gather_to_first(logits)
        return None if logits is None else logits[:, : self.vocab_size]
