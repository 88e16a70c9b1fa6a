"""One decoder-only transformer for Llama, Mistral, Qwen2/3 and Gemma 2/3, run over the paged
KV cache.

The families differ only in flags of `ModelConfig` (q/k/v bias, per-head q/k RMSNorm, RoPE
scaling, each layer's sliding window; Gemma's (1 + w) norms, norms around attention and MLP,
scaled input embeddings, soft-capped scores and logits, a second RoPE for its sliding layers).
Q/K/V and gate/up projections are fused into one matmul each (`ColumnParallelLinear`,
which names each projection's columns); the loader concatenates the checkpoint's separate
tensors. Token rows are packed: `[T, ...]` over every scheduled sequence.

The residual stream is carried beside the blocks' outputs (vLLM's layout): between two blocks one
call adds a block's output into the residual and normalizes the sum (`RMSNorm.add_and_norm`, in
place on the CPU), and the layers call their parts' `forward` directly (no `nn.Module.__call__`
hook machinery, which the engine never uses, on the ~100 calls of a step).

Built with a `TPShard` of more than one rank, the model holds that rank's shard
(`distributed/layers.py`): its q/KV heads, its share of the MLP and the vocabulary; the
row-parallel projections and the embedding sum over the ranks, and only rank 0 gets logits. The
layers are the same with one rank (they skip their collectives then): the whole model.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from pagedllm.attention import cpu_rotary
from pagedllm.attention.cpu_rotary import RopeTables
from pagedllm.attention.key_transform import KeyTransform
from pagedllm.attention.paged import AttentionMetadata, LayerAttention, paged_attention
from pagedllm.distributed.layers import (
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    TPShard,
    VocabParallelEmbedding,
)
from pagedllm.kernels import cpu_norm
from pagedllm.models.config import ModelConfig
from pagedllm.models.fused_linear import SINGLE
from pagedllm.models.mlp import GatedMLP
from pagedllm.models.moe import SparseMoeBlock
from pagedllm.models.rope import RopeConfig, rope_inv_freq


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last axis, computed in float32 like the reference."""

    def __init__(self, size: int, eps: float, offset: float = 0.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        # Gemma: the scale is (1 + weight), applied before the cast back (its reference order)
        self.offset = offset

    def forward(self, x: Tensor) -> Tensor:
        if self.offset:
            x32 = x.float()
            x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
            return (x32 * (self.offset + self.weight.float())).to(x.dtype)
        if cpu_norm.supports(x, self.weight):
            # one Rust call instead of torch's five or six operators (the formula below, summed
            # in the kernel's order)
            return cpu_norm.rms_norm(x, self.weight, self.eps)
        if x.dtype == torch.float32:
            # one fused op, bit-identical to the formula below in float32 (checked in tests)
            return torch.rms_norm(x, self.weight.shape, self.weight, self.eps)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)

    def add_and_norm(self, x: Tensor, residual: Tensor) -> tuple[Tensor, Tensor]:
        """The residual step after a block: `(norm(x + residual), x + residual)`. Both inputs
        are consumed (their buffers are reused for the results)."""
        if not self.offset and cpu_norm.supports_add(x, residual, self.weight):
            return cpu_norm.add_rms_norm(x, residual, self.weight, self.eps)
        residual = x.add_(residual)
        return self.forward(residual), residual


class RotaryEmbedding(nn.Module):
    """cos/sin `[T, head_dim / 2]` for the given positions (half-split, "rotate_half" convention:
    both halves of a head turn by the same angles, so the tables are not duplicated)."""

    def __init__(self, head_dim: int, rope: RopeConfig) -> None:
        super().__init__()
        inv_freq, self.attention_factor = rope_inv_freq(head_dim, rope)
        # not a checkpoint tensor: recomputed from the config, so not persistent
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        cos, sin = freqs.cos(), freqs.sin()
        if self.attention_factor != 1.0:  # yarn, longrope: cos/sin scaled (transformers' order)
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return cos.to(dtype), sin.to(dtype)


def apply_rope_(x: Tensor, rope: RopeTables) -> Tensor:
    """Rotate `x [T, heads, D]` in place by the per-token angles (the step's cos/sin
    `[T, D / 2]` from `RotaryEmbedding`, computed once per step for all layers): halves (a, b)
    become (a*cos - b*sin, b*cos + a*sin), i.e. x * cos + rotate_half(x) * sin with every product
    and sum rounded as in that formula (a - b*s == a + (-b)*s exactly). Returns x."""
    if cpu_rotary.supports(x, rope):
        cpu_rotary.rotary_in_place(x, rope)
        return x
    half = x.shape[-1] // 2
    a, b = x[..., :half], x[..., half:]
    c, s = rope.cos[:, None, :], rope.sin[:, None, :]
    a_sin, b_sin = a * s, b * s  # two half-head temporaries instead of three whole-head ones
    a.mul_(c).sub_(b_sin)
    b.mul_(c).add_(a_sin)
    return x


class Attention(nn.Module):
    """Self-attention with GQA; K/V go through the paged cache of this layer."""

    def __init__(self, cfg: ModelConfig, tp: TPShard = SINGLE, index: int = 0) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_heads // tp.size,
            tp.kv_heads(cfg.num_kv_heads),
            cfg.head_dim,
        )
        self.scale = cfg.attention_scale
        # what the kernels need of this layer (a plain scale for full, uncapped attention)
        self.sliding_window, self.softcap = cfg.window(index), cfg.attn_softcap
        self.scoring: float | LayerAttention = self.scale
        if self.sliding_window or self.softcap:
            self.scoring = LayerAttention(self.scale, self.sliding_window, self.softcap)
        self.qkv_proj = QKVParallelLinear(
            cfg.hidden_size,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
            tp,
            bias=cfg.qkv_bias,
        )
        self.o_proj = RowParallelLinear(cfg.q_size, cfg.hidden_size, tp, bias=cfg.o_bias)
        eps, offset = cfg.rms_norm_eps, cfg.norm_offset
        self.q_norm = RMSNorm(cfg.head_dim, eps, offset) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, eps, offset) if cfg.qk_norm else None
        # a quantized KV cache's key transform (`attention/key_transform.py`), set by the worker
        # after its start-up calibration; None: q and k go to the cache as RoPE leaves them
        self.key_transform: KeyTransform | None = None

    def forward(
        self,
        x: Tensor,
        rope: RopeTables,
        k_cache: Tensor,
        v_cache: Tensor,
        meta: AttentionMetadata,
    ) -> Tensor:
        num_tokens = x.shape[0]
        qkv = self.qkv_proj.forward(x)
        q, k, v = self.qkv_proj.split(qkv)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q = self.q_norm.forward(q.view(num_tokens, self.num_heads, self.head_dim))
            k = self.k_norm.forward(k.view(num_tokens, self.num_kv_heads, self.head_dim))
            q, k = apply_rope_(q, rope), apply_rope_(k, rope)
        else:
            # q and k heads (adjacent in the fused output) rotated together, in place: one
            # rotation per layer instead of two (same math)
            qk = qkv[:, : q.shape[-1] + k.shape[-1]].view(
                num_tokens, self.num_heads + self.num_kv_heads, self.head_dim
            )
            apply_rope_(qk, rope)
            q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        feedback = None
        if self.key_transform is not None:
            self.key_transform.apply_(q, k)
            feedback = self.key_transform.feedback
        out = paged_attention(q, k, v, k_cache, v_cache, meta, self.scoring, feedback)
        return self.o_proj.forward(out.reshape(num_tokens, -1))


class DecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then + mlp(norm(.)); the residual stream is carried
    separately (see the module docstring). Gemma's sandwich: x + post_norm(attn(norm(x))), then
    + post_ff_norm(mlp(pre_ff_norm(.)))."""

    def __init__(self, cfg: ModelConfig, tp: TPShard = SINGLE, index: int = 0) -> None:
        super().__init__()
        e, eps, offset = cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_offset
        self.input_layernorm = RMSNorm(e, eps, offset)
        self.self_attn = Attention(cfg, tp, index)
        self.post_attention_layernorm = RMSNorm(e, eps, offset)
        # Gemma 3 rotates its sliding layers with their own RoPE
        self.uses_local_rope = cfg.local_rope is not None and cfg.window(index) > 0
        self.pre_feedforward_layernorm = self.post_feedforward_layernorm = None
        if cfg.sandwich_norms:
            self.pre_feedforward_layernorm = RMSNorm(e, eps, offset)
            self.post_feedforward_layernorm = RMSNorm(e, eps, offset)
        if cfg.moe is not None and cfg.moe.is_sparse(index):
            self.mlp = SparseMoeBlock(cfg, tp)
        else:
            self.mlp = GatedMLP(cfg, tp)

    def forward(
        self,
        x: Tensor,
        residual: Tensor | None,
        rope: RopeTables,
        k_cache: Tensor,
        v_cache: Tensor,
        meta: AttentionMetadata,
    ) -> tuple[Tensor, Tensor]:
        """x: the previous layer's MLP output (the embedding for the first layer, whose
        `residual` is None). Returns this layer's MLP output and the residual before it."""
        if residual is None:
            x, residual = self.input_layernorm.forward(x), x
        else:
            x, residual = self.input_layernorm.add_and_norm(x, residual)
        x = self.self_attn.forward(x, rope, k_cache, v_cache, meta)
        if self.pre_feedforward_layernorm is not None:
            x = self.post_attention_layernorm.forward(x)
            x, residual = self.pre_feedforward_layernorm.add_and_norm(x, residual)
            return self.post_feedforward_layernorm.forward(self.mlp.forward(x)), residual
        x, residual = self.post_attention_layernorm.add_and_norm(x, residual)
        return self.mlp.forward(x), residual


class DecoderModel(nn.Module):
    """Embedding, decoder layers and final norm (checkpoint prefix `model.`)."""

    def __init__(self, cfg: ModelConfig, tp: TPShard = SINGLE) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = nn.ModuleList(DecoderLayer(cfg, tp, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_offset)
        self.embed_scale = cfg.embed_scale
        self.rotary_emb = RotaryEmbedding(cfg.head_dim, cfg.rope)
        self.local_rotary_emb = None
        if cfg.local_rope is not None:
            self.local_rotary_emb = RotaryEmbedding(cfg.head_dim, cfg.local_rope)

    def forward(
        self, input_ids: Tensor, positions: Tensor, kv_cache: Tensor, meta: AttentionMetadata
    ) -> Tensor:
        x = self.embed_tokens(input_ids)
        if self.embed_scale != 1.0:
            # Gemma: sqrt(hidden) rounded to the model's dtype first, as transformers does
            x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        rope = RopeTables(*self.rotary_emb(positions, x.dtype))  # once per step, for all layers
        local = rope
        if self.local_rotary_emb is not None:
            local = RopeTables(*self.local_rotary_emb(positions, x.dtype))
        residual = None
        for i, layer in enumerate(self.layers):
            tables = local if layer.uses_local_rope else rope
            c, m = meta.for_layer(i)  # hybrid KV groups: the layer's cache slot and tables
            x, residual = layer.forward(x, residual, tables, kv_cache[0, c], kv_cache[1, c], m)
        if residual is None:  # no layers
            return self.norm.forward(x)
        return self.norm.add_and_norm(x, residual)[0]


class DecoderForCausalLM(nn.Module):
    """The engine's model: `forward` gives hidden states, `compute_logits` the float32 logits."""

    def __init__(self, cfg: ModelConfig, tp: TPShard = SINGLE) -> None:
        super().__init__()
        self.config = cfg
        self.tp = tp
        self.model = DecoderModel(cfg, tp)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, tp)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the embedding matrix with the output head when the config asks for it."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def reset_rotary(self) -> None:
        """Recompute the RoPE frequencies on the embedding's device (after meta-device loading)."""
        device = self.model.embed_tokens.weight.device
        self.model.rotary_emb = RotaryEmbedding(self.config.head_dim, self.config.rope).to(device)
        if self.config.local_rope is not None:
            local = RotaryEmbedding(self.config.head_dim, self.config.local_rope)
            self.model.local_rotary_emb = local.to(device)

    def forward(
        self, input_ids: Tensor, positions: Tensor, kv_cache: Tensor, meta: AttentionMetadata
    ) -> Tensor:
        """input_ids/positions int64 `[T]`, kv_cache `[2, L, blocks, block_size, KVH, D]` ->
        `[T, E]`."""
        return self.model(input_ids, positions, kv_cache, meta)

    def compute_logits(self, hidden: Tensor) -> Tensor | None:
        """hidden `[K, E]` -> logits `[K, vocab_size]` in float32 (sharded: on rank 0 only, None
        on the others)."""
        logits = self.lm_head(hidden)
        if logits is None:
            return None
        cap = self.config.final_softcap
        if cap:  # Gemma 2: logits bounded as cap * tanh(logits / cap)
            return torch.tanh(logits.float() / cap) * cap
        return logits.float()
