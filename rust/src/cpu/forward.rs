//! A whole decoder forward on the CPU in one call: the Llama / Qwen2 / Qwen3 layer stack of
//! `models/decoder.py`, kernel for kernel, without going back to Python between layers.
//!
//! The Python model calls a Rust kernel per norm, projection, rotation, attention and
//! activation: ~10 calls a layer, each with its numpy views, torch allocations and argument
//! checks. At decode sizes (a few rows) the kernels themselves take tens of microseconds, so
//! that glue is a third of a small model's step (SmolLM2: ~8 ms of ~27 ms over 30 layers).
//! Here the same kernels run in the same order on the same numbers, with this call's buffers
//! reused by every layer, so the hidden states equal the Python path's bit for bit (the
//! tests in `tests/models/test_cpu_forward.py` compare them).
//!
//! Scope: float32 activations with weights as `linear`'s panels or ggml-typed rows (`quant`), or
//! bfloat16 activations with bf16 panels (`Act`: every kernel reads and writes bf16 rows where
//! the Python path's do, so a bf16 model's hidden states are that path's too), full causal
//! attention, one tensor-parallel rank, no LoRA: the Python side (`models/cpu_forward.py`)
//! decides when a model qualifies and keeps the layer-by-layer path otherwise. A layer's MLP is
//! dense or a mixture of experts (`moe_layer`: router, routing, grouped experts, shared expert).
use ndarray::{
    s, Array2, ArrayView2, ArrayView3, ArrayViewMut2, ArrayViewMut3, ArrayViewMut4, ArrayViewMut6,
    Axis, ShapeBuilder,
};

mod moe_layer;
mod topk;

pub use moe_layer::{route, Experts, MoeMlp, SharedExpert};

use super::attention::{paged_attention, store_kv_fed, PagedBatch};
use super::kv_quant::KvElem;
use super::quant::{self, quant_linear_with, Activations, QuantMatrix};
use super::{activation, invalid, linear, moe, norm, rotary, Bf16, Elem, PANEL};
use crate::error::Result;

/// A projection's weight: `linear`'s panels `[ceil(N / PANEL), K, PANEL]` of `n` output
/// features, or ggml-typed rows.
pub enum Weight<'a, T = f32> {
    Panels { panels: ArrayView3<'a, T>, n: usize },
    Quant(QuantMatrix<'a>),
}

impl<T> Weight<'_, T> {
    fn out_features(&self) -> usize {
        match self {
            Weight::Panels { n, .. } => *n,
            Weight::Quant(w) => w.n(),
        }
    }

    fn in_features(&self) -> usize {
        match self {
            Weight::Panels { panels, .. } => panels.dim().1,
            Weight::Quant(w) => w.k(),
        }
    }
}

/// A projection: its weight and optional bias `[N]`.
pub struct Linear<'a, T = f32> {
    pub weight: Weight<'a, T>,
    pub bias: Option<&'a [T]>,
}

impl<T: Act> Linear<'_, T> {
    /// `out = x @ W.T (+ bias)`, the kernel the Python layer calls for this weight.
    pub fn run(&self, x: ArrayView2<T>, out: ArrayViewMut2<T>, opts: Options) -> Result<()> {
        match &self.weight {
            Weight::Panels { panels, .. } => {
                linear::linear(x, *panels, self.bias, out, opts.num_threads)
            }
            Weight::Quant(w) => T::quant_linear(x, w, self.bias, out, opts),
        }
    }
}

/// The activations' element type: float32, or bfloat16 (`Bf16`: every kernel reads and writes
/// bf16 rows, rounded where each Python kernel of a bf16 model rounds them, so the hidden
/// states equal that path's). Quantized weights multiply float32 activations only.
pub trait Act: Elem {
    fn quant_linear(
        x: ArrayView2<Self>,
        w: &QuantMatrix<'_>,
        bias: Option<&[Self]>,
        out: ArrayViewMut2<Self>,
        opts: Options,
    ) -> Result<()>;
    fn quant_embedding(w: &QuantMatrix<'_>, ids: &[i64], out: ArrayViewMut2<Self>) -> Result<()>;
    fn quant_experts(
        x: ArrayView2<Self>,
        held: &moe::QuantExperts<'_>,
        ids: ArrayView2<i64>,
        weights: ArrayView2<f32>,
        out: ArrayViewMut2<Self>,
        opts: Options,
    ) -> Result<()>;
    /// `head` over `x` into float32 `logits` (what `compute_logits`' `.float()` gives).
    fn head_f32(
        head: &Linear<'_, Self>,
        x: ArrayView2<Self>,
        logits: ArrayViewMut2<f32>,
        opts: Options,
    ) -> Result<()>;
}

impl Act for f32 {
    fn quant_linear(
        x: ArrayView2<f32>,
        w: &QuantMatrix<'_>,
        bias: Option<&[f32]>,
        out: ArrayViewMut2<f32>,
        opts: Options,
    ) -> Result<()> {
        quant_linear_with(x, w, bias, out, opts.num_threads, opts.activations)
    }

    fn quant_embedding(w: &QuantMatrix<'_>, ids: &[i64], out: ArrayViewMut2<f32>) -> Result<()> {
        quant::embedding(w, ids, out)
    }

    fn quant_experts(
        x: ArrayView2<f32>,
        held: &moe::QuantExperts<'_>,
        ids: ArrayView2<i64>,
        weights: ArrayView2<f32>,
        out: ArrayViewMut2<f32>,
        opts: Options,
    ) -> Result<()> {
        moe::moe_quant_experts(
            x,
            held,
            ids,
            weights,
            out,
            opts.num_threads,
            opts.activations,
        )
    }

    fn head_f32(
        head: &Linear<'_, f32>,
        x: ArrayView2<f32>,
        logits: ArrayViewMut2<f32>,
        opts: Options,
    ) -> Result<()> {
        head.run(x, logits, opts)
    }
}

fn bf16_quant() -> crate::error::Error {
    invalid("quantized weights take float32 activations, not bfloat16")
}

impl Act for Bf16 {
    fn quant_linear(
        _: ArrayView2<Bf16>,
        _: &QuantMatrix<'_>,
        _: Option<&[Bf16]>,
        _: ArrayViewMut2<Bf16>,
        _: Options,
    ) -> Result<()> {
        Err(bf16_quant())
    }

    fn quant_embedding(_: &QuantMatrix<'_>, _: &[i64], _: ArrayViewMut2<Bf16>) -> Result<()> {
        Err(bf16_quant())
    }

    fn quant_experts(
        _: ArrayView2<Bf16>,
        _: &moe::QuantExperts<'_>,
        _: ArrayView2<i64>,
        _: ArrayView2<f32>,
        _: ArrayViewMut2<Bf16>,
        _: Options,
    ) -> Result<()> {
        Err(bf16_quant())
    }

    /// The bf16 logits widened to f32 as they are made (exact: a bf16 is an f32's high half),
    /// a block of vocabulary columns at a time (every row at once: the head's weights read
    /// once), instead of a whole bf16 `[K, V]` and a copy.
    fn head_f32(
        head: &Linear<'_, Bf16>,
        x: ArrayView2<Bf16>,
        mut logits: ArrayViewMut2<f32>,
        opts: Options,
    ) -> Result<()> {
        let (rows, vocab) = logits.dim();
        let Weight::Panels { panels, .. } = &head.weight else {
            return Err(bf16_quant());
        };
        // a part's panels: whole groups where they are grouped (HEAD_COLS is a multiple)
        let wide = panels.dim().2;
        let mut block = vec![Bf16::ZERO; rows * HEAD_COLS.min(vocab)];
        for start in (0..vocab).step_by(HEAD_COLS) {
            let end = (start + HEAD_COLS).min(vocab);
            let part = Linear {
                weight: Weight::Panels {
                    panels: panels.slice(s![start / wide..end.div_ceil(wide), .., ..]),
                    n: end - start,
                },
                bias: head.bias.map(|b| &b[start..end]),
            };
            let cols = end - start;
            let mut out = ArrayViewMut2::from_shape((rows, cols), &mut block[..rows * cols])
                .map_err(bad_shape)?;
            part.run(x, out.view_mut(), opts)?;
            logits
                .slice_mut(s![.., start..end])
                .zip_mut_with(&out, |l, b| *l = b.to_f32());
        }
        Ok(())
    }
}

/// Vocabulary columns of bf16 logits made at a time before their widening (`Act::head_f32`):
/// a multiple of a group of panels (`linear::PANEL_GROUP * PANEL`), small enough to stay in the
/// cache between the two (64 rows x 4,096 x 2 bytes = 512 KiB) and wide enough for every
/// thread's share of panels.
const HEAD_COLS: usize = 4096;
const _: () = assert!(HEAD_COLS.is_multiple_of(linear::PANEL_GROUP * PANEL));

/// A token embedding table: rows `[V, E]` of the activations' type, or ggml-typed rows.
pub enum Embedding<'a, T = f32> {
    Table(ArrayView2<'a, T>),
    Quant(QuantMatrix<'a>),
}

/// Rows `ids` of `table` into `out [T, E]`: the same floats as `F.embedding` /
/// `cpu_quant.embedding` give (a float row copied, a quantized row dequantized by the same kernel).
pub fn embed<T: Act>(
    table: &Embedding<'_, T>,
    ids: &[i64],
    mut out: ArrayViewMut2<T>,
) -> Result<()> {
    let table = match table {
        Embedding::Quant(w) => return T::quant_embedding(w, ids, out),
        Embedding::Table(table) => table,
    };
    let (rows, hidden) = table.dim();
    if out.dim() != (ids.len(), hidden) {
        return Err(invalid(format!(
            "out has shape {:?}, expected [{}, {hidden}]",
            out.shape(),
            ids.len()
        )));
    }
    if let Some(bad) = ids.iter().find(|id| !(0..rows as i64).contains(id)) {
        return Err(invalid(format!(
            "token id {bad} is outside the embedding's {rows} rows"
        )));
    }
    for (mut dst, &id) in out.rows_mut().into_iter().zip(ids) {
        dst.assign(&table.row(id as usize));
    }
    Ok(())
}

/// The LM head over rows `rows` of the final hidden states `x [T, E]` into `logits [K, V]` (row
/// i from `x[rows[i]]`, the rows the engine samples), as `compute_logits` runs it on
/// `hidden.index_select(0, rows)`: the same rows into the same kernel.
pub fn head_logits<T: Act>(
    x: ArrayView2<T>,
    rows: &[i64],
    head: &Linear<'_, T>,
    logits: ArrayViewMut2<f32>,
    opts: Options,
) -> Result<()> {
    let (tokens, hidden) = x.dim();
    let vocab = head.weight.out_features();
    if head.weight.in_features() != hidden || logits.dim() != (rows.len(), vocab) {
        return Err(invalid(format!(
            "the head is [{vocab}, {}] and logits {:?}, expected [{}, {vocab}] from hidden \
             size {hidden}",
            head.weight.in_features(),
            logits.shape(),
            rows.len()
        )));
    }
    if let Some(bad) = rows.iter().find(|r| !(0..tokens as i64).contains(r)) {
        return Err(invalid(format!(
            "sample row {bad} is outside the step's {tokens} rows"
        )));
    }
    if rows.is_empty() {
        return Ok(());
    }
    let mut picked = Array2::<T>::from_elem((rows.len(), hidden), T::ZERO);
    for (mut dst, &r) in picked.rows_mut().into_iter().zip(rows) {
        dst.assign(&x.row(r as usize));
    }
    T::head_f32(head, picked.view(), logits, opts)
}

/// One decoder layer's parameters (`models/decoder.py`'s `DecoderLayer`).
pub struct Layer<'a, T = f32> {
    pub input_norm: &'a [T],
    /// q, k, v output features side by side
    pub qkv: Linear<'a, T>,
    /// per-head RMS norms of q and k before the rotation (Qwen3), both or neither
    pub qk_norm: Option<(&'a [T], &'a [T])>,
    pub o: Linear<'a, T>,
    pub post_norm: &'a [T],
    pub mlp: Mlp<'a, T>,
    /// a quantized cache's key transform, applied where q and k leave the rotation
    pub key_transform: Option<KeyTransform<'a>>,
}

/// A quantized KV cache's key transform (`attention/key_transform.py`): keys stored as
/// `(k - c) * s`, queries met as `q * (1 / s)`, so `q . k` moves by `q . c` only, the same for
/// every key of a query (softmax unchanged). The same float32 operations in the same order as
/// the Python layer's, so the rows equal its rows bit for bit.
#[derive(Clone, Copy, Debug)]
pub struct KeyTransform<'a> {
    /// `1 / s` of each query head's kv head, `[H * D]`
    pub query_scale: &'a [f32],
    /// s, `[KVH * D]`
    pub key_scale: &'a [f32],
    /// c, `[KVH * D]`; none where scores are soft-capped
    pub key_offset: Option<&'a [f32]>,
    /// the keys' error-feedback rounding in a quantized store, `[KVH * D * D]`
    /// (`attention::store_kv_fed`); none: nearest rounding
    pub key_feedback: Option<&'a [f32]>,
}

impl KeyTransform<'_> {
    fn check(&self, i: usize, q: usize, kv: usize) -> Result<()> {
        let offset = self.key_offset.map_or(kv, <[f32]>::len);
        if self.query_scale.len() != q || self.key_scale.len() != kv || offset != kv {
            return Err(invalid(format!(
                "layer {i}: the key transform has {} query, {} key and {offset} offset \
                 elements, expected {q}, {kv}, {kv}",
                self.query_scale.len(),
                self.key_scale.len()
            )));
        }
        Ok(())
    }

    /// q `[T, H·D]` and k `[T, KVH·D]` rows transformed in place (float32 rows: the Python
    /// side keeps bf16 models with a quantized cache layer by layer).
    fn apply<T: Elem>(&self, mut q: ArrayViewMut2<T>, mut k: ArrayViewMut2<T>) {
        for mut row in q.rows_mut() {
            row.iter_mut()
                .zip(self.query_scale)
                .for_each(|(x, r)| *x = T::from_f32(x.to_f32() * r));
        }
        for mut row in k.rows_mut() {
            match self.key_offset {
                Some(c) => row
                    .iter_mut()
                    .zip(c.iter().zip(self.key_scale))
                    .for_each(|(x, (c, s))| *x = T::from_f32((x.to_f32() - c) * s)),
                None => row
                    .iter_mut()
                    .zip(self.key_scale)
                    .for_each(|(x, s)| *x = T::from_f32(x.to_f32() * s)),
            }
        }
    }
}

/// A layer's MLP: dense SwiGLU, or a mixture of experts.
pub enum Mlp<'a, T = f32> {
    Dense {
        /// gate then up output features side by side
        gate_up: Linear<'a, T>,
        down: Linear<'a, T>,
    },
    /// boxed: far larger than a dense MLP
    Moe(Box<MoeMlp<'a, T>>),
}

/// The attention geometry and the norms' epsilon.
#[derive(Clone, Copy, Debug)]
pub struct Shape {
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub eps: f32,
    pub scale: f32,
}

/// How the kernels run: threads at most, and the quantized products' activations.
#[derive(Clone, Copy, Debug)]
pub struct Options {
    pub num_threads: usize,
    pub activations: Activations,
}

/// The step: rotary tables `[T, D / 2]` and where each token's K/V goes and what it attends.
pub struct Step<'a, T = f32> {
    pub cos: ArrayView2<'a, T>,
    pub sin: ArrayView2<'a, T>,
    pub slot_mapping: &'a [i64],
    pub batch: PagedBatch<'a>,
}

/// The buffers one call reuses for every layer.
struct Scratch<T> {
    residual: Vec<T>,
    qkv: Vec<T>,
    q: Vec<T>,
    k: Vec<T>,
    /// q's (or k's) heads gathered contiguously for their per-head norms
    heads_in: Vec<T>,
    attn: Vec<T>,
    gate_up: Vec<T>,
    act: Vec<T>,
}

/// Runs `layers` and the final norm over `x [T, E]` (the step's embeddings in, the final
/// hidden states out, in place), storing each layer's K/V into its cache and attending over it.
/// `kv_cache` is the engine's `[2, layers, blocks, block_size, KVH, D (+ scale)]`.
/// `expert_counts`: one `[E]` per mixture-of-experts layer, in layer order, to which each
/// token's chosen experts are added.
#[allow(clippy::too_many_arguments)]
pub fn decoder_forward<T: Act, C: KvElem>(
    mut x: ArrayViewMut2<T>,
    layers: &[Layer<'_, T>],
    final_norm: &[T],
    shape: Shape,
    step: &Step<'_, T>,
    mut kv_cache: ArrayViewMut6<C>,
    expert_counts: &mut [&mut [i64]],
    opts: Options,
) -> Result<()> {
    let (tokens, hidden) = x.dim();
    check(
        layers,
        final_norm,
        shape,
        hidden,
        step.slot_mapping.len(),
        tokens,
    )?;
    let moe_layers = layers
        .iter()
        .filter(|l| matches!(l.mlp, Mlp::Moe(_)))
        .count();
    if expert_counts.len() != moe_layers {
        return Err(invalid(format!(
            "{} expert token counts for {moe_layers} mixture-of-experts layers",
            expert_counts.len()
        )));
    }
    if kv_cache.dim().0 != 2 || kv_cache.dim().1 != layers.len() {
        return Err(invalid(format!(
            "kv_cache has shape {:?}, expected [2, {}, blocks, block_size, kv heads, row]",
            kv_cache.shape(),
            layers.len()
        )));
    }
    if tokens == 0 {
        return Ok(());
    }
    let mut scratch = Scratch::new(tokens, hidden, layers, shape);
    let (mut k_caches, mut v_caches) = kv_cache.view_mut().split_at(Axis(0), 1);
    let mut counts = expert_counts.iter_mut();
    for (i, layer) in layers.iter().enumerate() {
        let first = i == 0;
        if first {
            // the embeddings are the first residual; x becomes their norm
            scratch.residual.copy_from_slice(as_slice(&x)?);
            let residual =
                ArrayView2::from_shape((tokens, hidden), &scratch.residual).map_err(bad_shape)?;
            norm::rms_norm(residual, layer.input_norm, shape.eps, x.view_mut())?;
        } else {
            add_norm(&mut x, &mut scratch.residual, layer.input_norm, shape.eps)?;
        }
        let k_cache = k_caches.index_axis_mut(Axis(0), 0);
        let v_cache = v_caches.index_axis_mut(Axis(0), 0);
        let (k_cache, v_cache) = (
            k_cache.index_axis_move(Axis(0), i),
            v_cache.index_axis_move(Axis(0), i),
        );
        attention(
            &mut x,
            layer,
            shape,
            step,
            k_cache,
            v_cache,
            &mut scratch,
            opts,
        )?;
        add_norm(&mut x, &mut scratch.residual, layer.post_norm, shape.eps)?;
        match &layer.mlp {
            Mlp::Dense { gate_up, down } => mlp(&mut x, (gate_up, down), &mut scratch, opts)?,
            Mlp::Moe(moe) => {
                // as many counts as sparse layers: checked above
                let counts = counts.next().ok_or_else(|| invalid("expert counts"))?;
                moe_layer::moe_mlp(&mut x, moe, counts, opts)?
            }
        }
    }
    if layers.is_empty() {
        let copy = x.to_owned();
        return norm::rms_norm(copy.view(), final_norm, shape.eps, x);
    }
    add_norm(&mut x, &mut scratch.residual, final_norm, shape.eps)
}

fn check<T: Act>(
    layers: &[Layer<'_, T>],
    final_norm: &[T],
    shape: Shape,
    hidden: usize,
    slots: usize,
    tokens: usize,
) -> Result<()> {
    if slots != tokens {
        return Err(invalid(format!(
            "slot_mapping has {slots} entries for {tokens} tokens"
        )));
    }
    if final_norm.len() != hidden {
        return Err(invalid(format!(
            "the final norm has {} elements for hidden size {hidden}",
            final_norm.len()
        )));
    }
    let q = shape.num_heads * shape.head_dim;
    let kv = shape.num_kv_heads * shape.head_dim;
    for (i, layer) in layers.iter().enumerate() {
        if let Some(t) = &layer.key_transform {
            t.check(i, q, kv)?;
        }
        let mut projections = vec![
            ("qkv", &layer.qkv, hidden, q + 2 * kv),
            ("o", &layer.o, q, hidden),
        ];
        let (gate_up, down) = match &layer.mlp {
            Mlp::Dense { gate_up, down } => (gate_up, down),
            Mlp::Moe(moe) => {
                moe.check(i, hidden)?;
                check_projections(i, &projections)?;
                continue;
            }
        };
        projections.push(("down", down, gate_up.weight.out_features() / 2, hidden));
        check_projections(i, &projections)?;
        if gate_up.weight.in_features() != hidden || gate_up.weight.out_features() % 2 != 0 {
            return Err(invalid(format!(
                "layer {i}: gate_up must take {hidden} inputs to an even number of outputs"
            )));
        }
    }
    Ok(())
}

/// Each projection `(name, linear, in, out)` of layer `i` checked against its expected shape.
fn check_projections<T>(
    i: usize,
    projections: &[(&str, &Linear<'_, T>, usize, usize)],
) -> Result<()> {
    for &(name, proj, k, n) in projections {
        if proj.weight.in_features() != k || proj.weight.out_features() != n {
            return Err(invalid(format!(
                "layer {i}: {name} is [{}, {}], expected [{n}, {k}]",
                proj.weight.out_features(),
                proj.weight.in_features()
            )));
        }
    }
    Ok(())
}

impl<T: Elem> Scratch<T> {
    fn new(tokens: usize, hidden: usize, layers: &[Layer<'_, T>], shape: Shape) -> Self {
        let q = shape.num_heads * shape.head_dim;
        let kv = shape.num_kv_heads * shape.head_dim;
        let inter = layers
            .iter()
            .map(|l| match &l.mlp {
                Mlp::Dense { gate_up, .. } => gate_up.weight.out_features(),
                Mlp::Moe(_) => 0, // the experts' kernels hold their own buffers
            })
            .max()
            .unwrap_or(0);
        let qk_norm = layers.iter().any(|l| l.qk_norm.is_some());
        let zero = T::ZERO;
        Scratch {
            residual: vec![zero; tokens * hidden],
            qkv: vec![zero; tokens * (q + 2 * kv)],
            q: vec![zero; if qk_norm { tokens * q } else { 0 }],
            k: vec![zero; if qk_norm { tokens * kv } else { 0 }],
            heads_in: vec![zero; if qk_norm { tokens * q.max(kv) } else { 0 }],
            attn: vec![zero; tokens * q],
            gate_up: vec![zero; tokens * inter],
            act: vec![zero; tokens * inter / 2],
        }
    }
}

/// A view this module shapes itself did not fit its buffer: a bug here, reported, not a panic.
fn bad_shape(e: ndarray::ShapeError) -> crate::error::Error {
    invalid(format!("decoder_forward: a buffer view does not fit ({e})"))
}

fn as_slice<'b, T>(x: &'b ArrayViewMut2<'_, T>) -> Result<&'b [T]> {
    x.as_slice().ok_or_else(|| invalid("x must be contiguous"))
}

/// `residual += x; x = rms_norm(residual)`, as `RMSNorm.add_and_norm` on the CPU.
fn add_norm<T: Elem>(
    x: &mut ArrayViewMut2<T>,
    residual: &mut [T],
    weight: &[T],
    eps: f32,
) -> Result<()> {
    let residual = ArrayViewMut2::from_shape(x.dim(), residual).map_err(bad_shape)?;
    norm::add_rms_norm(x.view_mut(), residual, weight, eps)
}

/// x (normed) -> x = o_proj(attention(rotated q, k; v)), K/V stored first.
#[allow(clippy::too_many_arguments)]
fn attention<T: Act, C: KvElem>(
    x: &mut ArrayViewMut2<T>,
    layer: &Layer<'_, T>,
    shape: Shape,
    step: &Step<'_, T>,
    k_cache: ArrayViewMut4<C>,
    v_cache: ArrayViewMut4<C>,
    scratch: &mut Scratch<T>,
    opts: Options,
) -> Result<()> {
    let tokens = x.dim().0;
    let (h, kvh, d) = (shape.num_heads, shape.num_kv_heads, shape.head_dim);
    let width = (h + 2 * kvh) * d;
    let qkv =
        ArrayViewMut2::from_shape((tokens, width), &mut scratch.qkv[..]).map_err(bad_shape)?;
    layer.qkv.run(x.view(), qkv, opts)?;
    let heads = |n: usize, start: usize, data| heads_view(data, tokens, n, d, width, start);
    match layer.qk_norm {
        None => {
            // q and k heads side by side in the fused output: rotated together, in place
            let qk = ArrayViewMut3::from_shape(
                (tokens, h + kvh, d).strides((width, d, 1)),
                &mut scratch.qkv[..],
            )
            .map_err(bad_shape)?;
            rotary::rotary_in_place(qk, step.cos, step.sin)?;
            if let Some(t) = &layer.key_transform {
                let mut qkv = ArrayViewMut2::from_shape((tokens, width), &mut scratch.qkv[..])
                    .map_err(bad_shape)?;
                let (q, k) = qkv.multi_slice_mut((s![.., ..h * d], s![.., h * d..(h + kvh) * d]));
                t.apply(q, k);
            }
        }
        Some((q_norm, k_norm)) => {
            // per-head norms into contiguous copies (as the Python path's `.contiguous()`)
            let qkv =
                ArrayView2::from_shape((tokens, width), &scratch.qkv[..]).map_err(bad_shape)?;
            let rows = &mut scratch.heads_in;
            norm_heads(
                qkv.slice(s![.., ..h * d]),
                q_norm,
                shape.eps,
                d,
                rows,
                &mut scratch.q,
            )?;
            let k_cols = qkv.slice(s![.., h * d..(h + kvh) * d]);
            norm_heads(k_cols, k_norm, shape.eps, d, rows, &mut scratch.k)?;
            let q =
                ArrayViewMut3::from_shape((tokens, h, d), &mut scratch.q[..]).map_err(bad_shape)?;
            rotary::rotary_in_place(q, step.cos, step.sin)?;
            let k = ArrayViewMut3::from_shape((tokens, kvh, d), &mut scratch.k[..])
                .map_err(bad_shape)?;
            rotary::rotary_in_place(k, step.cos, step.sin)?;
            if let Some(t) = &layer.key_transform {
                let q = ArrayViewMut2::from_shape((tokens, h * d), &mut scratch.q[..])
                    .map_err(bad_shape)?;
                let k = ArrayViewMut2::from_shape((tokens, kvh * d), &mut scratch.k[..])
                    .map_err(bad_shape)?;
                t.apply(q, k);
            }
        }
    }
    let (q, k) = if layer.qk_norm.is_some() {
        (
            ArrayView3::from_shape((tokens, h, d), &scratch.q[..]).map_err(bad_shape)?,
            ArrayView3::from_shape((tokens, kvh, d), &scratch.k[..]).map_err(bad_shape)?,
        )
    } else {
        (heads(h, 0, &scratch.qkv)?, heads(kvh, h * d, &scratch.qkv)?)
    };
    let v = heads(kvh, (h + kvh) * d, &scratch.qkv)?;
    store_and_attend(
        q,
        k,
        v,
        shape,
        step,
        k_cache,
        v_cache,
        &mut scratch.attn,
        opts,
        layer.key_transform.and_then(|t| t.key_feedback),
    )?;
    let attn = ArrayView2::from_shape((tokens, h * d), &scratch.attn[..]).map_err(bad_shape)?;
    layer.o.run(attn, x.view_mut(), opts)
}

/// Heads `[T, n, d]` of the fused projection output `data [T, width]`, from column `start`.
fn heads_view<T>(
    data: &[T],
    tokens: usize,
    n: usize,
    d: usize,
    width: usize,
    start: usize,
) -> Result<ArrayView3<'_, T>> {
    ArrayView3::from_shape((tokens, n, d).strides((width, d, 1)), &data[start..]).map_err(bad_shape)
}

/// RMS norm of every `d`-element head of `cols [T, n·d]` into `out` (contiguous `[T, n, d]`),
/// the heads gathered contiguously into `rows` first (the norm kernel reads contiguous rows).
fn norm_heads<T: Elem>(
    cols: ArrayView2<T>,
    weight: &[T],
    eps: f32,
    d: usize,
    rows: &mut [T],
    out: &mut [T],
) -> Result<()> {
    let (tokens, width) = cols.dim();
    let rows = &mut rows[..tokens * width];
    for (dst, src) in rows.chunks_exact_mut(width).zip(cols.rows()) {
        match src.as_slice() {
            Some(src) => dst.copy_from_slice(src),
            None => dst.iter_mut().zip(src).for_each(|(d, s)| *d = *s),
        }
    }
    let rows = ArrayView2::from_shape((tokens * width / d, d), &*rows).map_err(bad_shape)?;
    let out = ArrayViewMut2::from_shape((tokens * width / d, d), out).map_err(bad_shape)?;
    norm::rms_norm(rows, weight, eps, out)
}

#[allow(clippy::too_many_arguments)]
fn store_and_attend<T: Elem, C: KvElem>(
    q: ArrayView3<T>,
    k: ArrayView3<T>,
    v: ArrayView3<T>,
    shape: Shape,
    step: &Step<'_, T>,
    mut k_cache: ArrayViewMut4<C>,
    mut v_cache: ArrayViewMut4<C>,
    out: &mut [T],
    opts: Options,
    key_feedback: Option<&[f32]>,
) -> Result<()> {
    store_kv_fed(
        k,
        v,
        step.slot_mapping,
        k_cache.view_mut(),
        v_cache.view_mut(),
        key_feedback,
    )?;
    let tokens = q.dim().0;
    let out = ArrayViewMut3::from_shape((tokens, shape.num_heads, shape.head_dim), out)
        .map_err(bad_shape)?;
    // one lifetime for every view the kernel takes (its `PagedBatch` is invariant in it)
    let batch = PagedBatch {
        query_start_loc: step.batch.query_start_loc,
        seq_lens: step.batch.seq_lens,
        block_tables: step.batch.block_tables.view(),
    };
    paged_attention(
        q.view(),
        k_cache.view(),
        v_cache.view(),
        batch,
        shape.scale,
        out,
        opts.num_threads,
    )
}

/// x (normed) -> x = down(silu(gate) * up).
fn mlp<T: Act>(
    x: &mut ArrayViewMut2<T>,
    (gate_up_proj, down): (&Linear<'_, T>, &Linear<'_, T>),
    scratch: &mut Scratch<T>,
    opts: Options,
) -> Result<()> {
    let tokens = x.dim().0;
    let width = gate_up_proj.weight.out_features();
    let gate_up =
        ArrayViewMut2::from_shape((tokens, width), &mut scratch.gate_up[..tokens * width])
            .map_err(bad_shape)?;
    gate_up_proj.run(x.view(), gate_up, opts)?;
    let gate_up = ArrayView2::from_shape((tokens, width), &scratch.gate_up[..tokens * width])
        .map_err(bad_shape)?;
    let act =
        ArrayViewMut2::from_shape((tokens, width / 2), &mut scratch.act[..tokens * width / 2])
            .map_err(bad_shape)?;
    activation::silu_and_mul(gate_up, act, opts.num_threads)?;
    let act = ArrayView2::from_shape((tokens, width / 2), &scratch.act[..tokens * width / 2])
        .map_err(bad_shape)?;
    down.run(act, x.view_mut(), opts)
}

#[cfg(test)]
mod tests {
    use ndarray::Array2;

    use super::{head_logits, Linear, Options, Weight, HEAD_COLS};
    use crate::cpu::{linear, pack_panels, quant::Activations, Bf16, Elem, PANEL};

    /// A bf16 head of `vocab` columns run block by block (`head_logits`) over panels in groups
    /// of `group` gives the plain panels' whole product, widened.
    fn check_head(vocab: usize, group: usize) {
        let (rows, hidden) = (5, 48);
        let value = |i: usize| Bf16::from_f32(((i * 37 % 101) as f32 - 50.0) / 64.0);
        let x = Array2::from_shape_fn((rows, hidden), |(r, c)| value(r * hidden + c + 7));
        let w = Array2::from_shape_fn((vocab, hidden), |(r, c)| value(r * 3 + c * 11));
        let packed = pack_panels(w.view());
        let num_panels = vocab.div_ceil(PANEL);
        let plain = ndarray::ArrayView3::from_shape((num_panels, hidden, PANEL), &packed).unwrap();
        let grouped = linear::group_panels(&packed, hidden, group);
        let shape = (num_panels / group, hidden, group * PANEL);
        let panels = ndarray::ArrayView3::from_shape(shape, &grouped).unwrap();
        let opts = Options {
            num_threads: 2,
            activations: Activations::F32,
        };
        let mut whole = Array2::from_elem((rows, vocab), Bf16::ZERO);
        linear::linear(x.view(), plain, None, whole.view_mut(), 2).unwrap();
        let head = Linear {
            weight: Weight::Panels { panels, n: vocab },
            bias: None,
        };
        let mut logits = Array2::<f32>::zeros((2, vocab));
        head_logits(x.view(), &[3, 1], &head, logits.view_mut(), opts).unwrap();
        for (got, want) in logits.rows().into_iter().zip([3, 1]) {
            let want: Vec<f32> = whole.row(want).iter().map(|b| b.to_f32()).collect();
            assert_eq!(
                got.to_vec(),
                want,
                "vocab {vocab}, panels in groups of {group}"
            );
        }
    }

    #[test]
    fn a_bf16_head_wider_than_a_block_gives_the_whole_products_bits_widened() {
        check_head(HEAD_COLS + 3 * PANEL + 5, 1);
    }

    #[test]
    fn a_grouped_bf16_head_wider_than_a_block_gives_the_plain_products_bits() {
        // 260 panels: whole groups, the last panel ragged; plain where the tiles read no groups
        let vocab = HEAD_COLS + 4 * PANEL - 5;
        check_head(
            vocab,
            linear::panel_group::<Bf16>(vocab.div_ceil(PANEL), 48),
        );
    }
}
