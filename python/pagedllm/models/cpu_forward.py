"""The decoder's layers in one Rust call per step on the CPU (`_core.CpuDecoder`,
`rust/src/cpu/forward.rs`).

`DecoderForCausalLM.forward` calls a Rust kernel per norm, projection, rotation, attention and
activation, ~10 a layer, each crossing with its numpy views and torch allocations: at decode
sizes that glue costs as much as a small model's kernels (SmolLM2-135M: ~8 ms of a ~27 ms step
over 30 layers). `CpuDecoderForward` runs the same kernels in the same order on the same numbers
from Rust, so its hidden states equal the layer-by-layer path's bit for bit (a mixture of experts'
routing weights to the softmax's last bits: torch's vectorized exp); the rotary tables stay
where they are. Where the embedding and the LM head are of kinds the Rust side reads (`_ends`),
`CpuDecoderForward.logits` runs them in the same call: token ids in, the sampled rows' logits
out, the same kernels on the same rows (without the step's half dozen torch calls around the
layers: a single-stream step of a small model is ~5 ms, those calls ~0.3-0.5 ms of it).

`build` decides when a model qualifies (float32 or bfloat16 on the CPU, one tensor-parallel rank,
no LoRA, dense gated MLPs or mixture-of-experts blocks (`models/moe.py`'s `SparseMoeBlock`,
experts packed or quantized: the router, the routing, the grouped experts, the shared expert and
the expert token counts run in the same call, `rust/src/cpu/forward/moe_layer.rs`), full
attention, every projection packed or quantized, a KV cache in the model's dtype or quantized
(`kv_cache_dtype` int8 / fp8: stored and read by the same Rust kernels as layer by layer; float32
models only) and returns None otherwise: the model then runs layer by layer, as before.

A bfloat16 model runs bf16 activations through the same kernels as its layers do (every kernel
reads and writes bf16 rows, rounding where the Python path's kernels round), its weights the
bf16 panels the layers read; its LM head's logits are widened to float32 in the same call, as
`compute_logits`' `.float()` does. Quantized weights take float32 activations: a bf16 model
with any of them keeps the layer-by-layer path.
"""

from __future__ import annotations

import torch
from torch import Tensor

from pagedllm import _core
from pagedllm.attention.paged import AttentionMetadata
from pagedllm.distributed.layers import QuantEmbedding, VocabParallelEmbedding
from pagedllm.kernels import cpu_quant
from pagedllm.kernels.cpu_arrays import numpy_view
from pagedllm.kernels.reference import as_bytes, kv_format
from pagedllm.models.decoder import Attention, DecoderForCausalLM, DecoderLayer
from pagedllm.models.mlp import GatedMLP
from pagedllm.models.moe import SparseMoeBlock


class CpuDecoderForward:
    """`model.forward` with the layers and the final norm run by one `_core.CpuDecoder` call."""

    def __init__(
        self,
        model: DecoderForCausalLM,
        decoder: _core.CpuDecoder,
        kv_cache_dtype: str,
        head_rows: int | None = None,
    ) -> None:
        self.model = model
        self.decoder = decoder
        self.kv_cache_dtype = kv_cache_dtype
        # the LM head's rows (the logits' width) where the decoder holds the embedding and the
        # head (`logits` applies); None otherwise
        self.head_rows = head_rows
        # the activations' dtype (float32 or bfloat16): the embedding's
        self.dtype = model.model.embed_tokens.weight.dtype

    def _step(self, positions: Tensor, kv_cache: Tensor, meta: AttentionMetadata) -> tuple:
        """A step's arguments after the hidden states / token ids, as `forward` and `logits`
        take them: the rotary tables, the batch's arrays and the cache."""
        cos, sin = self.model.model.rotary_emb(positions, self.dtype)
        # fp8 codes cross as their uint8 bits (numpy has no fp8)
        cache = numpy_view(as_bytes(kv_cache))
        return (
            numpy_view(cos.contiguous()),
            numpy_view(sin.contiguous()),
            *meta.cpu_arrays(),
            cache,
        )

    def _opts(self) -> tuple:
        """The call's threads, quantized activations and cache dtype."""
        return (torch.get_num_threads(), cpu_quant.ACTIVATIONS, self.kv_cache_dtype)

    def __call__(
        self, input_ids: Tensor, positions: Tensor, kv_cache: Tensor, meta: AttentionMetadata
    ) -> Tensor:
        x = self.model.model.embed_tokens(input_ids).contiguous()
        self.decoder.forward(numpy_view(x), *self._step(positions, kv_cache, meta), *self._opts())
        return x

    def logits(
        self,
        input_ids: Tensor,
        positions: Tensor,
        kv_cache: Tensor,
        meta: AttentionMetadata,
        sample_rows: Tensor,
    ) -> Tensor | None:
        """`compute_logits(self(...)[sample_rows])` in one Rust call (`head_rows` set): float32
        `[K, V]`, None when K = 0 (the layers still run: their K/V are stored)."""
        rows = sample_rows.numpy()
        out = torch.empty(len(rows), self.head_rows, dtype=torch.float32)
        step = self._step(positions, kv_cache, meta)
        self.decoder.logits(input_ids.numpy(), *step, rows, out.numpy(), *self._opts())
        return out if len(rows) else None


def build(model: torch.nn.Module, kv_cache: Tensor, *, lora: bool) -> CpuDecoderForward | None:
    """The fused forward for `model` over `kv_cache`, or None where it does not apply (see the
    module docstring)."""
    if lora or not _qualifies(model, kv_cache):
        return None
    cfg = model.config
    inner = model.model
    dtype = inner.embed_tokens.weight.dtype
    layers = [_layer(layer, dtype) for layer in inner.layers]
    final_norm = _norm(inner.norm, dtype)
    if any(layer is None for layer in layers) or final_norm is None:
        return None
    attn = inner.layers[0].self_attn if len(inner.layers) else None
    ends = _ends(model, dtype)
    decoder = _core.CpuDecoder(
        layers,
        final_norm,
        cfg.num_heads,
        cfg.num_kv_heads,
        cfg.head_dim,
        inner.norm.eps,
        attn.scale if attn is not None else cfg.head_dim**-0.5,
        key_transforms=[_key_transform(layer.self_attn) for layer in inner.layers],
        ends=ends,
        buffers=_buffers(model),
    )
    kv_cache_dtype = kv_format(kv_cache.dtype)
    head_rows = None if ends is None else _head_rows(model.lm_head)
    return CpuDecoderForward(model, decoder, kv_cache_dtype, head_rows=head_rows)


def _ends(model: DecoderForCausalLM, dtype: torch.dtype) -> tuple | None:
    """`(embedding, head)` as `CpuDecoder` takes them, or None where either is of another kind
    (the step then embeds and computes its logits in Python, as before): the embedding a table
    in the activations' `dtype` or quantized rows, the head quantized rows or panels in `dtype`,
    one rank, no soft-capped logits."""
    embed, head = model.model.embed_tokens, model.lm_head
    if model.config.final_softcap or head.size != 1 or getattr(embed, "size", 1) != 1:
        return None
    float32 = dtype == torch.float32
    if isinstance(embed, QuantEmbedding) or (
        type(embed) is VocabParallelEmbedding and embed.quant is not None
    ):
        if not float32:
            return None
        table = ("quant", list(embed.quant._arrays), embed.quant.in_features)
    elif type(embed) is VocabParallelEmbedding and _table(embed.weight, dtype):
        table = ("table", numpy_view(embed.weight.detach()))
    else:
        return None
    if head.quant is not None and float32:
        lm = ("quant", list(head.quant._arrays), head.quant.in_features, None)
    elif head.quant is None and head.packed is not None and head.packed.panels.dtype == dtype:
        lm = ("panels", head.packed.array, head.packed.out_features, None)
    else:
        return None
    return table, lm


def _buffers(model: torch.nn.Module) -> list:
    """The memory of the quantized weights' segments, one uint8 array per distinct storage
    (`worker/weight_pages.py` copies them all into one buffer): the decoder borrows each once a
    step instead of every segment."""
    storages = {}
    for module in model.modules():
        quant = getattr(module, "quant", None)
        for segment in getattr(quant, "segments", ()):
            storage = segment.data.untyped_storage()
            storages.setdefault(storage.data_ptr(), storage)
    return [
        torch.empty(0, dtype=torch.uint8).set_(storage).numpy() for storage in storages.values()
    ]


def _head_rows(head: torch.nn.Module) -> int:
    return head.quant.out_features if head.quant is not None else head.packed.out_features


def _table(weight: Tensor, dtype: torch.dtype) -> bool:
    return weight.dtype == dtype and weight.dim() == 2 and weight.is_contiguous()


def _cache_fits(kv_cache: Tensor, dtype: torch.dtype) -> bool:
    """A cache in the activations' dtype, or (float32 models) a quantized one."""
    quantized = kv_format(kv_cache.dtype) != "auto"
    return kv_cache.dtype == dtype or (dtype == torch.float32 and quantized)


def _qualifies(model: torch.nn.Module, kv_cache: Tensor) -> bool:
    dtype = model.model.embed_tokens.weight.dtype
    return (
        type(model) is DecoderForCausalLM
        and model.tp.size == 1
        and kv_cache.device.type == "cpu"
        and dtype in (torch.float32, torch.bfloat16)
        and _cache_fits(kv_cache, dtype)
        and kv_cache.is_contiguous()
        # Gemma's (1 + w) norms, sandwich norms and GeGLU are not in the fused layer
        and model.config.norm_offset == 0
        and model.config.hidden_act == "silu"
        # Gemma's scaled embeddings and local RoPE neither
        and model.model.embed_scale == 1.0
        and model.model.local_rotary_emb is None
        and all(_plain_layer(layer) for layer in model.model.layers)
    )


def _plain_layer(layer: torch.nn.Module) -> bool:
    """Exactly the decoder's own classes (a subclass or a family with extra parts, e.g. a
    sliding window or soft-capping, keeps the layer-by-layer path)."""
    attn = getattr(layer, "self_attn", None)
    return (
        type(layer) is DecoderLayer
        and type(attn) is Attention
        and type(layer.mlp) in (GatedMLP, SparseMoeBlock)
        and not attn.sliding_window
        and not attn.softcap
        and layer.pre_feedforward_layernorm is None
    )


def _key_transform(attn: Attention) -> tuple | None:
    """A quantized cache's key transform (`attention/key_transform.py`) as the Rust layer
    takes it: (query_scale, key_scale, key_offset or None, key_feedback or None), flat
    float32."""
    t = attn.key_transform
    if t is None:
        return None
    offset = None if t.offset is None else t.offset.reshape(-1).numpy()
    feedback = None if t.feedback is None else t.feedback.reshape(-1).numpy()
    return (t.query_scale.reshape(-1).numpy(), t.scale.reshape(-1).numpy(), offset, feedback)


def _norm(norm: torch.nn.Module, dtype: torch.dtype):
    """The norm's weight in the activations' `dtype` as numpy, or None (another dtype)."""
    weight = norm.weight.detach()
    return numpy_view(weight.contiguous()) if weight.dtype == dtype else None


def _linear(layer: torch.nn.Module, dtype: torch.dtype):
    """`("panels", panels, n, bias)` / `("quant", segments, k, bias)` (float32 activations
    only), or None (unpacked, or panels of another dtype than the activations')."""
    bias = None if layer.bias is None else numpy_view(layer.bias.detach().to(dtype).contiguous())
    if layer.quant is not None:
        if dtype != torch.float32:
            return None
        return ("quant", list(layer.quant._arrays), layer.quant.in_features, bias)
    packed = layer.packed
    if packed is None or packed.panels.dtype != dtype:
        return None
    return ("panels", packed.array, packed.out_features, bias)


def _layer(layer: DecoderLayer, dtype: torch.dtype) -> tuple | None:
    attn, mlp = layer.self_attn, layer.mlp
    linears = [_linear(p, dtype) for p in (attn.qkv_proj, attn.o_proj)]
    norms = [_norm(n, dtype) for n in (layer.input_layernorm, layer.post_attention_layernorm)]
    qk = [_norm(n, dtype) if n is not None else None for n in (attn.q_norm, attn.k_norm)]
    mlp_parts = _moe(mlp, dtype) if isinstance(mlp, SparseMoeBlock) else _dense(mlp, dtype)
    if any(part is None for part in linears + norms) or mlp_parts is None:
        return None
    if attn.q_norm is not None and any(n is None for n in qk):
        return None
    qkv, o = linears
    return (norms[0], qkv, qk[0], qk[1], o, norms[1], *mlp_parts)


def _dense(mlp: GatedMLP, dtype: torch.dtype) -> tuple | None:
    parts = (_linear(mlp.gate_up_proj, dtype), _linear(mlp.down_proj, dtype))
    return None if None in parts else parts


def _moe(block: SparseMoeBlock, dtype: torch.dtype) -> tuple | None:
    """`(("moe", router, experts, top_k, (normalize, round_weights), shared, counts), None)`,
    or None where the block's experts are neither packed in `dtype` nor quantized (float32
    activations), or a part is not packed."""
    experts = block.experts
    if experts.num_experts != experts.total_experts:
        return None  # expert parallelism holds a share: one rank only here
    if experts.quant is not None and dtype == torch.float32:
        held = ("quant", experts.quant.kernel)
    elif experts.packed is not None and experts.packed.gate_up.dtype == dtype:
        held = ("panels", experts.packed.gate_up_array, experts.packed.down_array)
    else:
        return None
    router = _linear(block.gate, dtype)
    shared = None
    if block.shared_expert is not None:
        mlp = block.shared_expert
        shared = (
            _linear(mlp.gate_up_proj, dtype),
            _linear(mlp.down_proj, dtype),
            _linear(block.shared_expert_gate, dtype),
        )
        if None in shared:
            return None
    counts = block.expert_tokens
    if router is None or counts.device.type != "cpu" or not counts.is_contiguous():
        return None
    routing = (block.normalize, block.round_weights)
    spec = ("moe", router, held, block.top_k, routing, shared, counts.numpy())
    return (spec, None)
