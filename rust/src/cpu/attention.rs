//! Paged attention on the CPU, reading K/V where they live in the block-paged cache.
//!
//! The torch path gathers every sequence's whole context into a padded tensor per layer and
//! step; here each (sequence, query tile) walks its block table directly with an online
//! softmax (one pass over the keys, no score matrix of the whole context). Grouped-query heads
//! share each key and value load; several query tokens per sequence (prefill, chunked prefill,
//! speculative verification) are causal within the chunk: query i of a sequence with context
//! `L` and `q` new tokens sits at position `L - q + i` and sees keys `0..=L - q + i`.
//!
//! A sliding-window layer (`Scores::window` = W > 0) also hides keys W or more positions behind
//! the query (query at `p` sees keys `p - W + 1..=p`, as `transformers` masks them), and a work
//! item never reads the blocks wholly before its first query's window (blocks the KV manager may
//! have freed). Gemma 2's attention logit soft-capping (`Scores::softcap`) bounds each score as
//! `cap * tanh(score / cap)` before the mask.
//!
//! Layouts (the engine's): q `[T, H, D]` (any strides), caches `[blocks, block_size, KVH, D]`
//! contiguous, out `[T, H, D]` contiguous, sequence `s` owns query rows
//! `query_start_loc[s]..query_start_loc[s + 1]`. Rows outside every sequence get zeros.
//!
//! q and out share one element type (`Elem`: f32 or bf16); the caches hold it too, or a quantized
//! format (`KvElem`: int8, fp8) whose rows are `d` codes and a scale byte (`kv_quant`), read
//! in place and dequantized in registers (the scale folded into the score or the probability).
//! Scores, the softmax and the output sums are f32 whatever it is, and a bf16 output is rounded
//! once, at the end.
use std::sync::Mutex;

use ndarray::{ArrayView2, ArrayView3, ArrayView4, ArrayViewMut3, ArrayViewMut4, Axis};

use super::elem::Elem;
use super::invalid;
use super::isa::{self, IsaLevel};
use super::kv_quant::{self, KvElem};
use super::{pool, simd};
use crate::error::Result;

/// Keys scored per pass of the online softmax.
const KEY_TILE: usize = 64;
/// Query tokens per work item: long prompts split into several items, so threads share them.
const QUERY_TILE: usize = 16;
/// Below this many query-key pairs in a call, threads cost more than they save.
const MIN_PARALLEL_PAIRS: usize = 1 << 15;
/// Buckets of work items a threaded call is cut into per thread (`paged_attention`).
const BUCKETS_PER_THREAD: usize = 4;

/// The per-sequence part of a step: where its queries are, how long its context is, its blocks.
#[derive(Clone, Copy)]
pub struct PagedBatch<'a> {
    /// `[S + 1]` packed query row offsets.
    pub query_start_loc: &'a [i32],
    /// `[S]` context length including this step's tokens.
    pub seq_lens: &'a [i32],
    /// `[S, W]` cache block of each `block_size` keys of the context.
    pub block_tables: ArrayView2<'a, i32>,
}

/// How a layer turns query-key products into softmax inputs.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Scores {
    /// factor on every dot product (usually `head_dim^-0.5`)
    pub scale: f32,
    /// sliding window W: a query sees the last W positions, itself included (0: every position)
    pub window: usize,
    /// logit soft-capping: `cap * tanh(score / cap)` (0: none)
    pub softcap: f32,
}

impl From<f32> for Scores {
    /// Full causal attention, no capping.
    fn from(scale: f32) -> Self {
        Scores {
            scale,
            window: 0,
            softcap: 0.0,
        }
    }
}

/// Write this step's keys and values `[T, KVH, D]` into their cache slots
/// (`slot = block * block_size + offset`); slot -1 marks a padding row and is skipped. A
/// quantized cache (`[.., D + 1]`) gets each row rotated and coded with its scale, in the same
/// pass (`kv_quant`).
pub fn store_kv<T: Elem, C: KvElem>(
    k: ArrayView3<T>,
    v: ArrayView3<T>,
    slot_mapping: &[i64],
    k_cache: ArrayViewMut4<C>,
    v_cache: ArrayViewMut4<C>,
) -> Result<()> {
    store_kv_fed(k, v, slot_mapping, k_cache, v_cache, None)
}

/// `store_kv` with the keys of a quantized cache coded by error feedback
/// (`KvElem::encode_fed`): `key_feedback` float32 `[KVH, D, D]` (flat), one matrix per kv head
/// (the key calibration's, `worker/kv_calibration.py`); None, or a float cache: `store_kv`.
pub fn store_kv_fed<T: Elem, C: KvElem>(
    k: ArrayView3<T>,
    v: ArrayView3<T>,
    slot_mapping: &[i64],
    k_cache: ArrayViewMut4<C>,
    v_cache: ArrayViewMut4<C>,
    key_feedback: Option<&[f32]>,
) -> Result<()> {
    if v_cache.dim() != k_cache.dim() {
        return Err(invalid("k_cache and v_cache must have the same shape"));
    }
    let (_, _, kv_heads, row) = k_cache.dim();
    let d = row.saturating_sub(C::EXTRA);
    let key_feedback = key_feedback.filter(|_| C::ROTATED);
    if let Some(f) = key_feedback {
        if f.len() != kv_heads * d * d {
            return Err(invalid(format!(
                "key_feedback has {} elements, expected {kv_heads} x {d} x {d}",
                f.len()
            )));
        }
    }
    store_one("k", k, slot_mapping, k_cache, key_feedback)?;
    store_one("v", v, slot_mapping, v_cache, None)
}

fn store_one<T: Elem, C: KvElem>(
    name: &str,
    rows: ArrayView3<T>,
    slot_mapping: &[i64],
    mut cache: ArrayViewMut4<C>,
    feedback: Option<&[f32]>,
) -> Result<()> {
    let (blocks, block_size, kv_heads, row) = cache.dim();
    let head_dim = row.saturating_sub(C::EXTRA);
    if rows.dim() != (slot_mapping.len(), kv_heads, head_dim) || row < C::EXTRA {
        return Err(invalid(format!(
            "{name} has shape {:?}, expected [{}, {kv_heads}, {head_dim}] (slot_mapping length, \
             cache heads and head size{})",
            rows.shape(),
            slot_mapping.len(),
            if C::EXTRA > 0 {
                ", the cache's rows less their scale"
            } else {
                ""
            }
        )));
    }
    let num_slots = (blocks * block_size) as i64;
    if let Some(t) = slot_mapping
        .iter()
        .position(|&slot| slot < -1 || slot >= num_slots)
    {
        return Err(invalid(format!(
            "slot_mapping[{t}] = {} is outside [-1, {num_slots})",
            slot_mapping[t]
        )));
    }
    let mut wide = vec![0.0f32; head_dim];
    for (t, &slot) in slot_mapping.iter().enumerate() {
        if slot < 0 {
            continue;
        }
        let (block, offset) = (slot as usize / block_size, slot as usize % block_size);
        let mut dst = cache.index_axis_mut(Axis(0), block);
        let mut dst = dst.index_axis_mut(Axis(0), offset);
        for (h, src) in rows.index_axis(Axis(0), t).outer_iter().enumerate() {
            for (w, x) in wide.iter_mut().zip(src) {
                *w = x.to_f32();
            }
            if C::ROTATED {
                kv_quant::hadamard(&mut wide);
            }
            let mut dst_row = dst.index_axis_mut(Axis(0), h);
            match (dst_row.as_slice_mut(), feedback) {
                (Some(dst_row), Some(f)) => C::encode_fed(
                    &wide,
                    dst_row,
                    &f[h * head_dim * head_dim..][..head_dim * head_dim],
                ),
                (Some(dst_row), None) => C::encode(&wide, dst_row),
                (None, _) => {
                    return Err(invalid(format!("{name}'s cache rows must be contiguous")))
                }
            }
        }
    }
    Ok(())
}

/// Attention of every query row over its sequence's paged context, written into `out`.
/// `num_threads` threads at most (1: the calling thread only; more: the calling thread and
/// parked workers of the kernels' pool, `cpu::pool`).
pub fn paged_attention<'a, T: Elem, C: KvElem>(
    q: ArrayView3<'a, T>,
    k_cache: ArrayView4<'a, C>,
    v_cache: ArrayView4<'a, C>,
    batch: PagedBatch<'a>,
    scores: impl Into<Scores>,
    out: ArrayViewMut3<T>,
    num_threads: usize,
) -> Result<()> {
    let level = isa::level();
    paged_attention_at(level, q, k_cache, v_cache, batch, scores, out, num_threads)
}

/// `paged_attention` with the kernels of `level` (at most the process's, `isa::level()`): the
/// tests compare the levels' results within one process.
#[allow(clippy::too_many_arguments)]
pub(super) fn paged_attention_at<'a, T: Elem, C: KvElem>(
    level: IsaLevel,
    q: ArrayView3<'a, T>,
    k_cache: ArrayView4<'a, C>,
    v_cache: ArrayView4<'a, C>,
    batch: PagedBatch<'a>,
    scores: impl Into<Scores>,
    mut out: ArrayViewMut3<T>,
    num_threads: usize,
) -> Result<()> {
    let scores = scores.into();
    let shape = check_shapes(&q, &k_cache, &v_cache, &out)?;
    let items = plan_items(batch, shape, q.dim().0, scores.window)?;
    let ctx = Ctx {
        q,
        k: k_cache
            .to_slice()
            .ok_or_else(|| invalid("k_cache must be contiguous"))?,
        v: v_cache
            .to_slice()
            .ok_or_else(|| invalid("v_cache must be contiguous"))?,
        tables: batch.block_tables,
        shape,
        scores,
        level: level.min(isa::level()),
    };
    let out = out
        .as_slice_mut()
        .ok_or_else(|| invalid("out must be contiguous"))?;
    let chunks = split_out(out, &items, shape.heads * shape.head_dim);
    let pairs: usize = items.iter().map(Item::pairs).sum();
    let threads = if pairs < MIN_PARALLEL_PAIRS {
        1
    } else {
        num_threads.clamp(1, items.len().max(1))
    };
    if threads == 1 {
        run(&ctx, chunks);
        return Ok(());
    }
    // more buckets than threads, claimed in turn (heaviest first) by whichever thread is free:
    // on a busy machine a thread sharing its core with another process takes fewer of them
    let buckets: Vec<_> = balance(chunks, threads * BUCKETS_PER_THREAD)
        .into_iter()
        .filter(|bucket| !bucket.is_empty())
        .map(|bucket| Mutex::new(Some(bucket)))
        .collect();
    pool::WORKERS.run_claimed(threads, buckets.len(), |i| {
        let bucket = buckets[i].lock().unwrap_or_else(|e| e.into_inner()).take();
        run(&ctx, bucket.unwrap_or_default());
    });
    Ok(())
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
struct Shape {
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    /// elements of a (position, kv head) row in the cache: `head_dim`, plus a quantized row's
    /// scale
    row: usize,
    block_size: usize,
    num_blocks: usize,
}

impl Shape {
    fn group(&self) -> usize {
        self.heads / self.kv_heads
    }
}

fn check_shapes<T: Elem, C: KvElem>(
    q: &ArrayView3<T>,
    k_cache: &ArrayView4<C>,
    v_cache: &ArrayView4<C>,
    out: &ArrayViewMut3<T>,
) -> Result<Shape> {
    let (_, heads, head_dim) = q.dim();
    let (num_blocks, block_size, kv_heads, row) = k_cache.dim();
    if v_cache.dim() != k_cache.dim() {
        return Err(invalid("k_cache and v_cache must have the same shape"));
    }
    if row != head_dim + C::EXTRA || block_size == 0 {
        return Err(invalid(format!(
            "cache shape {:?} does not match q's head size {head_dim}{}",
            k_cache.shape(),
            if C::EXTRA > 0 {
                " (plus each row's scale)"
            } else {
                ""
            }
        )));
    }
    if kv_heads == 0 || heads % kv_heads != 0 {
        return Err(invalid(format!(
            "q's {heads} heads are not a multiple of the cache's {kv_heads} kv heads"
        )));
    }
    if out.dim() != q.dim() {
        return Err(invalid(format!(
            "out has shape {:?}, q has {:?}",
            out.shape(),
            q.shape()
        )));
    }
    Ok(Shape {
        heads,
        kv_heads,
        head_dim,
        row,
        block_size,
        num_blocks,
    })
}

/// One task: query rows `first + r0 .. first + r1` of sequence `seq` (all heads).
#[derive(Clone, Copy, Debug)]
struct Item {
    seq: usize,
    first: usize,
    r0: usize,
    r1: usize,
    /// context length minus query count: query row r sees keys `0..before + r + 1` (none when
    /// that is <= 0: a padding row with more queries than context)
    before: isize,
    /// the layer's sliding window (0: none): row r sees keys `first_key(r)..visible(r)`
    window: usize,
}

impl Item {
    fn visible(&self, r: usize) -> usize {
        (self.before + r as isize + 1).max(0) as usize
    }

    fn first_key(&self, r: usize) -> usize {
        if self.window == 0 {
            0
        } else {
            self.visible(r).saturating_sub(self.window)
        }
    }

    fn pairs(&self) -> usize {
        (self.r1 - self.r0) * (self.visible(self.r1 - 1) - self.first_key(self.r0))
    }
}

fn plan_items(
    batch: PagedBatch<'_>,
    shape: Shape,
    num_rows: usize,
    window: usize,
) -> Result<Vec<Item>> {
    let PagedBatch {
        query_start_loc: qsl,
        seq_lens,
        block_tables,
    } = batch;
    let num_seqs = seq_lens.len();
    if qsl.len() != num_seqs + 1 || block_tables.dim().0 != num_seqs {
        return Err(invalid(format!(
            "query_start_loc has {} entries and block_tables {} rows for {num_seqs} sequences \
             (expected S + 1 and S)",
            qsl.len(),
            block_tables.dim().0
        )));
    }
    let width = block_tables.dim().1;
    let mut items = Vec::new();
    for s in 0..num_seqs {
        let (start, end, len) = (qsl[s], qsl[s + 1], seq_lens[s]);
        if start < 0 || end < start || end as usize > num_rows {
            return Err(invalid(format!(
                "query_start_loc[{s}..={}] = {start}..{end} is not an increasing range within \
                 the {num_rows} query rows",
                s + 1
            )));
        }
        let q_len = (end - start) as usize;
        if len < 0 {
            return Err(invalid(format!("seq_lens[{s}] = {len} is negative")));
        }
        let len = len as usize;
        let used = len.div_ceil(shape.block_size);
        if used > width {
            return Err(invalid(format!(
                "seq_lens[{s}] = {len} needs {used} blocks, block_tables has {width} columns"
            )));
        }
        // blocks wholly before the first query's window are never read: not checked either
        let first_used = if window == 0 {
            0
        } else {
            (len - q_len.min(len) + 1).saturating_sub(window) / shape.block_size
        };
        let row = block_tables.row(s);
        for (j, &b) in row.iter().enumerate().take(used).skip(first_used) {
            if b < 0 || b as usize >= shape.num_blocks {
                return Err(invalid(format!(
                    "block_tables[{s}, {j}] = {b} is not a cache block (0..{})",
                    shape.num_blocks
                )));
            }
        }
        for r0 in (0..q_len).step_by(QUERY_TILE) {
            items.push(Item {
                seq: s,
                first: start as usize,
                r0,
                r1: (r0 + QUERY_TILE).min(q_len),
                before: len as isize - q_len as isize,
                window,
            });
        }
    }
    Ok(items)
}

/// Cuts `out` into each item's rows (disjoint, in row order) and zeroes the rows no item owns.
fn split_out<'o, T: Elem>(
    mut out: &'o mut [T],
    items: &[Item],
    row: usize,
) -> Vec<(Item, &'o mut [T])> {
    let mut chunks = Vec::with_capacity(items.len());
    let mut at = 0;
    for item in items {
        let start = item.first + item.r0;
        let (gap, rest) = out.split_at_mut((start - at) * row);
        gap.fill(T::ZERO);
        let (mine, rest) = rest.split_at_mut((item.r1 - item.r0) * row);
        chunks.push((*item, mine));
        out = rest;
        at = item.first + item.r1;
    }
    out.fill(T::ZERO);
    chunks
}

/// Longest-first assignment of the items to `count` buckets of similar work.
fn balance<T>(chunks: Vec<(Item, &mut [T])>, count: usize) -> Vec<Vec<(Item, &mut [T])>> {
    let mut chunks = chunks;
    chunks.sort_by_key(|(item, _)| std::cmp::Reverse(item.pairs()));
    let mut buckets: Vec<Vec<(Item, &mut [T])>> = (0..count).map(|_| Vec::new()).collect();
    let mut load = vec![0usize; count];
    for chunk in chunks {
        let (i, _) = load
            .iter()
            .enumerate()
            .min_by_key(|(_, l)| **l)
            .unwrap_or((0, &0));
        load[i] += chunk.0.pairs();
        buckets[i].push(chunk);
    }
    buckets
}

struct Ctx<'a, T, C> {
    q: ArrayView3<'a, T>,
    k: &'a [C],
    v: &'a [C],
    tables: ArrayView2<'a, i32>,
    shape: Shape,
    scores: Scores,
    /// the kernels' level: never above the process's
    level: IsaLevel,
}

/// Per-thread buffers, reused across items.
#[derive(Default)]
struct Scratch {
    q: Vec<f32>,
    scores: Vec<f32>,
    max: Vec<f32>,
    sum: Vec<f32>,
    key_at: Vec<usize>,
    /// the AVX2 path: each row's place in the item's output, its output's rescaling factor in
    /// the current key tile, a key tile widened to f32 (bf16 caches)
    row_at: Vec<usize>,
    corr: Vec<f32>,
    keys: Vec<f32>,
    /// an item's output sums when `out` is not f32 (rounded into it at the end)
    acc: Vec<f32>,
    /// the AVX2 path: one query row in f32 (rotated there for a quantized cache)
    q_row: Vec<f32>,
    /// AVX-512 decode over a quantized cache: the key tile's factors (`key_factor`) and its
    /// values' (times the lift), `[kv head][KEY_TILE]`
    key_factors: Vec<f32>,
    value_factors: Vec<f32>,
}

fn run<T: Elem, C: KvElem>(ctx: &Ctx<'_, T, C>, chunks: Vec<(Item, &mut [T])>) {
    let mut scratch = Scratch::default();
    // ctx.level is at most the process's level: the machine grants its features (the Avx2
    // level includes f16c, through which e5m2 caches widen)
    #[cfg(target_arch = "x86_64")]
    if ctx.level >= IsaLevel::Avx512 {
        // SAFETY: the level (checked above) grants the features the function is compiled for.
        unsafe { run_avx512(ctx, chunks, &mut scratch) };
        return;
    } else if ctx.level >= IsaLevel::Avx2 {
        // SAFETY: as above.
        unsafe { run_avx2_fma(ctx, chunks, &mut scratch) };
        return;
    }
    run_with::<false, false, T, C>(ctx, chunks, &mut scratch);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn run_avx2_fma<T: Elem, C: KvElem>(
    ctx: &Ctx<'_, T, C>,
    chunks: Vec<(Item, &mut [T])>,
    scratch: &mut Scratch,
) {
    run_with::<true, false, T, C>(ctx, chunks, scratch);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn run_avx512<T: Elem, C: KvElem>(
    ctx: &Ctx<'_, T, C>,
    chunks: Vec<(Item, &mut [T])>,
    scratch: &mut Scratch,
) {
    run_with::<true, true, T, C>(ctx, chunks, scratch);
}

/// `F`: inside an avx2 + fma function; `W`: inside an AVX-512 one.
#[inline(always)]
fn run_with<const F: bool, const W: bool, T: Elem, C: KvElem>(
    ctx: &Ctx<'_, T, C>,
    chunks: Vec<(Item, &mut [T])>,
    scratch: &mut Scratch,
) {
    let attend = |item, out: &mut [f32], scratch: &mut Scratch| {
        #[cfg(target_arch = "x86_64")]
        if F && ctx.shape.head_dim.is_multiple_of(simd::LANES) {
            // SAFETY: `F` (`W`) is true only inside `run_avx2_fma` (`run_avx512`), run at that
            // level.
            return unsafe {
                if W {
                    attend_item_avx512(ctx, item, out, scratch)
                } else {
                    attend_item_avx2(ctx, item, out, scratch)
                }
            };
        }
        attend_item::<F, T, C>(ctx, item, out, scratch)
    };
    for (item, out) in chunks {
        match T::as_f32_mut(out) {
            Some(out) => attend(item, out, scratch),
            None => {
                let mut acc = std::mem::take(&mut scratch.acc);
                acc.resize(out.len(), 0.0);
                attend(item, &mut acc, scratch);
                for (o, a) in out.iter_mut().zip(&acc) {
                    *o = T::from_f32(*a);
                }
                scratch.acc = acc;
            }
        }
    }
}

/// Every head of the item's query rows: online softmax over tiles of key positions, the running
/// sums accumulated straight into `out`. Position-major: a position's keys of all kv heads are
/// one contiguous run of the cache, read once for the query heads of every group.
#[inline(always)]
fn attend_item<const F: bool, T: Elem, C: KvElem>(
    ctx: &Ctx<'_, T, C>,
    item: Item,
    out: &mut [f32],
    sc: &mut Scratch,
) {
    let Shape {
        heads,
        kv_heads,
        head_dim: d,
        row,
        block_size: bs,
        ..
    } = ctx.shape;
    let group = ctx.shape.group();
    // row rr = (query r0 + rr / heads, head rr % heads): also its place in `out`
    let rows = (item.r1 - item.r0) * heads;
    out.fill(0.0);
    sc.q.clear();
    for r in item.r0..item.r1 {
        sc.q.extend(
            ctx.q
                .index_axis(Axis(0), item.first + r)
                .iter()
                .map(|x| x.to_f32()),
        );
    }
    if C::ROTATED {
        // the keys are rotated: so is q (H q / n), and the output is rotated back at the end
        sc.q.chunks_exact_mut(d).for_each(kv_quant::unrotate);
    }
    sc.scores.resize(rows * KEY_TILE, 0.0);
    sc.max.clear();
    sc.max.resize(rows, f32::NEG_INFINITY);
    sc.sum.clear();
    sc.sum.resize(rows, 0.0);
    let visible = |rr: usize| item.visible(item.r0 + rr / heads);
    let first_key = |rr: usize| item.first_key(item.r0 + rr / heads);
    let sees = |rr: usize, pos: usize| pos < visible(rr) && pos >= first_key(rr);
    // offset of row rr's kv head within a position's keys
    let head_at = |rr: usize| (rr % heads) / group * row;
    let table = ctx.tables.row(item.seq);
    let keys = item.visible(item.r1 - 1);
    let Scores { scale, softcap, .. } = ctx.scores;
    for t0 in (item.first_key(item.r0)..keys).step_by(KEY_TILE) {
        let n = KEY_TILE.min(keys - t0);
        sc.key_at.clear();
        sc.key_at.extend((t0..t0 + n).map(|pos| {
            let block = table[pos / bs] as usize;
            (block * bs + pos % bs) * kv_heads * row
        }));
        for (j, &at) in sc.key_at.iter().enumerate() {
            let keys_at = &ctx.k[at..at + kv_heads * row];
            for rr in 0..rows {
                let h = head_at(rr);
                sc.scores[rr * KEY_TILE + j] = if sees(rr, t0 + j) {
                    let x = C::dot::<F>(&sc.q[rr * d..(rr + 1) * d], &keys_at[h..h + row]) * scale;
                    if softcap > 0.0 {
                        softcap * (x / softcap).tanh()
                    } else {
                        x
                    }
                } else {
                    f32::NEG_INFINITY
                };
            }
        }
        // online softmax: rescale what was accumulated by e^(old max - new max)
        for rr in 0..rows {
            // a tile wholly outside the row's keys: nothing to add (and no -inf - -inf)
            if t0 >= visible(rr) || t0 + n <= first_key(rr) {
                continue;
            }
            let row = &mut sc.scores[rr * KEY_TILE..rr * KEY_TILE + n];
            let tile_max = row.iter().fold(f32::NEG_INFINITY, |m, x| m.max(*x));
            let new_max = sc.max[rr].max(tile_max);
            for x in row.iter_mut() {
                *x -= new_max;
            }
            simd::exp_inplace::<F>(row);
            let correction = (sc.max[rr] - new_max).exp();
            sc.sum[rr] = sc.sum[rr] * correction + row.iter().sum::<f32>();
            if correction != 1.0 {
                simd::scale(&mut out[rr * d..(rr + 1) * d], correction);
            }
            sc.max[rr] = new_max;
        }
        for (j, &at) in sc.key_at.iter().enumerate() {
            let values_at = &ctx.v[at..at + kv_heads * row];
            for rr in 0..rows {
                if sees(rr, t0 + j) {
                    let h = head_at(rr);
                    let p = sc.scores[rr * KEY_TILE + j];
                    C::axpy::<F>(&mut out[rr * d..(rr + 1) * d], p, &values_at[h..h + row]);
                }
            }
        }
    }
    for rr in 0..rows {
        if sc.sum[rr] > 0.0 {
            simd::scale(&mut out[rr * d..(rr + 1) * d], 1.0 / sc.sum[rr]);
        }
        if C::ROTATED {
            kv_quant::unrotate(&mut out[rr * d..(rr + 1) * d]);
        }
    }
}

/// `attend_item` with AVX2 + FMA for head sizes that are a multiple of 8: per key tile, each kv
/// head's `rows` (the item's queries times the heads of its group, which share every key and
/// value) in turn, with a running max / sum per (kv head, row).
/// Many rows (prefill): the scores tile is a small GEMM with the rows in the vector lanes;
/// fewer than 8 (decode): eight keys' dot products per vector. Scores are in log2 units (q
/// pre-scaled by `scale * log2(e)`, the softmax in `exp2`). Key tiles past the last query's
/// position are never read; within the diagonal tile, the keys a row must not see are masked.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn attend_item_avx2<T: Elem, C: KvElem>(
    ctx: &Ctx<'_, T, C>,
    item: Item,
    out: &mut [f32],
    sc: &mut Scratch,
) {
    attend_item_simd::<false, T, C>(ctx, item, out, sc)
}

/// `attend_item_avx2` with the AVX-512 loops (`attention_avx512`: 16 lanes, the same sums in the
/// same order, so the same bits).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
#[inline]
unsafe fn attend_item_avx512<T: Elem, C: KvElem>(
    ctx: &Ctx<'_, T, C>,
    item: Item,
    out: &mut [f32],
    sc: &mut Scratch,
) {
    attend_item_simd::<true, T, C>(ctx, item, out, sc)
}

/// The body of `attend_item_avx2` (`W` false) and `attend_item_avx512` (`W` true), inlined into
/// each (so that their loops are compiled for its level).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn attend_item_simd<const W: bool, T: Elem, C: KvElem>(
    ctx: &Ctx<'_, T, C>,
    item: Item,
    out: &mut [f32],
    sc: &mut Scratch,
) {
    use std::ptr::null;

    use super::attention_avx2 as k;
    use super::attention_avx512 as k16;

    let Shape {
        heads,
        kv_heads,
        head_dim: d,
        row,
        block_size: bs,
        ..
    } = ctx.shape;
    let group = ctx.shape.group();
    let rows = (item.r1 - item.r0) * group;
    let in_lanes = rows >= simd::LANES;
    // rows padded to whole vectors when they are in the lanes
    let rp = if in_lanes {
        rows.next_multiple_of(simd::LANES)
    } else {
        rows
    };
    out.fill(0.0);
    let keys = item.visible(item.r1 - 1);
    let table = ctx.tables.row(item.seq);
    // a sliding window: the first query's window starts at `k0`; blocks before are not read
    let k0 = item.first_key(item.r0);
    // each position's offset in the caches from the block holding `k0` (position `base`), a
    // block at a time (no division per position)
    let base = k0 / bs * bs;
    let run = kv_heads * row;
    sc.key_at.clear();
    for &block in table.iter().take(keys.div_ceil(bs)).skip(k0 / bs) {
        let first = block as usize * bs;
        sc.key_at.extend((first..first + bs).map(|slot| slot * run));
    }
    sc.key_at.truncate(keys - base);
    // the AVX-512 loops read values (and, at decode, keys) with the lifted loads: p and q are
    // lifted by powers of two instead (`attention_avx512::q_lift`), which changes no bits
    let value_lift = if W { C::LIFT } else { 1.0 };
    let q_scale = if W && !in_lanes {
        ctx.scale_log2() * k16::q_lift::<C>()
    } else {
        ctx.scale_log2()
    };
    // soft-capping in log2 units: c * tanh(x / c) with c = cap * log2(e)
    let cap = ctx.scores.softcap * std::f32::consts::LOG2_E;
    // row r: query r0 + r / group, head g * group + r % group
    let visible = |r: usize| item.visible(item.r0 + r / group);
    let first_key = |r: usize| item.first_key(item.r0 + r / group);
    let first_visible = visible(0);
    let last_first_key = first_key(rows.max(1) - 1);
    sc.scores.clear();
    // in lanes: one kv head's tile at a time; else every kv head's rows
    sc.scores.resize(
        KEY_TILE * rp.max(1) * if in_lanes { 1 } else { kv_heads },
        0.0,
    );
    if C::WIDEN && in_lanes {
        sc.keys.resize(KEY_TILE * d, 0.0);
    }
    // per kv head g: rows g * rows.., q at g * rp * d, running max / sum / factor at g * rp
    sc.row_at.clear();
    sc.q.clear();
    sc.q.resize(kv_heads * rp * d, 0.0);
    for g in 0..kv_heads {
        sc.row_at
            .extend((0..rows).map(|r| ((r / group) * heads + g * group + r % group) * d));
        // q rows, scaled: transposed ([d][rp]) in lanes, else row-major ([rows][d])
        let qg = &mut sc.q[g * rp * d..(g + 1) * rp * d];
        for r in 0..rows {
            let q = ctx
                .q
                .index_axis(Axis(0), item.first + item.r0 + r / group)
                .index_axis_move(Axis(0), g * group + r % group);
            sc.q_row.clear();
            sc.q_row.extend(q.iter().map(|v| v.to_f32()));
            if C::ROTATED {
                // rotated keys: q rotated too (H q / n), the output rotated back at the end
                kv_quant::unrotate(&mut sc.q_row);
            }
            for (x, v) in sc.q_row.iter().enumerate() {
                let at = if in_lanes { x * rp + r } else { r * d + x };
                qg[at] = v * q_scale;
            }
        }
    }
    // AVX-512 decode, quantized rows: room for a key tile's key and value factors
    if !in_lanes && W && C::EXTRA > 0 {
        sc.key_factors.resize(kv_heads * KEY_TILE, 0.0);
        sc.value_factors.resize(kv_heads * KEY_TILE, 0.0);
    }
    sc.max.clear();
    sc.max.resize(kv_heads * rp, f32::NEG_INFINITY);
    sc.sum.clear();
    sc.sum.resize(kv_heads * rp, 0.0);
    sc.corr.resize(kv_heads * rp, 1.0);
    // key tiles outer, kv heads inner: a tile's positions (all kv heads, contiguous in the
    // cache) are read from memory once, then served from cache to each head
    for t0 in (k0..keys).step_by(KEY_TILE) {
        let n = KEY_TILE.min(keys - t0);
        // this tile's first position in `key_at`
        let kt = t0 - base;
        if !in_lanes && W && t0 + KEY_TILE < keys {
            // decode: the next tile's keys asked for now, arriving while this tile is worked on
            let (next, end) = (kt + KEY_TILE, (kt + 2 * KEY_TILE).min(keys - base));
            let mut j = next;
            while j < end {
                let len = (bs - (base + j) % bs).min(end - j);
                k::prefetch(ctx.k.as_ptr().add(sc.key_at[j]), len * run);
                j += len;
            }
        }
        if !in_lanes && W && C::EXTRA > 0 {
            // every key's and value's factor, once per tile and head, sixteen rows at a time
            // (their scale bytes, the factors computed in the lanes), not one row at a time
            // inside the loops
            // (the values' after `touch` below has brought their lines in)
            let kf = sc.key_factors.as_mut_ptr();
            let key_lift = k16::key_unlift::<C>();
            for j0 in (0..n).step_by(16) {
                let at: [usize; 16] = std::array::from_fn(|l| sc.key_at[kt + (j0 + l).min(n - 1)]);
                for g in 0..kv_heads {
                    let f = k16::row_factors(ctx.k.as_ptr(), &at, g * row + d, key_lift);
                    std::arch::x86_64::_mm512_storeu_ps(kf.add(g * KEY_TILE + j0), f);
                }
            }
        }
        if !in_lanes && W {
            // the same, sixteen positions at a time (scores past n8 are never read)
            for j0 in (0..n).step_by(16) {
                let at: [usize; 16] = std::array::from_fn(|l| sc.key_at[kt + (j0 + l).min(n - 1)]);
                for g in 0..kv_heads {
                    let sixteen = std::array::from_fn(|l| ctx.k.as_ptr().add(at[l] + g * row));
                    let (q_at, s_at) = (sc.q.as_ptr(), sc.scores.as_mut_ptr());
                    let q_row = |r: usize| q_at.add((g * rows + r) * d);
                    let score_row = |r: usize| s_at.add((g * rows + r) * KEY_TILE + j0);
                    let f = sc.key_factors.as_ptr().wrapping_add(g * KEY_TILE + j0);
                    let mut r = 0;
                    while r < rows {
                        // unquantized keys, a group's last three rows (GQA 3: every row) in one
                        // pass: each key read once for the three (28 of the 32 registers)
                        if C::EXTRA == 0 && r + 3 == rows {
                            let three = k16::qk_keys_in_lanes::<C, 3>(
                                [q_row(r), q_row(r + 1), q_row(r + 2)],
                                &sixteen,
                                d,
                                f,
                            );
                            for (i, scores) in three.into_iter().enumerate() {
                                std::arch::x86_64::_mm512_storeu_ps(score_row(r + i), scores);
                            }
                            r += 3;
                        } else if r + 1 < rows {
                            // a pair of rows per pass: each key widened once for both
                            let pair = k16::qk_keys_in_lanes::<C, 2>(
                                [q_row(r), q_row(r + 1)],
                                &sixteen,
                                d,
                                f,
                            );
                            for (i, scores) in pair.into_iter().enumerate() {
                                std::arch::x86_64::_mm512_storeu_ps(score_row(r + i), scores);
                            }
                            r += 2;
                        } else {
                            let [scores] =
                                k16::qk_keys_in_lanes::<C, 1>([q_row(r)], &sixteen, d, f);
                            std::arch::x86_64::_mm512_storeu_ps(score_row(r), scores);
                            r += 1;
                        }
                    }
                }
            }
        } else if !in_lanes {
            // few rows: every kv head's scores of eight positions at a time, so that each
            // position's keys (all heads, one contiguous run) are read in one go
            for j0 in (0..n).step_by(simd::LANES) {
                // past the tile's end: the last key again, masked below
                let at: [usize; 8] = std::array::from_fn(|l| sc.key_at[kt + (j0 + l).min(n - 1)]);
                for g in 0..kv_heads {
                    let eight = std::array::from_fn(|l| ctx.k.as_ptr().add(at[l] + g * row));
                    let (q_at, s_at) = (sc.q.as_ptr(), sc.scores.as_mut_ptr());
                    let q_row = |r: usize| q_at.add((g * rows + r) * d);
                    let score_row = |r: usize| s_at.add((g * rows + r) * KEY_TILE + j0);
                    let mut r = 0;
                    while r < rows {
                        // quantized keys: a pair of rows per pass, each key widened once for
                        // both (the widening, not the FMAs, is what a quantized key costs more)
                        if C::EXTRA > 0 && r + 1 < rows {
                            let pair = k::qk_keys_in_lanes_rows::<C, 2>(
                                [q_row(r), q_row(r + 1)],
                                &eight,
                                d,
                            );
                            for (i, scores) in pair.into_iter().enumerate() {
                                std::arch::x86_64::_mm256_storeu_ps(score_row(r + i), scores);
                            }
                            r += 2;
                        } else {
                            let scores = k::qk_keys_in_lanes(q_row(r), &eight, d);
                            std::arch::x86_64::_mm256_storeu_ps(score_row(r), scores);
                            r += 1;
                        }
                    }
                }
            }
        }
        if !in_lanes {
            // decode: the tile's values read once in address order, a block's run at a time:
            // `pv` walks them a kv head at a time (a strided quarter of each position's run
            // per pass), an order the hardware prefetcher follows poorly, and then finds them
            // in L2 (decode from memory 20-25% faster; ~5-10% slower when the whole context is
            // already in cache: benches/RESULTS.md, issue 23)
            let mut j = 0;
            while j < n {
                let len = (bs - (t0 + j) % bs).min(n - j);
                std::hint::black_box(k::touch(ctx.v.as_ptr().add(sc.key_at[kt + j]), len * run));
                j += len;
            }
        }
        if !in_lanes && W && C::EXTRA > 0 {
            let vf = sc.value_factors.as_mut_ptr();
            for j0 in (0..n).step_by(16) {
                let at: [usize; 16] = std::array::from_fn(|l| sc.key_at[kt + (j0 + l).min(n - 1)]);
                for g in 0..kv_heads {
                    let f = k16::row_factors(ctx.v.as_ptr(), &at, g * row + d, value_lift);
                    std::arch::x86_64::_mm512_storeu_ps(vf.add(g * KEY_TILE + j0), f);
                }
            }
        }
        for g in 0..kv_heads {
            let mut key_ptr = [null::<C>(); KEY_TILE];
            let mut value_ptr = [null::<C>(); KEY_TILE];
            for j in 0..n {
                let at = sc.key_at[kt + j] + g * row;
                key_ptr[j] = ctx.k.as_ptr().add(at);
                value_ptr[j] = ctx.v.as_ptr().add(at);
            }
            let (q, row_at) = (
                sc.q.as_ptr().add(g * rp * d),
                &sc.row_at[g * rows..(g + 1) * rows],
            );
            let state = g * rp..(g + 1) * rp;
            let (max, sum, corr) = (
                &mut sc.max[state.clone()],
                &mut sc.sum[state.clone()],
                &mut sc.corr[state],
            );
            let s = sc.scores.as_mut_ptr();
            if in_lanes {
                let mut key_f32 = [null::<f32>(); KEY_TILE];
                for j in 0..n {
                    key_f32[j] = if C::WIDEN {
                        let dst = sc.keys.as_mut_ptr().add(j * d);
                        if W {
                            k16::widen(key_ptr[j], dst, d);
                        } else {
                            k::widen(key_ptr[j], dst, d);
                        }
                        dst
                    } else {
                        key_ptr[j] as *const f32
                    };
                }
                if W {
                    k16::qk_rows_in_lanes(q, rp, &key_f32[..n], d, s);
                } else {
                    k::qk_rows_in_lanes(q, rp, &key_f32[..n], d, s);
                }
                if cap > 0.0 {
                    soft_cap(s, n * rp, cap);
                }
                if t0 + n > first_visible {
                    for r in 0..rows {
                        for j in visible(r).saturating_sub(t0).min(n)..n {
                            *s.add(j * rp + r) = f32::NEG_INFINITY;
                        }
                    }
                }
                if t0 < last_first_key {
                    for r in 0..rows {
                        for j in 0..first_key(r).saturating_sub(t0).min(n) {
                            *s.add(j * rp + r) = f32::NEG_INFINITY;
                        }
                    }
                }
                if W {
                    k16::softmax_rows_in_lanes(s, rp, n, max, sum, corr);
                } else {
                    k::softmax_rows_in_lanes(s, rp, n, max, sum, corr);
                }
                if C::EXTRA > 0 {
                    k::scale_by_values(s, 1, rp, rp, &value_ptr[..n], d, value_lift);
                }
                let values = &value_ptr[..n];
                if W {
                    k16::pv(out.as_mut_ptr(), row_at, corr, s, 1, rp, values, d);
                } else {
                    k::pv(out.as_mut_ptr(), row_at, corr, s, 1, rp, values, d);
                }
            } else {
                let n8 = n.next_multiple_of(simd::LANES);
                let s = s.add(g * rows * KEY_TILE);
                for r in 0..rows {
                    let row = s.add(r * KEY_TILE);
                    if cap > 0.0 {
                        soft_cap(row, n, cap);
                    }
                    for j in visible(r).saturating_sub(t0).min(n)..n8 {
                        *row.add(j) = f32::NEG_INFINITY;
                    }
                    for j in 0..first_key(r).saturating_sub(t0).min(n) {
                        *row.add(j) = f32::NEG_INFINITY;
                    }
                    k::softmax_row(row, n8, &mut max[r], &mut sum[r], &mut corr[r]);
                }
                if C::EXTRA > 0 && W {
                    let f = sc.value_factors.as_ptr().add(g * KEY_TILE);
                    for r in 0..rows {
                        k16::scale_row(s.add(r * KEY_TILE), f, n);
                    }
                } else if C::EXTRA > 0 {
                    k::scale_by_values(s, KEY_TILE, 1, rows, &value_ptr[..n], d, value_lift);
                }
                let (o, values) = (out.as_mut_ptr(), &value_ptr[..n]);
                if W {
                    k16::pv(o, row_at, corr, s, KEY_TILE, 1, values, d);
                } else {
                    k::pv(o, row_at, corr, s, KEY_TILE, 1, values, d);
                }
            }
        }
    }
    for (i, &at) in sc.row_at.iter().enumerate() {
        let total = sc.sum[i / rows * rp + i % rows];
        if total > 0.0 {
            simd::scale(&mut out[at..at + d], 1.0 / total);
        }
        if C::ROTATED {
            kv_quant::unrotate(&mut out[at..at + d]);
        }
    }
}

impl<T, C> Ctx<'_, T, C> {
    /// The AVX2 path's factor on q: scores in log2 units.
    fn scale_log2(&self) -> f32 {
        self.scores.scale * std::f32::consts::LOG2_E
    }
}

/// `x = cap * tanh(x / cap)` for the `len` scores at `s` (Gemma 2's logit soft-capping).
///
/// # Safety
/// `s..s + len` must be valid for reads and writes.
#[cfg(target_arch = "x86_64")]
unsafe fn soft_cap(s: *mut f32, len: usize, cap: f32) {
    for x in std::slice::from_raw_parts_mut(s, len) {
        *x = cap * (*x / cap).tanh();
    }
}
