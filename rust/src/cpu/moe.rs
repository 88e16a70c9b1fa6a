//! Mixture-of-experts MLP on the CPU: a step's tokens grouped by expert, each chosen expert's
//! SwiGLU weights streamed once for all its tokens.
//!
//! Each expert's gate/up `[2I, H]` (gate rows, then up rows) and down `[H, I]` weights are
//! stored as the linear kernel's column panels (`linear.rs`), stacked over the experts. A call
//! counts the tokens per expert and sorts the `(token, choice)` pairs by expert (a counting
//! sort: within an expert, tokens in batch order), gathers the rows, and runs, on the kernels'
//! pool: every chosen expert's gate/up product over its rows (one pool call: the work items are
//! runs of panels of every chosen expert, claimed by whichever thread is free), SwiGLU's
//! activation, every chosen expert's down product (one pool call), then each token's weighted
//! sum over its experts in ascending expert order (transformers' order), in f32, rounded once
//! into `out`. An expert no token chose is never read: at decode a token streams exactly its
//! `k` experts' bytes. A choice `NOT_HELD` (an expert another expert-parallel rank holds) adds
//! nothing here: that rank adds its term.
//!
//! The float path (`moe_experts`) runs the chosen experts in batches of at most `BATCH_ROWS`
//! grouped rows (ascending experts; at decode one batch): gather, both products and the
//! activation of a batch over buffers the calling thread keeps between calls, then each token's
//! terms of the batch added to an f32 accumulator in expert order, so the sums are the same bits
//! as one batch. A 1,024-token prefill of a top-8 model (8,192 rows) otherwise allocated, faulted
//! in and freed ~90 MB a layer: a quarter of the step in the kernel (round 14).
//!
//! `moe_quant_experts` is the same grouping over experts kept in their GGUF types (`QuantLayout`:
//! every expert's row segments placed in a few byte buffers, the file's mapped tensors as they are): each chosen expert's rows through the
//! quantized products (`quant::quant_linear_with`), the activation and the weighted sum as above;
//! at one token the chosen experts' gate/up rows are one product.
//!
//! Each expert's panels may be grouped (`linear::panel_group`: bf16 at AVX-512 BF16), the
//! array's last axis then `PANEL_GROUP` panels wide (`[E, P / G, K, G * PANEL]`, each group
//! `[K / 2, G, PANEL, 2]`): a decode tile then streams a group of panels as one run of memory,
//! the same products in the same order.
//!
//! The products are `linear.rs`'s tiles (`linear::run`), so a row's result does not depend on
//! the batch it runs in, and bf16 rounds where torch's bf16 ops round (gate/up output, the
//! activation, the down output). At AVX-512 BF16 those tiles take bf16 weights with `vdpbf16ps`
//! (linear.rs): an own pair of tiles here was slower on the experts' 1-8 rows (64 tokens of the
//! benches' 64-expert model: 17.2 against 14.5 ms a layer, benches/RESULTS.md, MoE round 6).
use std::ops::Range;
use std::sync::Mutex;

use ndarray::{ArrayView2, ArrayView4, ArrayViewMut2};

use super::activation::silu_and_mul;
use super::elem::Elem;
use super::invalid;
use super::linear::{self, Ctx, PANEL};
use super::pool;
use super::quant::{quant_linear_with, Activations, QType, QuantMatrix, Segment, DECODE_MAX_ROWS};
use crate::error::Result;

/// The expert id of a choice this call skips: the expert is another expert-parallel rank's.
pub const NOT_HELD: i64 = -1;
/// `row_of` of a skipped choice.
const NO_ROW: usize = usize::MAX;

/// Below this many weight elements a work item, a worker thread costs more than it saves
/// (`linear.rs`'s rule).
const MIN_SHARE_ELEMS: usize = 1 << 16;
/// Runs of panels per thread and product, claimed by whichever thread is free.
const CHUNKS_PER_THREAD: usize = 4;
/// Output elements per thread below which the weighted sum runs on the calling thread alone.
const MIN_SUM_PER_THREAD: usize = 1 << 16;

/// `out[t] = sum_j weights[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t]))` with `e = ids[t, j]`,
/// for x `[M, H]`, the experts' gate/up panels `[E, ceil(2I / PANEL), H, PANEL]` and down panels
/// `[E, ceil(H / PANEL), I, PANEL]` (either in groups where `linear::panel_group` says so: `[E,
/// P / G, K, G * PANEL]`, each expert's as `linear::group_panels` lays them out), expert ids (in
/// `0..E`, or `NOT_HELD`: skipped) and f32 weights `[M, K]`. All contiguous; `num_threads`
/// threads at most.
pub fn moe_experts<T: Elem>(
    x: ArrayView2<T>,
    gate_up: ArrayView4<T>,
    down: ArrayView4<T>,
    ids: ArrayView2<i64>,
    weights: ArrayView2<f32>,
    out: ArrayViewMut2<T>,
    num_threads: usize,
) -> Result<()> {
    experts_in_batches(x, gate_up, down, ids, weights, out, num_threads, BATCH_ROWS)
}

/// `moe_experts` with the chosen experts run in batches of at most `batch_rows` grouped rows
/// (`Groups::batches`): the buffers are a batch's, the sums the same bits for any batch size.
#[allow(clippy::too_many_arguments)]
fn experts_in_batches<T: Elem>(
    x: ArrayView2<T>,
    gate_up: ArrayView4<T>,
    down: ArrayView4<T>,
    ids: ArrayView2<i64>,
    weights: ArrayView2<f32>,
    mut out: ArrayViewMut2<T>,
    num_threads: usize,
    batch_rows: usize,
) -> Result<()> {
    let Shape {
        experts,
        hidden,
        width,
        k,
        groups: (gate_up_group, down_group),
    } = check_shapes(&x, &gate_up, &down, &ids, &weights, &out)?;
    let x = x
        .to_slice()
        .ok_or_else(|| invalid("x must be contiguous"))?;
    let gate_up = gate_up
        .to_slice()
        .ok_or_else(|| invalid("gate_up panels must be contiguous"))?;
    let down = down
        .to_slice()
        .ok_or_else(|| invalid("down panels must be contiguous"))?;
    let ids = ids
        .to_slice()
        .ok_or_else(|| invalid("ids must be contiguous"))?;
    let weights = weights
        .to_slice()
        .ok_or_else(|| invalid("weights must be contiguous"))?;
    let out = out
        .as_slice_mut()
        .ok_or_else(|| invalid("out must be contiguous"))?;
    if out.is_empty() || width == 0 {
        out.fill(T::ZERO);
        return Ok(());
    }
    let groups = Groups::of(ids, k, experts)?;
    let threads = num_threads.max(1);
    if groups.rows() == 0 {
        out.fill(T::ZERO); // every choice is another rank's expert
        return Ok(());
    }
    let tokens = out.len() / hidden;
    // each token's pairs in ascending expert order (ties: choice order), the weighted sum's
    let mut ordered: Vec<usize> = (0..ids.len()).collect();
    for pairs in ordered.chunks_exact_mut(k) {
        pairs.sort_by_key(|&p| ids[p]);
    }
    MOE_SCRATCH.with(|scratch| -> Result<()> {
        let mut scratch = scratch.borrow_mut();
        let Buffers {
            xs,
            gate_ups,
            acts,
            widened,
            ys,
            acc,
        } = &mut *scratch;
        let acc = words(acc, tokens * hidden);
        acc.fill(0.0);
        let batches = groups.batches(batch_rows);
        for (b, batch) in batches.iter().enumerate() {
            let rows = batch.rows.len();
            // gate/up of the batch's experts over their rows, then the activation
            let xs = words(xs, rows * hidden);
            groups.gather_rows(x, hidden, batch.rows.clone(), xs);
            let gate_ups = typed::<T>(gate_ups, rows * 2 * width);
            let gate_up_dims = Dims {
                k: hidden,
                n: 2 * width,
                group: gate_up_group,
            };
            groups.products(batch, xs, gate_up, gate_up_dims, gate_ups, threads);
            let acts = typed::<T>(acts, rows * width);
            silu_and_mul(
                ArrayView2::from_shape((rows, 2 * width), &*gate_ups)
                    .map_err(|e| invalid(e.to_string()))?,
                ArrayViewMut2::from_shape((rows, width), &mut *acts)
                    .map_err(|e| invalid(e.to_string()))?,
                threads,
            )?;
            // down of the batch's experts over their activations
            let acts: &[f32] = match T::as_f32_mut(acts) {
                Some(acts) => acts,
                None => {
                    let widened = words(widened, rows * width);
                    widened
                        .iter_mut()
                        .zip(acts.iter())
                        .for_each(|(w, a)| *w = a.to_f32());
                    widened
                }
            };
            let ys = typed::<T>(ys, rows * hidden);
            let down_dims = Dims {
                k: width,
                n: hidden,
                group: down_group,
            };
            groups.products(batch, acts, down, down_dims, ys, threads);
            let sum = Sum {
                ys,
                first_row: batch.rows.start,
                ordered: &ordered,
                weights,
                hidden,
            };
            let last = b + 1 == batches.len();
            groups.add_weighted(&sum, acc, last.then_some(&mut *out), threads);
        }
        Ok(())
    })?;
    trim_scratch();
    Ok(())
}

/// Rows of the grouped buffers a batch of experts runs at most (an expert with more rows is a
/// batch alone): a 1,024-token prefill's 8,192 rows of a top-8 model run in batches whose
/// buffers stay a few MB and are reused (`MOE_SCRATCH`) instead of ~90 MB allocated, faulted in
/// and freed per layer.
const BATCH_ROWS: usize = 1024;
/// A thread keeps its experts' scratch buffers between calls up to this many bytes.
const SCRATCH_KEEP_BYTES: usize = 64 << 20;

/// The float path's buffers, as f32 words (`typed` views them as the element type).
#[derive(Default)]
struct Buffers {
    xs: Vec<f32>,
    gate_ups: Vec<f32>,
    acts: Vec<f32>,
    widened: Vec<f32>,
    ys: Vec<f32>,
    acc: Vec<f32>,
}

impl Buffers {
    fn bytes(&self) -> usize {
        [
            &self.xs,
            &self.gate_ups,
            &self.acts,
            &self.widened,
            &self.ys,
            &self.acc,
        ]
        .iter()
        .map(|v| v.capacity() * 4)
        .sum()
    }
}

thread_local! {
    static MOE_SCRATCH: std::cell::RefCell<Buffers> = std::cell::RefCell::default();
}

/// Drops the calling thread's scratch where a call left more than `SCRATCH_KEEP_BYTES` of it.
fn trim_scratch() {
    MOE_SCRATCH.with(|scratch| {
        let mut scratch = scratch.borrow_mut();
        if scratch.bytes() > SCRATCH_KEEP_BYTES {
            *scratch = Buffers::default();
        }
    });
}

/// The first `len` words of `buf`, grown (zero-filled) where it is shorter.
fn words(buf: &mut Vec<f32>, len: usize) -> &mut [f32] {
    if buf.len() < len {
        buf.resize(len, 0.0);
    }
    &mut buf[..len]
}

/// The first `len` elements of `T` over `buf`'s words (grown where it is shorter).
fn typed<T: Elem>(buf: &mut Vec<f32>, len: usize) -> &mut [T] {
    assert!(
        std::mem::align_of::<T>() <= std::mem::align_of::<f32>()
            && std::mem::size_of::<T>() <= std::mem::size_of::<f32>()
    );
    let words = words(buf, (len * std::mem::size_of::<T>()).div_ceil(4));
    // SAFETY: the words hold at least `len` elements of T (no larger than, and aligned no more
    // strictly than, f32: asserted), every bit pattern is a valid T (f32 or `Bf16`'s u16), and
    // the slice borrows `buf` exclusively for its lifetime.
    unsafe { std::slice::from_raw_parts_mut(words.as_mut_ptr().cast::<T>(), len) }
}

/// Where one held expert's row segment lies: its type and rows, and its first byte (a buffer of
/// the layout and an offset in it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Placed {
    pub qtype: QType,
    pub rows: usize,
    pub buffer: usize,
    pub offset: usize,
}

/// Every held expert's quantized gate/up `[2I, H]` (gate rows, then up rows) and down `[H, I]`
/// weights as row segments placed in a few byte buffers: the GGUF file's stacked
/// `ffn_{gate,up,down}_exps` tensors as they are mapped (each expert's rows a contiguous block of
/// them; nothing copied, the page cache shared by every process mapping the file), or a copy
/// where the segments are scattered (experts sliced for tensor parallelism). A call borrows the
/// few buffers, not a segment array per expert (3 x 64 borrows a layer cost ~7 % of a Q8_0
/// decode step, MoE round 7).
#[derive(Debug)]
pub struct QuantLayout {
    gate_up: Vec<Vec<Placed>>,
    down: Vec<Vec<Placed>>,
    buffers: Vec<usize>,
    hidden: usize,
    width: usize,
}

impl QuantLayout {
    /// The layout of `gate_up[e]` / `down[e]` (expert `e`'s segments, in row order) over buffers
    /// of `buffers[b]` bytes; `hidden` = H. An error names an expert whose rows do not make
    /// `[2I, H]` and `[H, I]` with the same I as expert 0's, or a segment outside its buffer.
    pub fn new(
        buffers: &[usize],
        gate_up: &[Vec<Placed>],
        down: &[Vec<Placed>],
        hidden: usize,
    ) -> Result<Self> {
        let rows = |experts: &[Vec<Placed>]| -> Vec<usize> {
            experts
                .iter()
                .map(|s| s.iter().map(|p| p.rows).sum())
                .collect()
        };
        let width = expert_width(&rows(gate_up), &rows(down), hidden)?;
        for (what, experts, k) in [("gate/up", gate_up, hidden), ("down", down, width)] {
            for (e, segments) in experts.iter().enumerate() {
                for s in segments {
                    let end = s.offset + s.rows * s.qtype.row_bytes(k)?;
                    if buffers.get(s.buffer).is_none_or(|&size| end > size) {
                        return Err(invalid(format!(
                            "expert {e}: a {what} segment of {} rows at byte {} of buffer {} \
                             lies outside the {} buffers ({buffers:?} bytes)",
                            s.rows,
                            s.offset,
                            s.buffer,
                            buffers.len()
                        )));
                    }
                }
            }
        }
        Ok(Self {
            gate_up: gate_up.to_vec(),
            down: down.to_vec(),
            buffers: buffers.to_vec(),
            hidden,
            width,
        })
    }

    /// Bytes of each buffer.
    pub fn buffers(&self) -> &[usize] {
        &self.buffers
    }

    pub fn hidden(&self) -> usize {
        self.hidden
    }

    /// The layout over its buffers; an error if they are not its sizes.
    pub fn over<'a>(&'a self, buffers: Vec<&'a [u8]>) -> Result<QuantExperts<'a>> {
        let sizes: Vec<usize> = buffers.iter().map(|b| b.len()).collect();
        if sizes != self.buffers {
            return Err(invalid(format!(
                "the experts' buffers hold {sizes:?} bytes, their layout {:?}",
                self.buffers
            )));
        }
        Ok(QuantExperts {
            layout: self,
            buffers,
        })
    }
}

/// I, the experts' width, from each expert's gate/up and down rows; an error for unequal numbers
/// of experts, or naming an expert whose rows are not `2I` and `H` with expert 0's I.
fn expert_width(gate_up: &[usize], down: &[usize], hidden: usize) -> Result<usize> {
    if gate_up.len() != down.len() {
        return Err(invalid(format!(
            "{} gate/up and {} down weights: one of each per expert",
            gate_up.len(),
            down.len()
        )));
    }
    let width = gate_up.first().map_or(0, |g| g / 2);
    for (e, (&g, &d)) in gate_up.iter().zip(down).enumerate() {
        if (g, d) != (2 * width, hidden) {
            return Err(invalid(format!(
                "expert {e}: gate/up has {g} rows and down {d}, expected {} (2I, I = {width} as \
                 expert 0's) and {hidden} (H)",
                2 * width
            )));
        }
    }
    Ok(width)
}

/// A `QuantLayout` over its buffers (`QuantLayout::over`).
pub struct QuantExperts<'a> {
    layout: &'a QuantLayout,
    buffers: Vec<&'a [u8]>,
}

impl<'a> QuantExperts<'a> {
    pub fn count(&self) -> usize {
        self.layout.gate_up.len()
    }

    /// Expert `e`'s gate/up (`down == false`) or down segments.
    fn segments(&self, e: usize, down: bool) -> impl Iterator<Item = Segment<'a>> + '_ {
        let (placed, k) = if down {
            (&self.layout.down[e], self.layout.width)
        } else {
            (&self.layout.gate_up[e], self.layout.hidden)
        };
        placed.iter().map(move |p| {
            // row_bytes was Ok for this type and k, and the segment inside its buffer, when the
            // layout was made
            let len = p.rows * p.qtype.row_bytes(k).unwrap_or(0);
            Segment {
                qtype: p.qtype,
                data: &self.buffers[p.buffer][p.offset..p.offset + len],
                rows: p.rows,
            }
        })
    }

    /// Expert `e`'s gate/up (`down == false`) or down weight.
    fn matrix(&self, e: usize, down: bool) -> Result<QuantMatrix<'a>> {
        let k = if down {
            self.layout.width
        } else {
            self.layout.hidden
        };
        QuantMatrix::new(self.segments(e, down).collect(), k)
    }
}

/// `moe_experts` for float32 x `[M, H]` over quantized experts; ids (in `0..E` or `NOT_HELD`)
/// and weights `[M, K]`; the products multiply x as `activations` says. At one token the chosen
/// experts' gate/up rows are one product (x quantized once, one split over the threads).
#[allow(clippy::too_many_arguments)]
pub fn moe_quant_experts(
    x: ArrayView2<f32>,
    experts: &QuantExperts<'_>,
    ids: ArrayView2<i64>,
    weights: ArrayView2<f32>,
    mut out: ArrayViewMut2<f32>,
    num_threads: usize,
    activations: Activations,
) -> Result<()> {
    let (m, hidden) = x.dim();
    let width = experts.layout.width;
    if hidden != experts.layout.hidden {
        return Err(invalid(format!(
            "x has {hidden} columns, the experts take {}",
            experts.layout.hidden
        )));
    }
    if ids.nrows() != m || weights.dim() != ids.dim() || out.dim() != (m, hidden) {
        return Err(invalid(format!(
            "ids {:?}, weights {:?} and out {:?} must be [{m}, k], [{m}, k] and [{m}, {hidden}]",
            ids.shape(),
            weights.shape(),
            out.shape()
        )));
    }
    let contiguous = || invalid("x, ids, weights and out must be contiguous");
    let x = x.to_slice().ok_or_else(contiguous)?;
    let ids = ids.to_slice().ok_or_else(contiguous)?;
    let weights = weights.to_slice().ok_or_else(contiguous)?;
    let out = out.as_slice_mut().ok_or_else(contiguous)?;
    let groups = Groups::of(ids, ids.len() / m.max(1), experts.count())?;
    let rows = groups.rows();
    if rows == 0 || width == 0 {
        out.fill(0.0);
        return Ok(());
    }
    let threads = num_threads.max(1);
    let mut gate_ups = vec![0.0f32; rows * 2 * width];
    if m == 1
        && groups
            .chosen()
            .all(|e| groups.starts[e + 1] - groups.starts[e] == 1)
    {
        // one token, each chosen expert once: its rows of gate_ups in expert order are the
        // chosen experts' gate/up weights stacked, times x
        let stacked: Vec<Segment<'_>> = groups
            .chosen()
            .flat_map(|e| experts.segments(e, false))
            .collect();
        let w = QuantMatrix::new(stacked, hidden)?;
        let y = ArrayViewMut2::from_shape((1, rows * 2 * width), &mut gate_ups[..])
            .map_err(|e| invalid(e.to_string()))?;
        let x = ArrayView2::from_shape((1, hidden), x).map_err(|e| invalid(e.to_string()))?;
        quant_linear_with(x, &w, None, y, threads, activations)?;
    } else {
        let xs = groups.gather(x, hidden);
        groups.quant_products(
            &xs,
            |e| experts.matrix(e, false),
            &mut gate_ups,
            threads,
            activations,
        )?;
    }
    let mut acts = vec![0.0f32; rows * width];
    silu_and_mul(
        ArrayView2::from_shape((rows, 2 * width), &gate_ups[..])
            .map_err(|e| invalid(e.to_string()))?,
        ArrayViewMut2::from_shape((rows, width), &mut acts[..])
            .map_err(|e| invalid(e.to_string()))?,
        threads,
    )?;
    let mut ys = vec![0.0f32; rows * hidden];
    groups.quant_products(
        &acts,
        |e| experts.matrix(e, true),
        &mut ys,
        threads,
        activations,
    )?;
    groups.weighted_sum(&ys, ids, weights, hidden, out, threads);
    Ok(())
}

struct Shape {
    experts: usize,
    hidden: usize,
    width: usize,
    /// Experts per token.
    k: usize,
    /// Panels per group of gate/up and of down (1: plain panels).
    groups: (usize, usize),
}

/// The panels per group of a stacked panel array `[E, P / G, k, G * PANEL]` of a weight with
/// `n` output columns (`linear::grouping`).
fn grouping<T: Elem>(dims: (usize, usize, usize, usize), n: usize, k: usize) -> Option<usize> {
    let (_, groups, depth, width) = dims;
    linear::grouping::<T>((groups, depth, width), n, k)
}

fn check_shapes<T: Elem>(
    x: &ArrayView2<T>,
    gate_up: &ArrayView4<T>,
    down: &ArrayView4<T>,
    ids: &ArrayView2<i64>,
    weights: &ArrayView2<f32>,
    out: &ArrayViewMut2<T>,
) -> Result<Shape> {
    let (m, hidden) = x.dim();
    let (experts, _, width, _) = down.dim();
    let Some(down_group) = grouping::<T>(down.dim(), hidden, width) else {
        return Err(invalid(format!(
            "down panels have shape {:?}, expected [experts, {}, I, {PANEL}] (x has {hidden} \
             columns), or those panels in groups (`panel_group`)",
            down.shape(),
            hidden.div_ceil(PANEL)
        )));
    };
    let gate_up_group = grouping::<T>(gate_up.dim(), 2 * width, hidden);
    let Some(gate_up_group) = gate_up_group.filter(|_| gate_up.dim().0 == experts) else {
        let want = (experts, (2 * width).div_ceil(PANEL), hidden, PANEL);
        return Err(invalid(format!(
            "gate_up panels have shape {:?}, expected {want:?} (down's experts and width I = \
             {width}, x's {hidden} columns), or those panels in groups (`panel_group`)",
            gate_up.shape()
        )));
    };
    if ids.nrows() != m || weights.dim() != ids.dim() {
        return Err(invalid(format!(
            "ids {:?} and weights {:?} must both be [{m}, k] (x's rows)",
            ids.shape(),
            weights.shape()
        )));
    }
    if out.dim() != (m, hidden) {
        return Err(invalid(format!(
            "out has shape {:?}, expected x's [{m}, {hidden}]",
            out.shape()
        )));
    }
    Ok(Shape {
        experts,
        hidden,
        width,
        k: ids.ncols(),
        groups: (gate_up_group, down_group),
    })
}

/// A product's inner (`k`) and output (`n`) sizes, and its panels per group.
#[derive(Clone, Copy)]
struct Dims {
    k: usize,
    n: usize,
    group: usize,
}

/// The `(token, choice)` pairs of a call (pair `p = t * k + j`) sorted by expert, stably (batch
/// order within an expert): pair `p` is row `row_of[p]` of the grouped buffers, and expert `e`'s
/// rows are `starts[e]..starts[e + 1]`. A skipped pair (`NOT_HELD`) has no row (`NO_ROW`).
struct Groups {
    k: usize,
    starts: Vec<usize>,
    row_of: Vec<usize>,
}

/// A run of chosen experts (ascending) whose rows of the grouped buffers are `rows`.
struct Batch {
    experts: Vec<usize>,
    rows: Range<usize>,
}

/// A batch's expert outputs `ys` (its rows, from grouped row `first_row`) to add to the tokens'
/// sums: each token's pairs in the order its terms are added (`ordered`), their weights.
struct Sum<'a, T> {
    ys: &'a [T],
    first_row: usize,
    ordered: &'a [usize],
    weights: &'a [f32],
    hidden: usize,
}

impl Groups {
    fn of(ids: &[i64], k: usize, experts: usize) -> Result<Self> {
        let mut starts = vec![0usize; experts + 1];
        for &id in ids.iter().filter(|&&id| id != NOT_HELD) {
            let e = usize::try_from(id)
                .ok()
                .filter(|&e| e < experts)
                .ok_or_else(|| invalid(format!("expert id {id} is outside 0..{experts}")))?;
            starts[e + 1] += 1;
        }
        for e in 0..experts {
            starts[e + 1] += starts[e];
        }
        let mut next = starts[..experts].to_vec();
        let row_of = ids
            .iter()
            .map(|&id| {
                if id == NOT_HELD {
                    return NO_ROW;
                }
                let e = id as usize; // in 0..experts: checked above
                next[e] += 1;
                next[e] - 1
            })
            .collect();
        Ok(Self { k, starts, row_of })
    }

    fn rows(&self) -> usize {
        self.starts[self.starts.len() - 1]
    }

    /// The chosen experts in ascending order, cut into runs of at most `most` rows (an expert
    /// with more rows is a run alone).
    fn batches(&self, most: usize) -> Vec<Batch> {
        let mut batches: Vec<Batch> = Vec::new();
        for e in self.chosen() {
            let (first, end) = (self.starts[e], self.starts[e + 1]);
            match batches.last_mut() {
                Some(b) if end - b.rows.start <= most => {
                    b.experts.push(e);
                    b.rows.end = end;
                }
                _ => batches.push(Batch {
                    experts: vec![e],
                    rows: first..end,
                }),
            }
        }
        batches
    }

    /// The grouped rows `rows` of x widened to f32 into `xs` (`[rows.len(), hidden]`).
    fn gather_rows<T: Elem>(&self, x: &[T], hidden: usize, rows: Range<usize>, xs: &mut [f32]) {
        for (p, &row) in self.row_of.iter().enumerate() {
            if !rows.contains(&row) {
                continue; // another batch's row, or NO_ROW
            }
            let t = p / self.k;
            let src = &x[t * hidden..(t + 1) * hidden];
            let at = row - rows.start;
            for (d, s) in xs[at * hidden..(at + 1) * hidden].iter_mut().zip(src) {
                *d = s.to_f32();
            }
        }
    }

    /// x's rows widened to f32 in grouped order `[rows, hidden]`.
    fn gather<T: Elem>(&self, x: &[T], hidden: usize) -> Vec<f32> {
        let mut xs = vec![0.0f32; self.rows() * hidden];
        for (p, &row) in self.row_of.iter().enumerate() {
            if row == NO_ROW {
                continue;
            }
            let t = p / self.k;
            let src = &x[t * hidden..(t + 1) * hidden];
            for (d, s) in xs[row * hidden..(row + 1) * hidden].iter_mut().zip(src) {
                *d = s.to_f32();
            }
        }
        xs
    }

    /// `out[rows of e] = input[rows of e] · W_e^T` for every expert of `batch` (`panels`: every
    /// expert's `[ceil(n / PANEL), k, PANEL]`, stacked; `input` and `out` the batch's rows), in
    /// one pool call whose items are runs of one expert's panels. Other experts are not read.
    fn products<T: Elem>(
        &self,
        batch: &Batch,
        input: &[f32],
        panels: &[T],
        dims: Dims,
        out: &mut [T],
        threads: usize,
    ) {
        let Dims { k, n, group } = dims;
        let num_panels = n.div_ceil(PANEL);
        let per_expert = num_panels * k * PANEL;
        let base = out.as_mut_ptr();
        let products: Vec<Ctx<'_, T>> = batch
            .experts
            .iter()
            .map(|&e| {
                let first = self.starts[e] - batch.rows.start;
                let end = self.starts[e + 1] - batch.rows.start;
                // SAFETY: each expert's product writes only its own rows first..end of out
                // `[rows, n]` (the groups are disjoint), and `out`'s exclusive borrow is held
                // until the pool call below has returned.
                unsafe {
                    Ctx::new(
                        &input[first * k..end * k],
                        &panels[e * per_expert..(e + 1) * per_expert],
                        group,
                        base.add(first * n),
                        end - first,
                        k,
                        n,
                    )
                }
            })
            .collect();
        // runs of panels: a few per thread over all the products, at least MIN_SHARE_ELEMS each,
        // whole groups (a run starting inside a group would read it as separate streams)
        let per_share = (MIN_SHARE_ELEMS / (k * PANEL).max(1)).max(1);
        let chunk = (products.len() * num_panels)
            .div_ceil(threads * CHUNKS_PER_THREAD)
            .max(per_share)
            .next_multiple_of(group);
        let runs_per_product = num_panels.div_ceil(chunk);
        let items = products.len() * runs_per_product;
        let run = |i: usize| {
            let (product, run) = (i / runs_per_product, i % runs_per_product);
            let panels = run * chunk..((run + 1) * chunk).min(num_panels);
            linear::run(&products[product], panels);
        };
        if threads == 1 || items == 1 {
            (0..items).for_each(run);
        } else {
            pool::WORKERS.run_claimed(threads, items, run);
        }
    }

    /// The experts with rows, in ascending order.
    fn chosen(&self) -> impl Iterator<Item = usize> + '_ {
        (0..self.starts.len() - 1).filter(|&e| self.starts[e + 1] > self.starts[e])
    }

    /// `products` over quantized weights: each chosen expert's rows through `weight(e)` (whose
    /// rows are the output's `n` columns). Where every expert has decode rows (at most
    /// `quant::DECODE_MAX_ROWS`: a product that small takes the decode path) and there are at
    /// least `2 * threads` experts, one pool call whose items are whole experts on one thread
    /// each (a split of every expert over the threads cost a pool call per expert); otherwise
    /// one expert after another, each on up to `threads` threads. A row's result is the same
    /// either way.
    fn quant_products<'w>(
        &self,
        input: &[f32],
        weight: impl Fn(usize) -> Result<QuantMatrix<'w>> + Sync,
        out: &mut [f32],
        threads: usize,
        activations: Activations,
    ) -> Result<()> {
        let chosen: Vec<usize> = self.chosen().collect();
        let rows = |e: usize| self.starts[e + 1] - self.starts[e];
        let k = input.len() / self.rows().max(1);
        let n = out.len() / self.rows().max(1);
        let product = |e: usize, y: &mut [f32], threads: usize| -> Result<()> {
            let first = self.starts[e];
            let w = weight(e)?;
            let x = ArrayView2::from_shape((rows(e), k), &input[first * k..(first + rows(e)) * k])
                .map_err(|err| invalid(err.to_string()))?;
            let y = ArrayViewMut2::from_shape((rows(e), n), y)
                .map_err(|err| invalid(err.to_string()))?;
            quant_linear_with(x, &w, None, y, threads, activations)
        };
        let by_expert = chosen.iter().all(|&e| rows(e) <= DECODE_MAX_ROWS);
        if threads == 1 || !by_expert || chosen.len() < 2 * threads {
            for &e in &chosen {
                let first = self.starts[e];
                product(e, &mut out[first * n..(first + rows(e)) * n], threads)?;
            }
            return Ok(());
        }
        // each expert's rows of out, in expert order (the groups are contiguous)
        let mut parts = Vec::with_capacity(chosen.len());
        let mut rest = out;
        for &e in &chosen {
            let (part, tail) = rest.split_at_mut(rows(e) * n);
            parts.push(Mutex::new(part));
            rest = tail;
        }
        let failed = Mutex::new(None);
        pool::WORKERS.run_claimed(threads, chosen.len(), |i| {
            let mut y = parts[i].lock().unwrap_or_else(|e| e.into_inner());
            if let Err(err) = product(chosen[i], &mut y, 1) {
                *failed.lock().unwrap_or_else(|e| e.into_inner()) = Some(err);
            }
        });
        match failed.into_inner().unwrap_or_else(|e| e.into_inner()) {
            Some(err) => Err(err),
            None => Ok(()),
        }
    }

    /// `acc[t] += weights[t, j] * ys[row of (t, j)]` for the pairs whose rows `sum` holds, in
    /// `sum.ordered`'s order, in f32; with `out`, then `out[t] = acc[t]` rounded once. Batches
    /// added in ascending expert order give `weighted_sum`'s sums, bit for bit.
    fn add_weighted<T: Elem>(
        &self,
        sum: &Sum<'_, T>,
        acc: &mut [f32],
        out: Option<&mut [T]>,
        threads: usize,
    ) {
        let hidden = sum.hidden;
        let tokens = acc.len() / hidden;
        let rows = sum.first_row..sum.first_row + sum.ys.len() / hidden;
        let threads = threads.clamp(1, (tokens * hidden / MIN_SUM_PER_THREAD).max(1));
        let chunk_tokens = tokens.div_ceil(threads * CHUNKS_PER_THREAD).max(1);
        let accs: Vec<Mutex<&mut [f32]>> = acc
            .chunks_mut(chunk_tokens * hidden)
            .map(Mutex::new)
            .collect();
        let outs: Option<Vec<Mutex<&mut [T]>>> = out.map(|out| {
            out.chunks_mut(chunk_tokens * hidden)
                .map(Mutex::new)
                .collect()
        });
        let add_chunk = |c: usize| {
            let mut acc = accs[c].lock().unwrap_or_else(|e| e.into_inner());
            for (i, a) in acc.chunks_mut(hidden).enumerate() {
                let t = c * chunk_tokens + i;
                for &p in &sum.ordered[t * self.k..(t + 1) * self.k] {
                    let row = self.row_of[p];
                    if !rows.contains(&row) {
                        continue; // another batch's row, or NO_ROW
                    }
                    let w = sum.weights[p];
                    let y = &sum.ys[(row - rows.start) * hidden..(row - rows.start + 1) * hidden];
                    for (a, y) in a.iter_mut().zip(y) {
                        *a += w * y.to_f32();
                    }
                }
            }
            if let Some(outs) = &outs {
                let mut out = outs[c].lock().unwrap_or_else(|e| e.into_inner());
                for (d, a) in out.iter_mut().zip(acc.iter()) {
                    *d = T::from_f32(*a);
                }
            }
        };
        if threads == 1 {
            (0..accs.len()).for_each(add_chunk);
        } else {
            pool::WORKERS.run_claimed(threads, accs.len(), add_chunk);
        }
    }

    /// `out[t] = sum_j weights[t, j] * ys[row of (t, j)]`, the terms in ascending expert order
    /// (ties: choice order), summed in f32 and rounded once.
    fn weighted_sum<T: Elem>(
        &self,
        ys: &[T],
        ids: &[i64],
        weights: &[f32],
        hidden: usize,
        out: &mut [T],
        threads: usize,
    ) {
        let tokens = out.len() / hidden;
        let threads = threads.clamp(1, (tokens * hidden / MIN_SUM_PER_THREAD).max(1));
        let chunk_tokens = tokens.div_ceil(threads * CHUNKS_PER_THREAD).max(1);
        let chunks: Vec<Mutex<&mut [T]>> = out
            .chunks_mut(chunk_tokens * hidden)
            .map(Mutex::new)
            .collect();
        let sum_chunk = |c: usize| {
            let mut dst = chunks[c].lock().unwrap_or_else(|e| e.into_inner());
            let mut acc = vec![0.0f32; hidden];
            let mut order: Vec<usize> = Vec::with_capacity(self.k);
            for (i, row_out) in dst.chunks_mut(hidden).enumerate() {
                let t = c * chunk_tokens + i;
                let pairs = t * self.k..(t + 1) * self.k;
                order.clear();
                order.extend(pairs);
                order.sort_by_key(|&p| ids[p]);
                acc.fill(0.0);
                for &p in order.iter().filter(|&&p| self.row_of[p] != NO_ROW) {
                    let row = self.row_of[p];
                    let w = weights[p];
                    for (a, y) in acc.iter_mut().zip(&ys[row * hidden..(row + 1) * hidden]) {
                        *a += w * y.to_f32();
                    }
                }
                for (d, a) in row_out.iter_mut().zip(&acc) {
                    *d = T::from_f32(*a);
                }
            }
        };
        if threads == 1 {
            (0..chunks.len()).for_each(sum_chunk);
        } else {
            pool::WORKERS.run_claimed(threads, chunks.len(), sum_chunk);
        }
    }
}

#[cfg(test)]
mod tests {
    use ndarray::{Array2, Array4};

    use super::*;
    use crate::cpu::{pack_panels, Bf16};

    fn values(len: usize, seed: f32) -> Vec<f32> {
        (0..len)
            .map(|i| (i as f32 * 0.37 + seed).sin() * 0.5)
            .collect()
    }

    /// Expert weights `[E, N, K]` as stacked panels `[E, ceil(N / PANEL), K, PANEL]`.
    fn stacked_panels<T: Elem>(w: &[Vec<f32>], n: usize, k: usize) -> Array4<T> {
        let mut all = Vec::new();
        for e in w {
            let m = Array2::from_shape_vec((n, k), e.iter().map(|v| T::from_f32(*v)).collect())
                .unwrap();
            all.extend(pack_panels(m.view()));
        }
        Array4::from_shape_vec((w.len(), n.div_ceil(PANEL), k, PANEL), all).unwrap()
    }

    struct Case {
        m: usize,
        h: usize,
        i: usize,
        gate_up: Vec<Vec<f32>>,
        down: Vec<Vec<f32>>,
        x: Vec<f32>,
    }

    impl Case {
        fn new(m: usize, h: usize, i: usize, experts: usize) -> Self {
            Self {
                m,
                h,
                i,
                gate_up: (0..experts).map(|e| values(2 * i * h, e as f32)).collect(),
                down: (0..experts)
                    .map(|e| values(h * i, 50.0 + e as f32))
                    .collect(),
                x: values(m * h, 99.0),
            }
        }

        /// The f64 reference: per token, its experts' SwiGLU outputs weighted and summed.
        fn reference(&self, ids: &Array2<i64>, w: &Array2<f32>) -> Vec<f64> {
            let (h, i) = (self.h, self.i);
            let mut out = vec![0.0f64; self.m * h];
            for t in 0..self.m {
                let x = &self.x[t * h..(t + 1) * h];
                for j in 0..ids.ncols() {
                    let e = ids[[t, j]] as usize;
                    let dot = |row: &[f32]| -> f64 {
                        row.iter().zip(x).map(|(a, b)| *a as f64 * *b as f64).sum()
                    };
                    let gu = &self.gate_up[e];
                    let act: Vec<f64> = (0..i)
                        .map(|c| {
                            let g = dot(&gu[c * h..(c + 1) * h]);
                            let u = dot(&gu[(i + c) * h..(i + c + 1) * h]);
                            g / (1.0 + (-g).exp()) * u
                        })
                        .collect();
                    for o in 0..h {
                        let d = &self.down[e][o * i..(o + 1) * i];
                        let y: f64 = d.iter().zip(&act).map(|(a, b)| *a as f64 * b).sum();
                        out[t * h + o] += w[[t, j]] as f64 * y;
                    }
                }
            }
            out
        }

        fn run<T: Elem>(
            &self,
            gate_up: &Array4<T>,
            ids: &Array2<i64>,
            w: &Array2<f32>,
            threads: usize,
        ) -> Array2<T> {
            let x = Array2::from_shape_vec(
                (self.m, self.h),
                self.x.iter().map(|v| T::from_f32(*v)).collect(),
            )
            .unwrap();
            let down = stacked_panels::<T>(&self.down, self.h, self.i);
            let mut out = Array2::from_elem((self.m, self.h), T::ZERO);
            moe_experts(
                x.view(),
                gate_up.view(),
                down.view(),
                ids.view(),
                w.view(),
                out.view_mut(),
                threads,
            )
            .unwrap();
            out
        }
    }

    fn routing(m: usize, k: usize, experts: usize) -> (Array2<i64>, Array2<f32>) {
        let ids = Array2::from_shape_fn((m, k), |(t, j)| ((t * 3 + j * 5) % experts) as i64);
        let w = Array2::from_shape_fn((m, k), |(t, j)| 0.1 + ((t + j) % 7) as f32 * 0.1);
        (ids, w)
    }

    #[test]
    fn grouped_experts_match_the_per_token_reference_at_decode_and_prefill_sizes() {
        // 3 rows (direct tiles) and 40 rows (some experts over 16 rows: the blocked path);
        // widths that leave partial panels
        for (m, threads) in [(3, 1), (3, 2), (40, 1), (40, 3)] {
            let case = Case::new(m, 37, 21, 8);
            let (ids, w) = routing(m, 3, 8);
            let gate_up = stacked_panels::<f32>(&case.gate_up, 2 * case.i, case.h);
            let got = case.run(&gate_up, &ids, &w, threads);
            for (g, want) in got.iter().zip(case.reference(&ids, &w)) {
                assert!((*g as f64 - want).abs() < 1e-4, "{m} rows: {g} vs {want}");
            }
        }
    }

    #[test]
    fn experts_run_in_batches_of_any_rows_give_the_one_batch_bits() {
        // 40 tokens x 3 choices over 8 experts (15 rows an expert: direct tiles; batches of 1
        // expert, of a few, of all), one choice another rank's; f32 and bf16, 1 and 2 threads
        fn check<T: Elem + PartialEq + std::fmt::Debug>(case: &Case, threads: usize) {
            let (mut ids, w) = routing(case.m, 3, 8);
            ids[[5, 1]] = NOT_HELD;
            let gate_up = stacked_panels::<T>(&case.gate_up, 2 * case.i, case.h);
            let down = stacked_panels::<T>(&case.down, case.h, case.i);
            let x = Array2::from_shape_fn((case.m, case.h), |(t, c)| {
                T::from_f32(case.x[t * case.h + c])
            });
            let run = |batch_rows: usize| {
                let mut out = Array2::from_elem((case.m, case.h), T::ZERO);
                let (gate_up, down, ids, w) = (gate_up.view(), down.view(), ids.view(), w.view());
                let out_view = out.view_mut();
                experts_in_batches(
                    x.view(),
                    gate_up,
                    down,
                    ids,
                    w,
                    out_view,
                    threads,
                    batch_rows,
                )
                .unwrap();
                out
            };
            let whole = run(usize::MAX);
            for batch_rows in [1, 16, 40, 100] {
                assert_eq!(run(batch_rows), whole, "batches of {batch_rows} rows");
            }
        }
        let case = Case::new(40, 37, 21, 8);
        for threads in [1, 2] {
            check::<f32>(&case, threads);
            check::<Bf16>(&case, threads);
        }
    }

    #[test]
    fn experts_no_token_chose_are_never_read() {
        // experts 1, 3, 5, 7 hold NaN weights: no token chooses them, the output stays finite
        let case = Case::new(5, 24, 16, 8);
        let ids = Array2::from_shape_fn((5, 2), |(t, j)| (2 * ((t + j) % 4)) as i64);
        let w = Array2::from_elem((5, 2), 0.5f32);
        let mut gate_up = stacked_panels::<f32>(&case.gate_up, 2 * case.i, case.h);
        for e in [1, 3, 5, 7] {
            gate_up.index_axis_mut(ndarray::Axis(0), e).fill(f32::NAN);
        }
        let got = case.run(&gate_up, &ids, &w, 2);
        for (g, want) in got.iter().zip(case.reference(&ids, &w)) {
            assert!((*g as f64 - want).abs() < 1e-4, "{g} vs {want}");
        }
    }

    #[test]
    fn one_expert_chosen_by_every_token_is_one_product() {
        let case = Case::new(20, 32, 16, 4);
        let ids = Array2::from_shape_fn((20, 2), |(_, j)| if j == 0 { 2 } else { 0 });
        let w = Array2::from_elem((20, 2), 0.5f32);
        let gate_up = stacked_panels::<f32>(&case.gate_up, 2 * case.i, case.h);
        let got = case.run(&gate_up, &ids, &w, 2);
        for (g, want) in got.iter().zip(case.reference(&ids, &w)) {
            assert!((*g as f64 - want).abs() < 1e-4, "{g} vs {want}");
        }
    }

    #[test]
    fn a_row_does_not_depend_on_the_batch_it_runs_in() {
        let case = Case::new(12, 40, 24, 6);
        let (ids, w) = routing(12, 2, 6);
        let gate_up = stacked_panels::<f32>(&case.gate_up, 2 * case.i, case.h);
        let batch = case.run(&gate_up, &ids, &w, 2);
        for t in [0, 5, 11] {
            let mut one = Case::new(1, 40, 24, 6);
            one.x = case.x[t * 40..(t + 1) * 40].to_vec();
            let row = one.run(
                &gate_up,
                &ids.slice(ndarray::s![t..t + 1, ..]).to_owned(),
                &w.slice(ndarray::s![t..t + 1, ..]).to_owned(),
                1,
            );
            assert_eq!(row.row(0), batch.row(t), "token {t}");
        }
    }

    /// Stacked plain panels `[E, P, K, PANEL]` in groups of `g`: `[E, P / g, K, g * PANEL]`.
    fn grouped<T: Elem>(plain: &Array4<T>, g: usize) -> Array4<T> {
        let (e, p, k, _) = plain.dim();
        let flat = plain.as_slice().unwrap();
        let all: Vec<T> = flat
            .chunks_exact(p * k * PANEL)
            .flat_map(|expert| linear::group_panels(expert, k, g))
            .collect();
        Array4::from_shape_vec((e, p / g, k, g * PANEL), all).unwrap()
    }

    #[test]
    fn grouped_bf16_experts_give_the_plain_panels_bits_where_the_tiles_read_groups() {
        // one group of gate/up and of down panels an expert; decode rows (one tile, two
        // tiles over K slices) and a prefill's (the blocked path). Without AVX-512 BF16 such
        // panels are refused instead.
        let (h, i, experts) = (64, 32, 8);
        let reads_groups = linear::panel_group::<Bf16>(h / PANEL, i) == linear::PANEL_GROUP;
        let g = linear::PANEL_GROUP;
        for (m, k) in [(1, 2), (3, 8), (8, 2), (40, 4)] {
            let case = Case::new(m, h, i, experts);
            let (ids, w) = routing(m, k, experts);
            let x =
                Array2::from_shape_vec((m, h), case.x.iter().map(|v| Bf16::from_f32(*v)).collect())
                    .unwrap();
            let gate_up = stacked_panels::<Bf16>(&case.gate_up, 2 * i, h);
            let down = stacked_panels::<Bf16>(&case.down, h, i);
            let run = |gate_up: &Array4<Bf16>, down: &Array4<Bf16>| {
                let mut out = Array2::from_elem((m, h), Bf16::ZERO);
                let (x, ids, w) = (x.view(), ids.view(), w.view());
                moe_experts(x, gate_up.view(), down.view(), ids, w, out.view_mut(), 2)
                    .map(|()| out.mapv(|v| v.0))
            };
            let want = run(&gate_up, &down).unwrap();
            if !reads_groups {
                let err = run(&grouped(&gate_up, g), &down).unwrap_err().to_string();
                assert!(
                    err.contains("gate_up panels have shape [8, 1, 64, 64]"),
                    "{err}"
                );
                continue;
            }
            assert_eq!(
                run(&grouped(&gate_up, g), &grouped(&down, g)).unwrap(),
                want,
                "{m} tokens"
            );
            assert_eq!(
                run(&gate_up, &grouped(&down, g)).unwrap(),
                want,
                "{m} tokens, down grouped"
            );
        }
    }

    #[test]
    fn grouped_panels_the_tiles_do_not_read_are_refused() {
        // f32 tiles read plain panels only
        let case = Case::new(2, 64, 32, 2);
        let (ids, w) = routing(2, 1, 2);
        let gate_up = grouped(
            &stacked_panels::<f32>(&case.gate_up, 64, 64),
            linear::PANEL_GROUP,
        );
        let down = stacked_panels::<f32>(&case.down, 64, 32);
        let x = Array2::from_shape_vec((2, 64), case.x.clone()).unwrap();
        let mut out = Array2::zeros((2, 64));
        let (x, ids, w) = (x.view(), ids.view(), w.view());
        let err = moe_experts(x, gate_up.view(), down.view(), ids, w, out.view_mut(), 1)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("gate_up panels have shape [2, 1, 64, 64]"),
            "{err}"
        );
    }

    #[test]
    fn bf16_matches_the_reference_within_bf16_rounding() {
        // the inputs as bf16 holds them: what is left is the rounding of the intermediate
        // products (gate/up, activation, down), ~3 significant digits each
        let mut case = Case::new(6, 32, 16, 4);
        let round = |v: &mut Vec<f32>| v.iter_mut().for_each(|x| *x = Bf16::round(*x));
        round(&mut case.x);
        case.gate_up
            .iter_mut()
            .chain(case.down.iter_mut())
            .for_each(round);
        let (ids, w) = routing(6, 2, 4);
        let gate_up = stacked_panels::<Bf16>(&case.gate_up, 2 * case.i, case.h);
        let got = case.run(&gate_up, &ids, &w, 2);
        let want = case.reference(&ids, &w);
        let scale = want.iter().fold(0.0f64, |m, v| m.max(v.abs()));
        for (g, want) in got.iter().zip(want) {
            let g = g.to_f32() as f64;
            assert!(
                (g - want).abs() < 0.02 * scale,
                "{g} vs {want} (scale {scale})"
            );
        }
    }

    #[test]
    fn choices_not_held_add_nothing_and_their_experts_are_not_read() {
        // ranks holding experts 0..2 and 2..4 of the same 4: the two partial sums add up to the
        // whole, and neither rank reads the other's experts (NaN there)
        let case = Case::new(6, 24, 16, 4);
        let (ids, w) = routing(6, 2, 4);
        let whole = stacked_panels::<f32>(&case.gate_up, 2 * case.i, case.h);
        let want = case.reference(&ids, &w);
        let mut sum = vec![0.0f64; want.len()];
        for first in [0i64, 2] {
            let mut gate_up = whole.clone();
            for e in 0..4 {
                if !(first..first + 2).contains(&(e as i64)) {
                    gate_up.index_axis_mut(ndarray::Axis(0), e).fill(f32::NAN);
                }
            }
            let held = ids.mapv(|e| {
                if (first..first + 2).contains(&e) {
                    e
                } else {
                    NOT_HELD
                }
            });
            let got = case.run(&gate_up, &held, &w, 2);
            sum.iter_mut()
                .zip(got.iter())
                .for_each(|(s, g)| *s += *g as f64);
        }
        for (s, want) in sum.iter().zip(want) {
            assert!((s - want).abs() < 1e-4, "{s} vs {want}");
        }
    }

    /// Q8_0 bytes of a weight `[n, k]`, and the weight as they dequantize.
    fn q8_0(w: &[f32], n: usize, k: usize) -> (Vec<u8>, Vec<f32>) {
        use crate::cpu::quant::{self, QType};
        let mut bytes = Array2::<u8>::zeros((n, QType::Q8_0.row_bytes(k).unwrap()));
        let w = ndarray::ArrayView2::from_shape((n, k), w).unwrap();
        quant::quantize(w, QType::Q8_0, bytes.view_mut()).unwrap();
        let bytes = bytes.into_raw_vec_and_offset().0;
        let mut back = Array2::<f32>::zeros((n, k));
        quant::dequantize(&matrix(&bytes, n, k), back.view_mut()).unwrap();
        let back = back.into_raw_vec_and_offset().0;
        (bytes, back)
    }

    fn matrix(bytes: &[u8], n: usize, k: usize) -> QuantMatrix<'_> {
        use crate::cpu::quant::{QType, Segment};
        let segment = Segment {
            qtype: QType::Q8_0,
            data: bytes,
            rows: n,
        };
        QuantMatrix::new(vec![segment], k).unwrap()
    }

    /// The layout of segments `(type, rows)` back to back, expert after expert: gate/up in
    /// buffer 0, down in buffer 1.
    fn back_to_back(
        gate_up: &[Vec<(QType, usize)>],
        down: &[Vec<(QType, usize)>],
        hidden: usize,
    ) -> Result<QuantLayout> {
        let rows = |experts: &[Vec<(QType, usize)>]| -> Vec<usize> {
            experts
                .iter()
                .map(|s| s.iter().map(|p| p.1).sum())
                .collect()
        };
        let width = expert_width(&rows(gate_up), &rows(down), hidden)?;
        let lay = |experts: &[Vec<(QType, usize)>], buffer: usize, k: usize| {
            let mut offset = 0;
            let mut placed = Vec::with_capacity(experts.len());
            for segments in experts {
                let mut expert = Vec::with_capacity(segments.len());
                for &(qtype, rows) in segments {
                    expert.push(Placed {
                        qtype,
                        rows,
                        buffer,
                        offset,
                    });
                    offset += rows * qtype.row_bytes(k)?;
                }
                placed.push(expert);
            }
            Ok::<_, crate::error::Error>((placed, offset))
        };
        let (gate_up, gate_up_bytes) = lay(gate_up, 0, hidden)?;
        let (down, down_bytes) = lay(down, 1, width)?;
        QuantLayout::new(&[gate_up_bytes, down_bytes], &gate_up, &down, hidden)
    }

    /// Q8_0 experts: each one's gate/up `[2I, H]` bytes laid out as two segments (gate rows, up
    /// rows) and its down `[H, I]` as one, in two buffers.
    fn q8_0_layout(gate_up: &[Vec<u8>], down: &[Vec<u8>], h: usize, i: usize) -> QuantLayout {
        let gate_up_parts = vec![vec![(QType::Q8_0, i), (QType::Q8_0, i)]; gate_up.len()];
        let down_parts = vec![vec![(QType::Q8_0, h)]; down.len()];
        back_to_back(&gate_up_parts, &down_parts, h).unwrap()
    }

    /// The Q8_0 case: (the case on its dequantized weights, gate/up bytes, down bytes).
    fn q8_0_case(m: usize, h: usize, i: usize, experts: usize) -> (Case, Vec<u8>, Vec<u8>) {
        let mut case = Case::new(m, h, i, experts);
        let gate_up: Vec<(Vec<u8>, Vec<f32>)> =
            case.gate_up.iter().map(|w| q8_0(w, 2 * i, h)).collect();
        let down: Vec<(Vec<u8>, Vec<f32>)> = case.down.iter().map(|w| q8_0(w, h, i)).collect();
        case.gate_up = gate_up.iter().map(|(_, w)| w.clone()).collect();
        case.down = down.iter().map(|(_, w)| w.clone()).collect();
        let gate_up = gate_up.into_iter().flat_map(|(b, _)| b).collect();
        let down = down.into_iter().flat_map(|(b, _)| b).collect();
        (case, gate_up, down)
    }

    fn run_quant(
        case: &Case,
        (gate_up, down): (&[u8], &[u8]),
        ids: &Array2<i64>,
        w: &Array2<f32>,
        (activations, threads): (Activations, usize),
    ) -> Array2<f32> {
        let experts = gate_up.len() / (2 * case.i * QType::Q8_0.row_bytes(case.h).unwrap());
        let bytes_of = |n: usize, k: usize| vec![n * QType::Q8_0.row_bytes(k).unwrap(); experts];
        let (g, d) = (bytes_of(2 * case.i, case.h), bytes_of(case.h, case.i));
        let split = |all: &[u8], sizes: &[usize]| -> Vec<Vec<u8>> {
            let mut at = 0;
            sizes
                .iter()
                .map(|n| {
                    at += n;
                    all[at - n..at].to_vec()
                })
                .collect()
        };
        let layout = q8_0_layout(&split(gate_up, &g), &split(down, &d), case.h, case.i);
        let held = layout.over(vec![gate_up, down]).unwrap();
        run_held(&held, &case.x, ids, w, (activations, threads))
    }

    /// `moe_quant_experts` over `held` for the rows of x `[ids.nrows(), H]`.
    fn run_held(
        held: &QuantExperts<'_>,
        x: &[f32],
        ids: &Array2<i64>,
        w: &Array2<f32>,
        (activations, threads): (Activations, usize),
    ) -> Array2<f32> {
        let (m, h) = (ids.nrows(), held.layout.hidden);
        let x = Array2::from_shape_vec((m, h), x[..m * h].to_vec()).unwrap();
        let mut got = Array2::<f32>::zeros((m, h));
        moe_quant_experts(
            x.view(),
            held,
            ids.view(),
            w.view(),
            got.view_mut(),
            threads,
            activations,
        )
        .unwrap();
        got
    }

    #[test]
    fn quantized_experts_match_the_float_kernel_on_their_dequantized_weights() {
        // 7 tokens (grouped products) and 1 token (the chosen experts' gate/up stacked)
        for m in [7, 1] {
            let (h, i, experts) = (64, 32, 4);
            let (case, gate_up, down) = q8_0_case(m, h, i, experts);
            let (mut ids, w) = routing(m, 3, experts);
            ids[[m / 2, 1]] = NOT_HELD; // another rank's expert: adds nothing
            let panels = stacked_panels::<f32>(&case.gate_up, 2 * i, h);
            let want = case.run(&panels, &ids, &w, 2);
            let got = run_quant(&case, (&gate_up, &down), &ids, &w, (Activations::F32, 2));
            for (g, want) in got.iter().zip(want.iter()) {
                assert!((g - want).abs() < 1e-4, "{m} tokens: {g} vs {want}");
            }
        }
    }

    #[test]
    fn one_quantized_token_equals_its_row_of_a_batch_bit_for_bit() {
        // the stacked gate/up product of one token against the same token's row of the
        // grouped products, at every activation kind
        let (m, h, i, experts) = (5, 64, 32, 6);
        let (case, gate_up, down) = q8_0_case(m, h, i, experts);
        let (ids, w) = routing(m, 3, experts);
        for activations in [Activations::F32, Activations::Int8, Activations::Int16] {
            let batch = run_quant(&case, (&gate_up, &down), &ids, &w, (activations, 2));
            for t in [0, 3] {
                let mut one = Case::new(1, h, i, experts);
                one.x = case.x[t * h..(t + 1) * h].to_vec();
                let row = run_quant(
                    &one,
                    (&gate_up, &down),
                    &ids.slice(ndarray::s![t..t + 1, ..]).to_owned(),
                    &w.slice(ndarray::s![t..t + 1, ..]).to_owned(),
                    (activations, 2),
                );
                assert_eq!(row.row(0), batch.row(t), "{activations:?}, token {t}");
            }
        }
    }

    #[test]
    fn quantized_products_split_by_expert_equal_them_split_by_rows_bit_for_bit() {
        // 4 tokens choosing 4 of 8 experts: at 3 threads whole experts are the pool's items,
        // at 1 thread each expert's rows are one call
        let (m, h, i, experts) = (4, 64, 32, 8);
        let (case, gate_up, down) = q8_0_case(m, h, i, experts);
        let (ids, w) = routing(m, 4, experts);
        for activations in [Activations::F32, Activations::Int16] {
            let one = run_quant(&case, (&gate_up, &down), &ids, &w, (activations, 1));
            let three = run_quant(&case, (&gate_up, &down), &ids, &w, (activations, 3));
            assert_eq!(one, three, "{activations:?}");
        }
    }

    #[test]
    fn a_layout_that_does_not_fit_its_experts_or_buffers_is_rejected() {
        let q = QType::Q8_0;
        let err =
            back_to_back(&[vec![(q, 32)], vec![(q, 30)]], &vec![vec![(q, 64)]; 2], 64).unwrap_err();
        assert!(
            format!("{err}").contains("expert 1: gate/up has 30 rows"),
            "{err}"
        );
        let err = back_to_back(&[vec![(q, 32)]], &[], 64).unwrap_err();
        assert!(format!("{err}").contains("1 gate/up and 0 down"), "{err}");
        let layout = back_to_back(&[vec![(q, 64)]], &[vec![(q, 64)]], 64).unwrap();
        // 64 rows of 64 and 64 rows of 32 elements: 2 and 1 blocks of 34 bytes a row
        assert_eq!(layout.buffers(), &[64 * 68, 64 * 34]);
        let (g, d) = (vec![0u8; 64 * 68], vec![0u8; 64 * 34 - 1]);
        let err = layout.over(vec![&g, &d]).err().unwrap();
        assert!(
            format!("{err}").contains("hold [4352, 2175] bytes"),
            "{err}"
        );
        // a segment past its buffer's end
        let placed = |rows, buffer, offset| Placed {
            qtype: q,
            rows,
            buffer,
            offset,
        };
        let err = QuantLayout::new(
            &[64 * 68, 64 * 34],
            &[vec![placed(64, 0, 34)]],
            &[vec![placed(64, 1, 0)]],
            64,
        )
        .unwrap_err();
        assert!(
            format!("{err}").contains("gate/up segment of 64 rows at byte 34 of buffer 0"),
            "{err}"
        );
    }

    #[test]
    fn experts_placed_in_the_files_stacked_tensors_equal_them_laid_out_back_to_back() {
        // GGUF's layout: all experts' gate rows in one buffer, their up rows in a second and
        // their down rows in a third, each expert a contiguous block (the mapped file as it
        // is), against the same bytes copied expert after expert
        let (m, h, i, experts) = (6, 64, 32, 5);
        let (case, gate_up, down) = q8_0_case(m, h, i, experts);
        let (ids, w) = routing(m, 3, experts);
        let rb = QType::Q8_0.row_bytes(h).unwrap();
        let block = i * rb; // one expert's gate (or up) rows
        let (mut gates, mut ups) = (Vec::new(), Vec::new());
        for chunk in gate_up.chunks_exact(2 * block) {
            gates.extend_from_slice(&chunk[..block]);
            ups.extend_from_slice(&chunk[block..]);
        }
        let placed = |rows, buffer, offset| Placed {
            qtype: QType::Q8_0,
            rows,
            buffer,
            offset,
        };
        let down_block = h * QType::Q8_0.row_bytes(i).unwrap();
        let gate_up_placed: Vec<Vec<Placed>> = (0..experts)
            .map(|e| vec![placed(i, 0, e * block), placed(i, 1, e * block)])
            .collect();
        let down_placed: Vec<Vec<Placed>> = (0..experts)
            .map(|e| vec![placed(h, 2, e * down_block)])
            .collect();
        let sizes = [gates.len(), ups.len(), down.len()];
        let layout = QuantLayout::new(&sizes, &gate_up_placed, &down_placed, h).unwrap();
        let held = layout.over(vec![&gates, &ups, &down]).unwrap();
        for (rows, threads) in [(m, 2), (1, 2), (m, 1)] {
            let (ids, w) = (
                ids.slice(ndarray::s![..rows, ..]).to_owned(),
                w.slice(ndarray::s![..rows, ..]).to_owned(),
            );
            let got = run_held(&held, &case.x, &ids, &w, (Activations::F32, threads));
            let mut one = Case::new(rows, h, i, experts);
            one.x = case.x[..rows * h].to_vec();
            let want = run_quant(
                &one,
                (&gate_up, &down),
                &ids,
                &w,
                (Activations::F32, threads),
            );
            assert_eq!(got, want, "{rows} tokens, {threads} threads");
        }
    }

    #[test]
    fn ids_outside_the_experts_and_shapes_that_do_not_fit_are_rejected() {
        let case = Case::new(2, 16, 16, 4);
        let gate_up = stacked_panels::<f32>(&case.gate_up, 32, 16);
        let down = stacked_panels::<f32>(&case.down, 16, 16);
        let x = Array2::<f32>::zeros((2, 16));
        let w = Array2::<f32>::ones((2, 1));
        let mut out = Array2::<f32>::zeros((2, 16));
        let ids = Array2::from_elem((2, 1), 4i64);
        let err = moe_experts(
            x.view(),
            gate_up.view(),
            down.view(),
            ids.view(),
            w.view(),
            out.view_mut(),
            1,
        )
        .unwrap_err();
        assert!(
            format!("{err}").contains("expert id 4 is outside 0..4"),
            "{err}"
        );
        let ids = Array2::from_elem((2, 1), 0i64);
        let err = moe_experts(
            x.view(),
            down.view(),
            down.view(),
            ids.view(),
            w.view(),
            out.view_mut(),
            1,
        )
        .unwrap_err();
        assert!(
            format!("{err}").contains("gate_up panels have shape"),
            "{err}"
        );
    }
}
