//! The mixture-of-experts MLP of `models/moe.py`'s `SparseMoeBlock` inside the one-call decoder:
//! the router's product, transformers' routing (softmax over all experts in f32, the top k,
//! renormalized when the config says so), the grouped-expert kernel (`cpu::moe`) and Qwen2-MoE's
//! shared expert with its sigmoid gate — the Python block's kernels in its order, so a step's
//! hidden states differ from the layer-by-layer path only by the softmax's last bits (torch's
//! vectorized `exp` against Rust's; the chosen experts and greedy tokens are the same).
use ndarray::{ArrayView2, ArrayView4, ArrayViewMut2};

use super::{bad_shape, topk, Act, Linear, Options};
use crate::cpu::{activation, invalid, moe};
use crate::error::Result;

/// The experts' weights: stacked `linear` panels (`cpu::moe_experts`) or quantized rows laid out
/// in two buffers (`cpu::moe_quant_experts`).
pub enum Experts<'a, T = f32> {
    Panels {
        /// `[E, ceil(2I / PANEL), H, PANEL]`, each expert's gate rows then up rows
        gate_up: ArrayView4<'a, T>,
        /// `[E, ceil(H / PANEL), I, PANEL]`
        down: ArrayView4<'a, T>,
    },
    Quant(moe::QuantExperts<'a>),
}

impl<T> Experts<'_, T> {
    fn count(&self) -> usize {
        match self {
            Experts::Panels { down, .. } => down.dim().0,
            Experts::Quant(held) => held.count(),
        }
    }
}

/// Qwen2-MoE's shared expert: every token's SwiGLU MLP, scaled by `sigmoid(gate · x)`.
pub struct SharedExpert<'a, T = f32> {
    pub gate_up: Linear<'a, T>,
    pub down: Linear<'a, T>,
    /// `[1, H]`
    pub gate: Linear<'a, T>,
}

/// One sparse layer's MLP.
pub struct MoeMlp<'a, T = f32> {
    /// `[E, H]`: one logit per expert
    pub router: Linear<'a, T>,
    pub experts: Experts<'a, T>,
    pub top_k: usize,
    /// `norm_topk_prob`: the k chosen weights divided by their sum
    pub normalize: bool,
    /// Qwen's routers hand the experts their weights rounded to the activations' type
    /// (`SparseMoeBlock.round_weights`; Mixtral's stay float32)
    pub round_weights: bool,
    pub shared: Option<SharedExpert<'a, T>>,
}

impl<T> MoeMlp<'_, T> {
    pub(super) fn check(&self, i: usize, hidden: usize) -> Result<()> {
        let experts = self.experts.count();
        let router = &self.router.weight;
        if router.in_features() != hidden || router.out_features() != experts {
            return Err(invalid(format!(
                "layer {i}: the router is [{}, {}], expected [{experts}, {hidden}] (one logit \
                 per expert)",
                router.out_features(),
                router.in_features()
            )));
        }
        if self.top_k == 0 || self.top_k > experts {
            return Err(invalid(format!(
                "layer {i}: top_k {} must be in 1..={experts} (the number of experts)",
                self.top_k
            )));
        }
        if let Some(shared) = &self.shared {
            let width = shared.gate_up.weight.out_features();
            let fits = shared.gate_up.weight.in_features() == hidden
                && width % 2 == 0
                && shared.down.weight.in_features() == width / 2
                && shared.down.weight.out_features() == hidden
                && shared.gate.weight.in_features() == hidden
                && shared.gate.weight.out_features() == 1;
            if !fits {
                return Err(invalid(format!(
                    "layer {i}: the shared expert's gate_up [2S, {hidden}], down [{hidden}, S] \
                     and gate [1, {hidden}] do not fit"
                )));
            }
        }
        Ok(())
    }
}

/// Routes a step's tokens: `logits [T, E]` -> (weights `[T, k]`, ids `[T, k]`), as
/// `models/moe.py`'s `route`: softmax in f32 (max subtracted), the k largest in descending order
/// (equal ones chosen and ordered as `torch.topk` does, `topk`), divided by their sum when
/// `normalize`.
pub fn route(
    logits: &[f32],
    experts: usize,
    top_k: usize,
    normalize: bool,
) -> (Vec<f32>, Vec<i64>) {
    let tokens = logits.len() / experts.max(1);
    let mut weights = Vec::with_capacity(tokens * top_k);
    let mut ids = Vec::with_capacity(tokens * top_k);
    let mut probs = vec![0.0f32; experts];
    let mut pairs = Vec::with_capacity(experts);
    let mut order: Vec<usize> = Vec::with_capacity(top_k);
    for row in logits.chunks_exact(experts) {
        let max = row.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
        let mut sum = 0.0f32;
        for (p, &v) in probs.iter_mut().zip(row) {
            *p = (v - max).exp();
            sum += *p;
        }
        probs.iter_mut().for_each(|p| *p /= sum);
        order.clear();
        // equal probabilities (a bf16 router's logits tie often) in torch.topk's order
        order.extend(topk::topk(&probs, top_k, &mut pairs));
        let chosen = &order[..];
        let total: f32 = chosen.iter().map(|&e| probs[e]).sum();
        for &e in chosen {
            weights.push(if normalize {
                probs[e] / total
            } else {
                probs[e]
            });
            ids.push(e as i64);
        }
    }
    (weights, ids)
}

/// x (normed) -> x = the block's output; each token's chosen experts added to `counts`.
pub(super) fn moe_mlp<T: Act>(
    x: &mut ArrayViewMut2<T>,
    mlp: &MoeMlp<'_, T>,
    counts: &mut [i64],
    opts: Options,
) -> Result<()> {
    let (tokens, hidden) = x.dim();
    let experts = mlp.experts.count();
    if counts.len() != experts {
        return Err(invalid(format!(
            "the expert token counts have {} entries for {experts} experts",
            counts.len()
        )));
    }
    let mut logits = vec![T::ZERO; tokens * experts];
    mlp.router.run(
        x.view(),
        ArrayViewMut2::from_shape((tokens, experts), &mut logits[..]).map_err(bad_shape)?,
        opts,
    )?;
    let k = mlp.top_k;
    // the softmax reads the logits widened to float32 (`softmax(..., dtype=float32)`)
    let logits: Vec<f32> = logits.iter().map(|l| l.to_f32()).collect();
    let (mut weights, ids) = route(&logits, experts, k, mlp.normalize);
    if mlp.round_weights {
        weights.iter_mut().for_each(|w| *w = T::round(*w));
    }
    for &e in &ids {
        counts[e as usize] += 1;
    }
    let ids = ArrayView2::from_shape((tokens, k), &ids[..]).map_err(bad_shape)?;
    let weights = ArrayView2::from_shape((tokens, k), &weights[..]).map_err(bad_shape)?;
    let mut out = vec![T::ZERO; tokens * hidden];
    let out_view = ArrayViewMut2::from_shape((tokens, hidden), &mut out[..]).map_err(bad_shape)?;
    match &mlp.experts {
        Experts::Panels { gate_up, down } => moe::moe_experts(
            x.view(),
            *gate_up,
            *down,
            ids,
            weights,
            out_view,
            opts.num_threads,
        )?,
        Experts::Quant(held) => T::quant_experts(x.view(), held, ids, weights, out_view, opts)?,
    }
    if let Some(shared) = &mlp.shared {
        add_shared(x.view(), shared, &mut out, opts)?;
    }
    let x = x
        .as_slice_mut()
        .ok_or_else(|| invalid("x must be contiguous"))?;
    x.copy_from_slice(&out);
    Ok(())
}

/// `out += sigmoid(gate · x) * down(silu(gate_up(x)))` (the Python block's order: the sigmoid,
/// the product with the gate and the sum each rounded to the activations' type).
fn add_shared<T: Act>(
    x: ArrayView2<T>,
    shared: &SharedExpert<'_, T>,
    out: &mut [T],
    opts: Options,
) -> Result<()> {
    let (tokens, hidden) = x.dim();
    let width = shared.gate_up.weight.out_features();
    let mut gate = vec![T::ZERO; tokens];
    let gate_view = ArrayViewMut2::from_shape((tokens, 1), &mut gate[..]).map_err(bad_shape)?;
    shared.gate.run(x, gate_view, opts)?;
    let mut gate_up = vec![T::ZERO; tokens * width];
    let gate_up_view =
        ArrayViewMut2::from_shape((tokens, width), &mut gate_up[..]).map_err(bad_shape)?;
    shared.gate_up.run(x, gate_up_view, opts)?;
    let mut act = vec![T::ZERO; tokens * width / 2];
    activation::silu_and_mul(
        ArrayView2::from_shape((tokens, width), &gate_up[..]).map_err(bad_shape)?,
        ArrayViewMut2::from_shape((tokens, width / 2), &mut act[..]).map_err(bad_shape)?,
        opts.num_threads,
    )?;
    let mut y = vec![T::ZERO; tokens * hidden];
    shared.down.run(
        ArrayView2::from_shape((tokens, width / 2), &act[..]).map_err(bad_shape)?,
        ArrayViewMut2::from_shape((tokens, hidden), &mut y[..]).map_err(bad_shape)?,
        opts,
    )?;
    for ((o, y), g) in out
        .chunks_exact_mut(hidden)
        .zip(y.chunks_exact(hidden))
        .zip(&gate)
    {
        let g = T::round(1.0 / (1.0 + (-g.to_f32()).exp()));
        o.iter_mut()
            .zip(y)
            .for_each(|(o, y)| *o = T::from_f32(o.to_f32() + T::round(g * y.to_f32())));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::route;

    #[test]
    fn routing_keeps_the_largest_probabilities_renormalized_in_descending_order() {
        let logits = [0.0f32, 2.0, 1.0, -1.0, 2.0, 0.5, 0.5, 0.5];
        let (w, ids) = route(&logits, 4, 2, true);
        // token 0: experts 1 then 2; token 1: expert 0 (2.0), then of the tied 1, 2, 3 at 0.5
        // the one torch.topk picks, 2
        assert_eq!(ids, vec![1, 2, 0, 2]);
        let p = |a: f32, b: f32| 1.0 / (1.0 + (b - a).exp());
        assert!((w[0] - p(2.0, 1.0)).abs() < 1e-6 && (w[1] - p(1.0, 2.0)).abs() < 1e-6);
        assert!((w[2] + w[3] - 1.0).abs() < 1e-6);
        let (w, _) = route(&logits[..4], 4, 1, false);
        let sum: f32 = [0.0f32, 2.0, 1.0, -1.0].iter().map(|v| v.exp()).sum();
        assert!((w[0] - 2.0f32.exp() / sum).abs() < 1e-6);
    }
}
