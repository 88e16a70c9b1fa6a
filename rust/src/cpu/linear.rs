//! Linear layers on the CPU: `y = x W^T + b` over a weight packed once into column panels.
//!
//! At decode batch sizes (1-16 rows) the product is memory-bound: every weight is read once per
//! step and does a few multiply-adds. The layout makes that one sequential read: the `[N, K]`
//! weight is stored as `[ceil(N / PANEL), K, PANEL]` (panel `p` holds output columns
//! `p * PANEL..`, column-major within the panel, the last one zero-padded), so a register tile
//! of up to `TILE_ROWS` rows of x by `PANEL` columns walks its panel front to back with one
//! broadcast of x and two FMAs per weight vector. The same layout serves every row count, so
//! the engine holds one copy of each weight: above `DIRECT_MAX_ROWS` rows (prefill chunks, where
//! the product is compute-bound) the kernel blocks it BLIS-style instead (`run_blocked`): an M
//! block of x packed for sequential broadcasts stays in L2, each `K_BLOCK`-deep slice of a panel
//! stays in L1 while every tile of the block passes over it.
//!
//! Each output element is one FMA chain over `k` in order, whatever the row count, tiling, K
//! slices, threads or ISA level (AVX2 and AVX-512 give the same bits; `linear_avx512`): a row's
//! result does not depend on the batch it runs in. x, the panels, the bias and y share one
//! element type (`Elem`: f32 or bf16); sums are f32 and a bf16 y is rounded once. Where the
//! machine has AVX-512 BF16, bf16 products take `vdpbf16ps` instead, two k steps a time: the
//! same exact products (x is bf16 too), summed a pair at a time, still the same for every row
//! count (and not bit-identical to the other levels' bf16).
//!
//! There, a bf16 weight is held as groups of `PANEL_GROUP` panels interleaved a pair of weight
//! rows at a time (`panel_group`, `group_panels`): `[P / G, K / 2, G, PANEL, 2]`, each pair of
//! rows stored column by column as `vdpbf16ps` multiplies it (a plain panel's pair needs a
//! `vpermw` first). The same products in the same order, so the sums are the same bits; a
//! decode tile as wide as the group (`linear_avx512::wide_panels`) reads one contiguous stream
//! instead of `G` streams one panel apart, which one core here reads ~1.2x faster (an expert's
//! product at 1-6 rows: 35 -> 41 GB/s; benches/RESULTS.md, round 16).
use std::any::TypeId;
use std::cell::RefCell;
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};

use ndarray::{ArrayView2, ArrayView3, ArrayViewMut2};

use super::elem::Elem;
use super::invalid;
use super::isa::{self, IsaLevel};
#[cfg(target_arch = "x86_64")]
use super::linear_avx512;
use super::pool;
use crate::error::Result;

/// Output columns per panel: two AVX registers of f32, one AVX-512 register.
pub const PANEL: usize = 16;
/// Rows of x per register tile (and per tile of packed x): 2 accumulators a row, plus two
/// weight registers and the broadcast, within the 16 AVX registers. The AVX-512 tiles
/// (`linear_avx512`) take two packed tiles at a time.
pub(super) const TILE_ROWS: usize = 6;
/// Bytes of x (as f32) per block of rows that every panel passes over while it stays in L2.
const X_BLOCK_BYTES: usize = 256 * 1024;
/// Weight rows (k steps) of a panel per slice that stays in L1 while every tile of an M block
/// runs over it (`run_blocked`): 16 KiB of f32.
const K_BLOCK: usize = 256;
/// Up to this many rows the product is memory-bound and the tiles read x in place
/// (`run_direct`); above it x is packed and K blocked (`run_blocked`).
pub(super) const DIRECT_MAX_ROWS: usize = 16;
/// Below this many weight elements a share, a worker thread costs more than it saves.
const MIN_SHARE_ELEMS: usize = 1 << 16;
/// Runs of panels a call is cut into per thread, claimed by whichever thread is free.
const CHUNKS_PER_THREAD: usize = 4;
/// Panels a grouped weight interleaves (`panel_group`): the widest decode tile's.
pub const PANEL_GROUP: usize = 4;

/// The panels per group (`PANEL_GROUP`, or 1: plain panels) in which `panels` panels of `k`
/// rows of `T` are read fastest here: grouped where the process's tiles for `T` are AVX-512
/// BF16's (bf16 weights: only those tiles read groups), the panels fill whole groups and the
/// rows whole pairs.
pub fn panel_group<T: Elem>(panels: usize, k: usize) -> usize {
    let grouped = tiles_at::<T>(isa::level()) == AVX512_BF16;
    if grouped && panels.is_multiple_of(PANEL_GROUP) && k.is_multiple_of(2) {
        PANEL_GROUP
    } else {
        1
    }
}

/// How a panel's pairs of weight rows (k steps `2i`, `2i + 1`) lie in its array: `stride`
/// elements from one pair to the next, each pair row after row (plain panels: `PANEL` elements
/// of step `2i`, then `2i + 1`'s) or `paired`, column by column (grouped panels).
#[derive(Clone, Copy, PartialEq, Debug)]
pub(super) struct Pairs {
    pub(super) stride: usize,
    pub(super) paired: bool,
}

impl Pairs {
    /// A plain panel's pairs.
    pub(super) const PLAIN: Pairs = Pairs {
        stride: 2 * PANEL,
        paired: false,
    };
}

/// The panels per group of a panel array `[P / G, depth, width = G * PANEL]` of a weight `[n,
/// k]`: 1, or `PANEL_GROUP` where `panel_group` groups such panels; None where the shape is
/// neither (the array is not the weight's panels).
pub(super) fn grouping<T: Elem>(
    (groups, depth, width): (usize, usize, usize),
    n: usize,
    k: usize,
) -> Option<usize> {
    let panels = n.div_ceil(PANEL);
    let fits = |g: usize| width == g * PANEL && groups * g == panels && depth == k;
    if fits(1) {
        Some(1)
    } else if panel_group::<T>(panels, k) == PANEL_GROUP && fits(PANEL_GROUP) {
        Some(PANEL_GROUP)
    } else {
        None
    }
}

/// The elements a panel's first `depth` weight rows span when its pairs of rows are `step`
/// apart (whole pairs, and half of one past an odd depth): `depth * PANEL` in a plain panel.
pub(super) fn pairs_extent(depth: usize, step: usize) -> usize {
    match (depth / 2, depth % 2) {
        (0, 0) => 0,
        (pairs, 0) => (pairs - 1) * step + 2 * PANEL,
        (pairs, _) => pairs * step + PANEL,
    }
}

/// `out [M, N] = x [M, K] · W^T + bias` with W given as its panels `[ceil(N / PANEL), K,
/// PANEL]` (`pack_panels`), or those in groups where `panel_group` says so (`[P / G, K, G *
/// PANEL]`, `group_panels`). All contiguous. `num_threads` threads at most (the calling thread
/// and parked workers of the kernels' pool), each taking a run of panels.
pub fn linear<T: Elem>(
    x: ArrayView2<T>,
    panels: ArrayView3<T>,
    bias: Option<&[T]>,
    out: ArrayViewMut2<T>,
    num_threads: usize,
) -> Result<()> {
    linear_with(
        tiles_at::<T>(isa::level()),
        x,
        panels,
        bias,
        out,
        num_threads,
    )
}

/// `linear` with the tile set `tiles` (one the process may run: `run_with_tiles`).
fn linear_with<T: Elem>(
    tiles: u8,
    x: ArrayView2<T>,
    panels: ArrayView3<T>,
    bias: Option<&[T]>,
    mut out: ArrayViewMut2<T>,
    num_threads: usize,
) -> Result<()> {
    let (m, k) = x.dim();
    let (groups, pk, width) = panels.dim();
    let (om, n) = out.dim();
    if !width.is_multiple_of(PANEL) || pk != k {
        return Err(invalid(format!(
            "weight panels have shape {:?}, expected [panels, {k}, {PANEL}] (x has {k} columns)",
            panels.shape()
        )));
    }
    let num_panels = groups * (width / PANEL);
    if om != m || n.div_ceil(PANEL) != num_panels {
        return Err(invalid(format!(
            "out has shape {:?}, expected [{m}, N] with ceil(N / {PANEL}) = {num_panels} \
             (x's rows, the weight's panels)",
            out.shape()
        )));
    }
    let Some(group) = grouping::<T>(panels.dim(), n, k) else {
        return Err(invalid(format!(
            "weight panels have shape {:?}: groups of {} panels are not read here \
             (`panel_group`)",
            panels.shape(),
            width / PANEL
        )));
    };
    if let Some(b) = bias {
        if b.len() != n {
            return Err(invalid(format!(
                "bias has {} elements, expected {n}",
                b.len()
            )));
        }
    }
    let x = x
        .to_slice()
        .ok_or_else(|| invalid("x must be contiguous"))?;
    let w = panels
        .to_slice()
        .ok_or_else(|| invalid("weight panels must be contiguous"))?;
    let out = out
        .as_slice_mut()
        .ok_or_else(|| invalid("out must be contiguous"))?;
    if m == 0 || n == 0 {
        return Ok(());
    }
    let widened;
    let x: &[f32] = if TypeId::of::<T>() == TypeId::of::<f32>() {
        // SAFETY: T is f32 (checked just above): the same elements, length and alignment.
        unsafe { std::slice::from_raw_parts(x.as_ptr().cast::<f32>(), x.len()) }
    } else {
        widened = x.iter().map(|v| v.to_f32()).collect::<Vec<f32>>();
        &widened
    };
    let ctx = Ctx {
        call: CALLS.fetch_add(1, Ordering::Relaxed),
        x,
        w,
        group,
        bias,
        out: OutPtr(out.as_mut_ptr()),
        m,
        k,
        n,
    };
    let per_share = (MIN_SHARE_ELEMS / (k * PANEL)).max(1);
    let threads = num_threads.clamp(1, num_panels.div_ceil(per_share));
    if threads == 1 {
        run_with_tiles(tiles, &ctx, 0..num_panels);
        return Ok(());
    }
    // runs of panels claimed in turn, several per thread: on a busy machine a thread that
    // shares its core with another process does fewer of them
    let chunk = num_panels
        .div_ceil(threads * CHUNKS_PER_THREAD)
        .max(per_share)
        .next_multiple_of(group); // whole groups: one stream each
    let chunks = num_panels.div_ceil(chunk);
    pool::WORKERS.run_claimed(threads, chunks, |c| {
        run_with_tiles(tiles, &ctx, c * chunk..((c + 1) * chunk).min(num_panels));
    });
    Ok(())
}

/// The panels `[ceil(N / PANEL), K, PANEL]` of a weight `[N, K]`, the last panel padded with
/// zeros (the layout `linear` reads; the Python side packs with torch the same way).
pub fn pack_panels<T: Elem>(w: ArrayView2<T>) -> Vec<T> {
    let (n, k) = w.dim();
    let mut panels = vec![T::ZERO; n.div_ceil(PANEL) * k * PANEL];
    for ((row, col), v) in w.indexed_iter() {
        panels[(row / PANEL) * k * PANEL + col * PANEL + row % PANEL] = *v;
    }
    panels
}

/// Plain panels `[P, K, PANEL]` (`pack_panels`) in groups of `group` (`panel_group`): `[P /
/// group, K / 2, group, PANEL, 2]` (the Python side groups with torch the same way); a group of
/// 1 is the plain panels as they are.
pub fn group_panels<T: Copy>(panels: &[T], k: usize, group: usize) -> Vec<T> {
    if group == 1 {
        return panels.to_vec();
    }
    assert!(panels.len().is_multiple_of(group * k * PANEL) && k.is_multiple_of(2));
    let mut grouped = Vec::with_capacity(panels.len());
    for chunk in panels.chunks_exact(group * k * PANEL) {
        for pair in 0..k / 2 {
            for panel in chunk.chunks_exact(k * PANEL) {
                let rows = &panel[pair * 2 * PANEL..(pair + 1) * 2 * PANEL];
                let (first, second) = rows.split_at(PANEL);
                grouped.extend(first.iter().zip(second).flat_map(|(a, b)| [*a, *b]));
            }
        }
    }
    grouped
}

/// `out`'s first element; the shares write disjoint columns of it.
#[derive(Clone, Copy)]
struct OutPtr<T>(*mut T);
// SAFETY: each share writes only the columns of its own panels (`run`), and `linear` holds the
// exclusive borrow of `out` until every share has returned.
unsafe impl<T: Send> Send for OutPtr<T> {}
unsafe impl<T: Send> Sync for OutPtr<T> {}

/// One product `out [m, n] = x [m, k] · W^T (+ bias)` that `run` computes a range of panels of:
/// `linear` runs one per call, the MoE kernel one per expert.
pub(crate) struct Ctx<'a, T> {
    /// This call's number (`CALLS`).
    call: u64,
    /// `[m, k]` as f32.
    x: &'a [f32],
    w: &'a [T],
    /// Panels per group of `w` (`panel_group`; 1: plain panels).
    group: usize,
    bias: Option<&'a [T]>,
    out: OutPtr<T>,
    m: usize,
    k: usize,
    n: usize,
}

impl<'a, T: Elem> Ctx<'a, T> {
    /// A product of `x [m, k]` (f32) by the panels `w` of an `[n, k]` weight into `out`, with
    /// a fresh call number (the blocked path's per-thread copy of x is tagged with it).
    ///
    /// # Safety
    /// `out` must point to `m * n` writable elements that nothing else reads or writes until
    /// every `run` over this product has returned, and `w` must hold `ceil(n / PANEL)` panels of
    /// `k` rows, in groups of `group` (`panel_group`: 1, or `PANEL_GROUP` where it says so).
    pub(crate) unsafe fn new(
        x: &'a [f32],
        w: &'a [T],
        group: usize,
        out: *mut T,
        m: usize,
        k: usize,
        n: usize,
    ) -> Self {
        debug_assert!(group == 1 || panel_group::<T>(n.div_ceil(PANEL), k) == group);
        Ctx {
            call: CALLS.fetch_add(1, Ordering::Relaxed),
            x,
            w,
            group,
            bias: None,
            out: OutPtr(out),
            m,
            k,
            n,
        }
    }

    /// Where panel `p`'s first pair of weight rows is in `w`, and how its pairs lie (plain, or
    /// the group's pairs side by side and paired).
    #[inline(always)]
    fn panel_at(&self, p: usize) -> (usize, Pairs) {
        let g = self.group;
        let pairs = Pairs {
            stride: g * 2 * PANEL,
            paired: g > 1,
        };
        ((p / g) * g * self.k * PANEL + (p % g) * 2 * PANEL, pairs)
    }

    /// The elements from a panel to the next one side by side (`side_by_side`).
    #[inline(always)]
    fn panel_stride(&self) -> usize {
        if self.group == 1 {
            self.k * PANEL
        } else {
            2 * PANEL
        }
    }

    /// Whether `count` panels from `p` lie evenly spaced under one step (one wide tile can run
    /// them): always in plain panels, within one group in groups.
    #[inline(always)]
    fn side_by_side(&self, p: usize, count: usize) -> bool {
        self.group == 1 || p % self.group + count <= self.group
    }
}

/// Computes the product's output columns of `panels` at the process's ISA level.
pub(crate) fn run<T: Elem>(ctx: &Ctx<'_, T>, panels: Range<usize>) {
    run_with_tiles(tiles_at::<T>(isa::level()), ctx, panels);
}

/// The kernels' tile sets, as `run_with`'s parameter, each needing the ones before it: plain
/// Rust, AVX2 + FMA, AVX-512 (the same sums, bit for bit, as AVX2), and for bf16 weights
/// AVX-512 BF16's `vdpbf16ps` (x's bf16 values two k steps at a time: the same exact
/// products, summed a pair at a time).
const PORTABLE: u8 = 0;
const AVX2: u8 = 1;
const AVX512: u8 = 2;
const AVX512_BF16: u8 = 3;

/// The tile set of element type `T` at `level`.
fn tiles_at<T: Elem>(level: IsaLevel) -> u8 {
    match level {
        IsaLevel::Portable => PORTABLE,
        IsaLevel::Avx2 => AVX2,
        _ if T::IS_BF16 && isa::has(isa::Extension::Avx512Bf16) => AVX512_BF16,
        _ => AVX512,
    }
}

/// `run` with the tile set `tiles`, which must be the process's (`tiles_at` its level) or
/// below: the tests run every set this way.
fn run_with_tiles<T: Elem>(tiles: u8, ctx: &Ctx<'_, T>, panels: Range<usize>) {
    let most = tiles_at::<T>(isa::level());
    assert!(
        tiles <= most,
        "tile set {tiles} is above the process's ({most})"
    );
    assert!(
        ctx.group == 1 || tiles == AVX512_BF16,
        "grouped panels are read by AVX-512 BF16's tiles only, not tile set {tiles}"
    );
    #[cfg(target_arch = "x86_64")]
    match tiles {
        // SAFETY (each): the CPU has what the function is compiled for: the process's level
        // (and for AVX512_BF16 the extension) includes it (asserted above).
        AVX512_BF16 => return unsafe { run_avx512_bf16(ctx, panels) },
        AVX512 => return unsafe { run_avx512(ctx, panels) },
        AVX2 => return unsafe { run_avx2_fma(ctx, panels) },
        _ => {}
    }
    run_with::<PORTABLE, T>(ctx, panels);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn run_avx2_fma<T: Elem>(ctx: &Ctx<'_, T>, panels: Range<usize>) {
    run_with::<AVX2, T>(ctx, panels);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
unsafe fn run_avx512<T: Elem>(ctx: &Ctx<'_, T>, panels: Range<usize>) {
    run_with::<AVX512, T>(ctx, panels);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma")]
unsafe fn run_avx512_bf16<T: Elem>(ctx: &Ctx<'_, T>, panels: Range<usize>) {
    run_with::<AVX512_BF16, T>(ctx, panels);
}

/// The width of a row of x as the tiles of `L` read it: `k` floats, or at AVX512_BF16 its
/// `ceil(k / 2)` bf16 pairs (`linear_avx512::bf16_pairs`).
#[inline(always)]
fn x_width<const L: u8>(k: usize) -> usize {
    if L == AVX512_BF16 {
        k.div_ceil(2)
    } else {
        k
    }
}

#[inline(always)]
fn run_with<const L: u8, T: Elem>(ctx: &Ctx<'_, T>, panels: Range<usize>) {
    if ctx.m <= DIRECT_MAX_ROWS {
        run_direct::<L, T>(ctx, panels);
    } else {
        run_blocked::<L, T>(ctx, panels);
    }
}

/// Few rows (memory-bound): each tile walks its whole panel over x in place, so the weight is
/// one sequential read (AVX-512's tiles hold every row, so it is read once).
#[inline(always)]
fn run_direct<const L: u8, T: Elem>(ctx: &Ctx<'_, T>, panels: Range<usize>) {
    #[cfg(target_arch = "x86_64")]
    if L == AVX512_BF16 {
        // x's pairs once per thread and call (a thread may be given several runs of panels)
        return PAIRS.with(|pairs| {
            let mut pairs = pairs.borrow_mut();
            let (call, xs) = &mut *pairs;
            if *call != ctx.call {
                linear_avx512::bf16_pairs_into(ctx.x, ctx.k, xs);
                *call = ctx.call;
            }
            run_direct_over::<L, T>(ctx, xs, panels)
        });
    }
    run_direct_over::<L, T>(ctx, ctx.x, panels);
}

/// `run_direct` over x as the tiles of `L` read it (`xs`, `[m, x_width(k)]`).
#[inline(always)]
fn run_direct_over<const L: u8, T: Elem>(ctx: &Ctx<'_, T>, xs: &[f32], panels: Range<usize>) {
    let k = ctx.k;
    let xk = x_width::<L>(k);
    #[cfg(target_arch = "x86_64")]
    if L == AVX512_BF16 && ctx.group > 1 {
        return run_direct_grouped(ctx, xs, panels);
    }
    #[cfg(target_arch = "x86_64")]
    if L == AVX512_BF16 && ctx.m <= 2 * TILE_ROWS {
        return run_direct_wide(ctx, xs, panels);
    }
    let height = if L >= AVX512 {
        DIRECT_MAX_ROWS
    } else {
        TILE_ROWS
    };
    debug_assert!(ctx.group == 1, "grouped panels run in run_direct_grouped");
    for p in panels {
        let w = &ctx.w[p * k * PANEL..(p + 1) * k * PANEL];
        let mut row = 0;
        while row < ctx.m {
            let rows = (ctx.m - row).min(height);
            let x = &xs[row * xk..(row + rows) * xk];
            let mut acc = [[0.0f32; PANEL]; DIRECT_MAX_ROWS];
            tile_rows::<L, T, false>(true, rows, x, x, w, Pairs::PLAIN, k, xk, &mut acc[..rows]);
            store(ctx, &acc[..rows], row, p * PANEL);
            row += rows;
        }
    }
}

/// `run_direct_over` at AVX512_BF16 for up to `2 * TILE_ROWS` rows of plain panels: the panels
/// a few at a time (`linear_avx512::wide_panels`), each step's x broadcast once for all of them
/// (the last panels of the range, fewer than a group, one at a time). The same sums as one
/// panel at a time, bit for bit.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn run_direct_wide<T: Elem>(ctx: &Ctx<'_, T>, xs: &[f32], panels: Range<usize>) {
    let (k, m) = (ctx.k, ctx.m);
    let xk = x_width::<AVX512_BF16>(k);
    debug_assert!(xs.len() == m * xk && (1..=2 * TILE_ROWS).contains(&m) && ctx.group == 1);
    let group = linear_avx512::wide_panels(m);
    let mut acc = [[0.0f32; PANEL]; 4 * TILE_ROWS];
    let mut p = panels.start;
    while p < panels.end {
        let g = if panels.end - p >= group { group } else { 1 };
        let w = &ctx.w[p * k * PANEL..(p + g) * k * PANEL];
        let sums = &mut acc[..g * m];
        sums.fill([0.0; PANEL]);
        // SAFETY: AVX512_BF16 runs only inside `run_avx512_bf16`, on a CPU with AVX-512
        // F/BW/VL and BF16; x holds m rows of xk pairs, w g plain panels of k steps, sums g * m
        // rows (g is wide_panels(m) or 1).
        unsafe {
            let (x, w, plain) = (xs.as_ptr(), w.as_ptr(), Pairs::PLAIN);
            if g == 1 {
                linear_avx512::tile_pairs_direct(m, x, w, plain, k, xk, sums);
            } else {
                linear_avx512::tile_pairs_wide_direct(m, x, w, k * PANEL, plain, k, xk, sums);
            }
        }
        for j in 0..g {
            store(ctx, &sums[j * m..(j + 1) * m], 0, (p + j) * PANEL);
        }
        p += g;
    }
}

// a grouped weight's group is as wide as the widest decode tile (`run_direct_grouped`)
#[cfg(target_arch = "x86_64")]
const _: () = assert!(PANEL_GROUP == 4 && 4 * TILE_ROWS <= 32);

/// `run_direct_over` at AVX512_BF16 over grouped panels (`ctx.group > 1`, up to
/// `DIRECT_MAX_ROWS` rows): each whole group by tiles as wide as the group, so its weights are
/// one stream; the rows in tiles of at most `TILE_ROWS` (the wide tile's 24 sums), and with more
/// than one tile the group in `K_BLOCK`-step slices that stay in L1 while every tile passes over
/// them (the tiles continue their sums slice after slice). Panels outside whole groups (a range
/// not starting at one) run one at a time. The same sums as plain panels, bit for bit.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn run_direct_grouped<T: Elem>(ctx: &Ctx<'_, T>, xs: &[f32], panels: Range<usize>) {
    let (k, m, g) = (ctx.k, ctx.m, ctx.group);
    let xk = x_width::<AVX512_BF16>(k);
    debug_assert!(xs.len() == m * xk && m <= DIRECT_MAX_ROWS && k.is_multiple_of(2));
    let slice = if m <= TILE_ROWS { k } else { K_BLOCK };
    let stride = ctx.panel_stride();
    let mut acc = [[0.0f32; PANEL]; PANEL_GROUP * DIRECT_MAX_ROWS];
    let mut p = panels.start;
    while p < panels.end {
        let (start, pairs) = ctx.panel_at(p);
        if panels.end - p < g || !ctx.side_by_side(p, g) {
            let w = &ctx.w[start..start + pairs_extent(k, pairs.stride)];
            let sums = &mut acc[..m];
            sums.fill([0.0; PANEL]);
            // SAFETY: AVX512_BF16 runs only inside `run_avx512_bf16` (the CPU has AVX-512
            // F/BW/VL and BF16); x holds m rows of xk pairs, w the panel's k steps, sums m rows.
            unsafe {
                linear_avx512::tile_pairs_direct(m, xs.as_ptr(), w.as_ptr(), pairs, k, xk, sums)
            };
            store(ctx, sums, 0, p * PANEL);
            p += 1;
            continue;
        }
        // tile t (rows `row..row + rows`) keeps panel j's sums at acc[row * g + j * rows..]
        acc[..g * m].fill([0.0; PANEL]);
        for k0 in (0..k).step_by(slice) {
            let depth = slice.min(k - k0);
            let at = start + k0 / 2 * pairs.stride;
            let w = &ctx.w[at..at + (g - 1) * stride + pairs_extent(depth, pairs.stride)];
            for row in (0..m).step_by(TILE_ROWS) {
                let rows = TILE_ROWS.min(m - row);
                let x = &xs[row * xk + k0 / 2..];
                let sums = &mut acc[row * g..(row + rows) * g];
                // SAFETY: as above; x holds the tile's rows from pair k0 / 2 (rows of xk
                // pairs, depth / 2 of them read), w the group's slice, sums g * rows rows
                // (wide_panels(rows) == g for rows <= TILE_ROWS).
                unsafe {
                    linear_avx512::tile_pairs_wide_direct(
                        rows,
                        x.as_ptr(),
                        w.as_ptr(),
                        stride,
                        pairs,
                        depth,
                        xk,
                        sums,
                    )
                };
            }
        }
        for row in (0..m).step_by(TILE_ROWS) {
            let rows = TILE_ROWS.min(m - row);
            let sums = &acc[row * g..(row + rows) * g];
            for j in 0..g {
                store(ctx, &sums[j * rows..(j + 1) * rows], row, (p + j) * PANEL);
            }
        }
        p += g;
    }
}

/// Prefill-sized row counts (compute-bound), BLIS-style: x is packed into tiles of `[K, rows]`
/// (each step's broadcasts are adjacent floats) once per thread and call, and walked in M
/// blocks (`X_BLOCK_BYTES`) that stay in L2 while every panel of the run passes over them,
/// `K_BLOCK` weight rows at a time: each slice of a panel stays in L1 while every tile of the
/// block runs over it. A tile's partial sums wait in a small scratch between slices, and the
/// next slice continues the same FMA chain in order, so the sums are bit-identical to
/// `run_direct`'s.
#[inline(always)]
fn run_blocked<const L: u8, T: Elem>(ctx: &Ctx<'_, T>, panels: Range<usize>) {
    let k = ctx.k;
    // M blocks of at most X_BLOCK_BYTES, as even as whole tiles allow (a last block of a few
    // rows would stream the whole run of weights for little work)
    let tiles_at_once = if L >= AVX512 { 2 } else { 1 };
    let xk = x_width::<L>(k);
    let most = (X_BLOCK_BYTES / (4 * xk)).max(TILE_ROWS);
    let block = ctx
        .m
        .div_ceil(ctx.m.div_ceil(most))
        .next_multiple_of(TILE_ROWS);
    SCRATCH.with(|scratch| {
        let mut scratch = scratch.borrow_mut();
        let Scratch { call, packed, acc } = &mut *scratch;
        // a thread given several runs of panels in one call packs x for the first only
        if *call != ctx.call {
            packed.resize(ctx.m * xk, 0.0);
            #[cfg(target_arch = "x86_64")]
            if L == AVX512_BF16 {
                pack_pairs(ctx.x, k, packed);
            } else {
                pack_rows(ctx.x, k, packed);
            }
            #[cfg(not(target_arch = "x86_64"))]
            pack_rows(ctx.x, k, packed);
            *call = ctx.call;
        }
        // AVX512_BF16: two panels side by side (each pair of x read once for both, 24 sums), or
        // a whole group of grouped panels (one tile: its K slice is one run of memory)
        let wide = match L {
            AVX512_BF16 if ctx.group > 1 => ctx.group,
            AVX512_BF16 => 2,
            _ => 1,
        };
        let ntiles = block.min(ctx.m).div_ceil(TILE_ROWS);
        acc.resize(wide * ntiles, [[0.0; PANEL]; TILE_ROWS]);
        let mut first = 0;
        while first < ctx.m {
            let end = (first + block).min(ctx.m);
            // block starts are whole tiles: the block's tiles are packed[first * k..end * k]
            let xs = &packed[first * xk..end * xk];
            let count = (end - first).div_ceil(TILE_ROWS);
            let mut p = panels.start;
            while p < panels.end {
                let side_by_side = panels.end - p >= wide && ctx.side_by_side(p, wide);
                let g = if side_by_side { wide } else { 1 };
                let (start, pairs) = ctx.panel_at(p);
                // panel j's tile t sums in tiles[j * count + t]
                let tiles = &mut acc[..g * count];
                tiles.fill([[0.0; PANEL]; TILE_ROWS]);
                let step = if g > 2 { 1 } else { tiles_at_once };
                let mut k0 = 0;
                while k0 < k {
                    let depth = (k - k0).min(K_BLOCK);
                    let w = &ctx.w[start + k0 / 2 * pairs.stride..];
                    // the tiles `step` at a time (AVX-512: two, a full one and the next)
                    for s in 0..count.div_ceil(step) {
                        let row = s * step * TILE_ROWS;
                        let rows = (end - first - row).min(step * TILE_ROWS);
                        // the depth slice of each tile: its rows' steps k0..k0 + depth (K_BLOCK
                        // is even: a slice starts at a whole bf16 pair)
                        let (x0, x1) = (x_width::<L>(k0), x_width::<L>(k0 + depth));
                        let slice = |row: usize, rows: usize| {
                            &xs[row * xk + x0 * rows..row * xk + x1 * rows]
                        };
                        let xa = slice(row, rows.min(TILE_ROWS));
                        let xb = if rows > TILE_ROWS {
                            slice(row + TILE_ROWS, rows - TILE_ROWS)
                        } else {
                            xa
                        };
                        let at = s * step..((s + 1) * step).min(count);
                        #[cfg(target_arch = "x86_64")]
                        if g > 2 {
                            let stride = ctx.panel_stride();
                            group_slice(rows, xa, w, (stride, pairs), depth, xk, tiles, s, count);
                            continue;
                        }
                        let (ta, tb) = tiles.split_at_mut(count);
                        let sums = ta[at.clone()].as_flattened_mut();
                        if g == 2 {
                            #[cfg(target_arch = "x86_64")]
                            wide_slice(
                                rows,
                                xa,
                                xb,
                                w,
                                (ctx.panel_stride(), pairs),
                                depth,
                                xk,
                                sums,
                                tb[at].as_flattened_mut(),
                            );
                            continue;
                        }
                        // the first tiles over a slice read it from memory
                        tile_rows::<L, T, true>(
                            s == 0,
                            rows,
                            xa,
                            xb,
                            &w[..pairs_extent(depth, pairs.stride)],
                            pairs,
                            depth,
                            xk,
                            &mut sums[..rows],
                        );
                    }
                    k0 += depth;
                }
                for (j, part) in tiles.chunks(count).enumerate() {
                    for (t, sums) in part.iter().enumerate() {
                        let row = t * TILE_ROWS;
                        let rows = (end - first - row).min(TILE_ROWS);
                        store(ctx, &sums[..rows], first + row, (p + j) * PANEL);
                    }
                }
                p += g;
            }
            first = end;
        }
    });
}

/// One K slice of a whole group of grouped panels for packed tile `t` (`rows` rows, up to
/// `TILE_ROWS`) at AVX512_BF16 (`linear_avx512::tile_pairs_group_packed`): `w` starts at the
/// group's slice, its panels `stride` elements apart; the sums continue panel j's
/// `tiles[j * count + t]`.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn group_slice<T: Elem>(
    rows: usize,
    xa: &[f32],
    w: &[T],
    (stride, pairs): (usize, Pairs),
    depth: usize,
    xk: usize,
    tiles: &mut [TileSums],
    t: usize,
    count: usize,
) {
    assert!(rows <= TILE_ROWS && tiles.len() == PANEL_GROUP * count && t < count);
    assert!(w.len() >= (PANEL_GROUP - 1) * stride + pairs_extent(depth, pairs.stride));
    let base = tiles.as_mut_ptr();
    // SAFETY: each pointer is a distinct tile of `tiles` (j * count + t < its length, asserted)
    // whose first `rows` rows the tile continues; called only at AVX512_BF16 (inside
    // `run_avx512_bf16`: the CPU has AVX-512 F/BW/VL and BF16); w holds the group's slice
    // (asserted), xa the tile's packed pairs.
    unsafe {
        let acc = std::array::from_fn(|j| base.add(j * count + t).cast::<[f32; PANEL]>());
        linear_avx512::tile_pairs_group_packed(
            rows,
            xa.as_ptr(),
            w.as_ptr(),
            stride,
            pairs,
            depth,
            xk,
            acc,
        );
    }
}

/// One K slice of two panels for a tile pair of `rows` packed rows at AVX512_BF16
/// (`linear_avx512::tile_pairs_wide_packed`): `w` starts at the first panel's slice, the second
/// `stride` elements on, its pairs of weight rows lying as `pairs` says; the sums continue
/// `sums_a` (first panel) and `sums_b`'s rows.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn wide_slice<T: Elem>(
    rows: usize,
    xa: &[f32],
    xb: &[f32],
    w: &[T],
    (stride, pairs): (usize, Pairs),
    depth: usize,
    xk: usize,
    sums_a: &mut [[f32; PANEL]],
    sums_b: &mut [[f32; PANEL]],
) {
    assert!(w.len() >= stride + pairs_extent(depth, pairs.stride));
    // SAFETY: called only at AVX512_BF16 (inside `run_avx512_bf16`: the CPU has AVX-512
    // F/BW/VL and BF16); w holds both slices (asserted), x the tiles' packed pairs; the sums'
    // rows are checked by the tile.
    unsafe {
        linear_avx512::tile_pairs_wide_packed(
            rows,
            xa.as_ptr(),
            xb.as_ptr(),
            w.as_ptr(),
            stride,
            pairs,
            depth,
            xk,
            sums_a,
            sums_b,
        );
    }
}

/// A register tile's sums (`TILE_ROWS` rows of one panel).
type TileSums = [[f32; PANEL]; TILE_ROWS];

/// One thread's buffers for `run_blocked`, kept between calls so that a prefill does not
/// allocate per layer (x's copy is as large as the largest call's x: rows x K floats).
struct Scratch {
    /// The call (`Ctx::call`) whose x `packed` holds.
    call: u64,
    /// x as `pack_rows` lays it out.
    packed: Vec<f32>,
    /// The partial sums of an M block's tiles for one panel.
    acc: Vec<TileSums>,
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = const {
        RefCell::new(Scratch { call: 0, packed: Vec::new(), acc: Vec::new() })
    };
    /// The direct path's x as bf16 pairs (AVX512_BF16) and the call (`Ctx::call`) it is of.
    static PAIRS: RefCell<(u64, Vec<f32>)> = const { RefCell::new((0, Vec::new())) };
}

/// Numbers the calls of `linear` (from 1: a fresh `Scratch` holds none).
static CALLS: AtomicU64 = AtomicU64::new(1);

/// Rows `x [rows, k]` as tiles of `TILE_ROWS` rows (the last may have fewer), each stored as
/// `[k, rows]`: `packed[t * TILE_ROWS * k + i * rows + r] = x[(t * TILE_ROWS + r) * k + i]`.
fn pack_rows(x: &[f32], k: usize, packed: &mut [f32]) {
    let m = x.len() / k;
    let mut row = 0;
    while row < m {
        let rows = (m - row).min(TILE_ROWS);
        let dst = &mut packed[row * k..(row + rows) * k];
        for r in 0..rows {
            let src = &x[(row + r) * k..(row + r + 1) * k];
            for (i, v) in src.iter().enumerate() {
                dst[i * rows + r] = *v;
            }
        }
        row += rows;
    }
}

/// `pack_rows` of x's `bf16_pairs` (`[rows, ceil(k / 2)]`) in one pass, from x `[rows, k]`.
#[cfg(target_arch = "x86_64")]
fn pack_pairs(x: &[f32], k: usize, packed: &mut [f32]) {
    let (m, xk) = (x.len() / k, k.div_ceil(2));
    let mut row = 0;
    while row < m {
        let rows = (m - row).min(TILE_ROWS);
        let dst = &mut packed[row * xk..(row + rows) * xk];
        for r in 0..rows {
            let src = &x[(row + r) * k..(row + r + 1) * k];
            for (i, s) in src.chunks(2).enumerate() {
                dst[i * rows + r] =
                    linear_avx512::bf16_pair(s[0], s.get(1).copied().unwrap_or(0.0));
            }
        }
        row += rows;
    }
}

/// The level `L`'s tile for a runtime row count `rows` (1..=TILE_ROWS; at AVX-512 up to
/// DIRECT_MAX_ROWS in place, or two packed tiles: `xa` a full one, `xb` the next). `k` is the
/// width of a row of x in place (`x_width`), `depth` the weight rows (k steps) to run, their
/// pairs lying as `pairs` says (other than `Pairs::PLAIN` in grouped panels only, which
/// AVX512_BF16 alone reads).
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn tile_rows<const L: u8, T: Elem, const PACKED: bool>(
    prefetch: bool,
    rows: usize,
    xa: &[f32],
    xb: &[f32],
    w: &[T],
    pairs: Pairs,
    depth: usize,
    k: usize,
    acc: &mut [[f32; PANEL]],
) {
    debug_assert!(acc.len() == rows && w.len() == pairs_extent(depth, pairs.stride));
    debug_assert!(L == AVX512_BF16 || pairs == Pairs::PLAIN);
    #[cfg(target_arch = "x86_64")]
    if L >= AVX512 {
        let steps = x_width::<L>(depth);
        debug_assert!(if PACKED {
            xa.len() == steps * rows.min(TILE_ROWS)
                && (rows <= TILE_ROWS || xb.len() == steps * (rows - TILE_ROWS))
        } else {
            xa.len() == rows * k && steps == k
        });
        let (xa, xb, w) = (xa.as_ptr(), xb.as_ptr(), w.as_ptr());
        // SAFETY: `L` is AVX512 (AVX512_BF16) only inside `run_avx512` (`run_avx512_bf16`),
        // which runs only where the CPU has AVX-512 F/BW/VL (and BF16); x, w and acc hold what
        // the tile reads and writes (asserted above).
        unsafe {
            match (L == AVX512_BF16, PACKED) {
                (false, false) => linear_avx512::tile_direct(rows, xa, w, k, acc),
                (false, true) => {
                    linear_avx512::tile_packed(prefetch, rows, xa, xb, w, depth, k, acc)
                }
                (true, false) => {
                    linear_avx512::tile_pairs_direct(rows, xa, w, pairs, depth, k, acc)
                }
                (true, true) => {
                    linear_avx512::tile_pairs_packed(rows, xa, xb, w, pairs, depth, k, acc)
                }
            }
        }
        return;
    }
    let _ = (xb, prefetch);
    let f = L == AVX2;
    match (rows, f) {
        (1, false) => tile::<false, T, 1, PACKED>(xa, w, depth, k, acc),
        (2, false) => tile::<false, T, 2, PACKED>(xa, w, depth, k, acc),
        (3, false) => tile::<false, T, 3, PACKED>(xa, w, depth, k, acc),
        (4, false) => tile::<false, T, 4, PACKED>(xa, w, depth, k, acc),
        (5, false) => tile::<false, T, 5, PACKED>(xa, w, depth, k, acc),
        (_, false) => tile::<false, T, 6, PACKED>(xa, w, depth, k, acc),
        (1, true) => tile::<true, T, 1, PACKED>(xa, w, depth, k, acc),
        (2, true) => tile::<true, T, 2, PACKED>(xa, w, depth, k, acc),
        (3, true) => tile::<true, T, 3, PACKED>(xa, w, depth, k, acc),
        (4, true) => tile::<true, T, 4, PACKED>(xa, w, depth, k, acc),
        (5, true) => tile::<true, T, 5, PACKED>(xa, w, depth, k, acc),
        (_, true) => tile::<true, T, 6, PACKED>(xa, w, depth, k, acc),
    }
}

/// Where step `i` of row `r` of a tile's x is: rows of `k` in place, or packed `[depth, R]`.
#[inline(always)]
fn x_at<const PACKED: bool, const R: usize>(r: usize, i: usize, k: usize) -> usize {
    if PACKED {
        i * R + r
    } else {
        r * k + i
    }
}

/// Writes a tile's sums (plus the bias) to rows `row..` and columns `col..col + PANEL` of out,
/// those that exist (the last panel's padding columns are dropped).
#[inline(always)]
fn store<T: Elem>(ctx: &Ctx<'_, T>, acc: &[[f32; PANEL]], row: usize, col: usize) {
    let cols = (ctx.n - col).min(PANEL);
    for (r, sums) in acc.iter().enumerate() {
        // SAFETY: row + r < m and col + cols <= n: inside out `[m, n]`; no other share
        // writes these columns (OutPtr).
        let dst =
            unsafe { std::slice::from_raw_parts_mut(ctx.out.0.add((row + r) * ctx.n + col), cols) };
        match ctx.bias {
            Some(b) => {
                for ((d, s), b) in dst.iter_mut().zip(sums).zip(&b[col..col + cols]) {
                    *d = T::from_f32(s + b.to_f32());
                }
            }
            None => {
                for (d, s) in dst.iter_mut().zip(sums) {
                    *d = T::from_f32(*s);
                }
            }
        }
    }
}

/// `acc[r][j] += x(r, i) * w[i * PANEL + j]` for `i` in `0..depth` in order (one FMA chain per
/// element, continuing the sums in `acc`), for the tile's `R` rows; `x(r, i)` is `x_at`.
#[inline(always)]
fn tile<const F: bool, T: Elem, const R: usize, const PACKED: bool>(
    x: &[f32],
    w: &[T],
    depth: usize,
    k: usize,
    acc: &mut [[f32; PANEL]],
) {
    debug_assert!(w.len() == depth * PANEL && acc.len() >= R);
    debug_assert!(x.len() == if PACKED { depth * R } else { R * k } && depth <= k);
    #[cfg(target_arch = "x86_64")]
    if F {
        // SAFETY: `F` is true only inside `run_avx2_fma`, which runs only on a CPU with avx2
        // and fma; the slices' lengths are those the loads read (asserted above).
        unsafe { tile_avx2_fma::<T, R, PACKED>(x, w, depth, k, acc) };
        return;
    }
    for i in 0..depth {
        let wi = &w[i * PANEL..(i + 1) * PANEL];
        for r in 0..R {
            let a = x[x_at::<PACKED, R>(r, i, k)];
            for (s, wv) in acc[r].iter_mut().zip(wi) {
                *s += a * wv.to_f32();
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn tile_avx2_fma<T: Elem, const R: usize, const PACKED: bool>(
    x: &[f32],
    w: &[T],
    depth: usize,
    k: usize,
    acc: &mut [[f32; PANEL]],
) {
    use std::arch::x86_64::*;

    use super::simd::load8;
    let (px, pw) = (x.as_ptr(), w.as_ptr());
    let mut sums = [[_mm256_setzero_ps(); 2]; R];
    for (s, src) in sums.iter_mut().zip(acc.iter()) {
        s[0] = _mm256_loadu_ps(src.as_ptr());
        s[1] = _mm256_loadu_ps(src.as_ptr().add(8));
    }
    // every load reads inside x (x_at of r < R, i < depth) and w[i * PANEL..(i + 1) * PANEL]
    for i in 0..depth {
        let lo = load8(pw.add(i * PANEL));
        let hi = load8(pw.add(i * PANEL + 8));
        for (r, s) in sums.iter_mut().enumerate() {
            let a = _mm256_broadcast_ss(&*px.add(x_at::<PACKED, R>(r, i, k)));
            s[0] = _mm256_fmadd_ps(a, lo, s[0]);
            s[1] = _mm256_fmadd_ps(a, hi, s[1]);
        }
    }
    for (dst, s) in acc.iter_mut().zip(&sums) {
        _mm256_storeu_ps(dst.as_mut_ptr(), s[0]);
        _mm256_storeu_ps(dst.as_mut_ptr().add(8), s[1]);
    }
}

#[cfg(test)]
mod tests {
    use ndarray::{Array2, Array3};

    use super::*;
    use crate::cpu::elem::Bf16;

    fn values(len: usize, seed: f32) -> Vec<f32> {
        (0..len).map(|i| ((i as f32 + seed) * 0.37).sin()).collect()
    }

    /// `x W^T + b` in f64 over the given f32 values.
    fn reference(x: &Array2<f32>, w: &Array2<f32>, b: Option<&[f32]>) -> Array2<f64> {
        let (m, k) = x.dim();
        let n = w.dim().0;
        Array2::from_shape_fn((m, n), |(r, c)| {
            let dot: f64 = (0..k).map(|i| x[[r, i]] as f64 * w[[c, i]] as f64).sum();
            dot + b.map_or(0.0, |b| b[c] as f64)
        })
    }

    fn run_f32(x: &Array2<f32>, w: &Array2<f32>, b: Option<&[f32]>, threads: usize) -> Array2<f32> {
        run_tiles::<f32>(widening(), x, w, b, threads)
    }

    /// `linear` of element type `T` with the tile set `tiles`, from f32 values (rounded to
    /// `T`), as f32.
    fn run_tiles<T: Elem>(
        tiles: u8,
        x: &Array2<f32>,
        w: &Array2<f32>,
        b: Option<&[f32]>,
        threads: usize,
    ) -> Array2<f32> {
        let (n, k) = w.dim();
        let w = w.mapv(T::from_f32);
        let panels =
            Array3::from_shape_vec((n.div_ceil(PANEL), k, PANEL), pack_panels(w.view())).unwrap();
        let b: Option<Vec<T>> = b.map(|b| b.iter().map(|v| T::from_f32(*v)).collect());
        let mut out = Array2::from_elem((x.dim().0, n), T::from_f32(f32::NAN));
        let x = x.mapv(T::from_f32);
        linear_with(
            tiles,
            x.view(),
            panels.view(),
            b.as_deref(),
            out.view_mut(),
            threads,
        )
        .unwrap();
        out.mapv(T::to_f32)
    }

    /// The tile sets this process can run for `T` (every one up to its own).
    fn tile_sets<T: Elem>() -> Vec<u8> {
        (PORTABLE..=tiles_at::<T>(isa::level())).collect()
    }

    /// The widening tile set of the process (its f32 one; bf16 may take AVX512_BF16 above it).
    fn widening() -> u8 {
        tiles_at::<f32>(isa::level())
    }

    /// Direct tiles of every height up to 16, blocked ones as pairs and single tiles, K slices,
    /// ragged panels.
    const LEVEL_SHAPES: [(usize, usize, usize); 9] = [
        (1, 7, 5),
        (4, 64, 33),
        (8, 100, 16),
        (13, 40, 47),
        (16, 300, 17),
        (17, 600, 37),
        (23, 256, 16),
        (40, 5, 3),
        (70, 700, 53),
    ];

    #[test]
    fn every_tile_set_up_to_the_processes_matches_a_float64_reference() {
        let mut checked = Vec::new();
        for tiles in tile_sets::<f32>() {
            for (m, k, n) in LEVEL_SHAPES {
                let x = Array2::from_shape_vec((m, k), values(m * k, 31.0)).unwrap();
                let w = Array2::from_shape_vec((n, k), values(n * k, 32.0)).unwrap();
                let b = values(n, 33.0);
                let want = reference(&x, &w, Some(&b));
                for threads in [1, 2] {
                    let got = run_tiles::<f32>(tiles, &x, &w, Some(&b), threads);
                    for (g, w) in got.iter().zip(&want) {
                        let tol = 1e-6 * k as f64;
                        assert!(
                            (*g as f64 - w).abs() < tol,
                            "{tiles} {m}x{k}x{n}: {g} vs {w}"
                        );
                    }
                }
            }
            checked.push(tiles);
        }
        // the process's own set among them (a forced lower level's or the machine's)
        let want = match isa::level() {
            IsaLevel::Portable => vec![PORTABLE],
            IsaLevel::Avx2 => vec![PORTABLE, AVX2],
            _ => vec![PORTABLE, AVX2, AVX512],
        };
        assert_eq!(checked, want);
    }

    #[test]
    fn every_bf16_tile_set_matches_a_float64_reference_to_bf16_rounding() {
        // the reference of the bf16 values; the output is rounded to bf16 once (2^-9 relative),
        // the pair tiles' sums differ from the FMA chain's by a few f32 roundings
        for tiles in tile_sets::<Bf16>() {
            for (m, k, n) in LEVEL_SHAPES {
                let round = |v: Vec<f32>| -> Vec<f32> { v.into_iter().map(Bf16::round).collect() };
                let x = Array2::from_shape_vec((m, k), round(values(m * k, 37.0))).unwrap();
                let w = Array2::from_shape_vec((n, k), round(values(n * k, 38.0))).unwrap();
                let b = round(values(n, 39.0));
                let want = reference(&x, &w, Some(&b));
                let got = run_tiles::<Bf16>(tiles, &x, &w, Some(&b), 2);
                for (g, w) in got.iter().zip(&want) {
                    let tol = w.abs() / 256.0 + 1e-6 * k as f64;
                    assert!(
                        (*g as f64 - w).abs() <= tol,
                        "{tiles} {m}x{k}x{n}: {g} vs {w}"
                    );
                }
            }
        }
        let top = tiles_at::<Bf16>(isa::level());
        assert_eq!(tile_sets::<Bf16>().last(), Some(&top));
        let pairs = isa::has(isa::Extension::Avx512Bf16);
        assert_eq!(top == AVX512_BF16, pairs, "checked up to tile set {top}");
    }

    #[test]
    fn widening_simd_tile_sets_give_bit_identical_float32_and_bf16_products() {
        // every lane is the same FMA chain over k at AVX2 and AVX-512: the products must agree
        // bit for bit (the greedy outputs identical across ISA levels rest on it)
        let simd: Vec<u8> = tile_sets::<f32>()
            .into_iter()
            .filter(|t| *t >= AVX2)
            .collect();
        for (m, k, n) in LEVEL_SHAPES {
            let x = Array2::from_shape_vec((m, k), values(m * k, 34.0)).unwrap();
            let w = Array2::from_shape_vec((n, k), values(n * k, 35.0)).unwrap();
            let b = values(n, 36.0);
            for &tiles in simd.iter().skip(1) {
                for threads in [1, 2] {
                    assert_eq!(
                        run_tiles::<f32>(tiles, &x, &w, Some(&b), threads),
                        run_tiles::<f32>(AVX2, &x, &w, Some(&b), 1),
                        "f32 tile set {tiles} vs AVX2, {m}x{k}x{n}, {threads} threads",
                    );
                    assert_eq!(
                        run_tiles::<Bf16>(tiles, &x, &w, Some(&b), threads),
                        run_tiles::<Bf16>(AVX2, &x, &w, Some(&b), 1),
                        "bf16 tile set {tiles} vs AVX2, {m}x{k}x{n}, {threads} threads",
                    );
                }
            }
        }
        // what was compared: every SIMD set this process runs (none below AVX2, one at AVX2)
        let want = match isa::level() {
            IsaLevel::Portable => vec![],
            IsaLevel::Avx2 => vec![AVX2],
            _ => vec![AVX2, AVX512],
        };
        assert_eq!(simd, want);
    }

    #[test]
    fn a_bf16_rows_result_does_not_depend_on_the_batch_at_the_processes_tile_set() {
        // at AVX512_BF16 too: the direct and blocked paths pair the same k steps (odd K: the
        // last pair half empty; K slices start at even steps)
        let tiles = tiles_at::<Bf16>(isa::level());
        for (m, k, n) in [(20, 301, 37), (70, 700, 53)] {
            let x = Array2::from_shape_vec((m, k), values(m * k, 40.0)).unwrap();
            let w = Array2::from_shape_vec((n, k), values(n * k, 41.0)).unwrap();
            let all = run_tiles::<Bf16>(tiles, &x, &w, None, 2);
            for r in [0, 5, 6, 13, m - 1] {
                let row = x.slice(ndarray::s![r..r + 1, ..]).to_owned();
                let one = run_tiles::<Bf16>(tiles, &row, &w, None, 1);
                assert_eq!(
                    one.row(0),
                    all.row(r),
                    "tile set {tiles}, {m}x{k}x{n}, row {r}"
                );
            }
        }
    }

    #[test]
    fn grouped_panels_give_the_plain_panels_bits_for_every_row_count_and_run_of_panels() {
        // two groups of panels, K over two K_BLOCK slices; runs of panels that start and end
        // inside groups as well as whole ones
        let (k, n) = (600, 2 * PANEL_GROUP * PANEL);
        let group = panel_group::<Bf16>(n / PANEL, k);
        if tiles_at::<Bf16>(isa::level()) != AVX512_BF16 {
            assert_eq!(group, 1, "only AVX-512 BF16's tiles read grouped panels");
            return;
        }
        assert_eq!(group, PANEL_GROUP);
        assert_eq!(
            panel_group::<Bf16>(n / PANEL, k + 1),
            1,
            "an odd K stays plain"
        );
        assert_eq!(
            panel_group::<Bf16>(n / PANEL + 1, k),
            1,
            "a part group stays plain"
        );
        assert_eq!(panel_group::<f32>(n / PANEL, k), 1, "f32 stays plain");
        let w = Array2::from_shape_vec((n, k), values(n * k, 7.0)).unwrap();
        let plain = pack_panels(w.mapv(Bf16::from_f32).view());
        let grouped = group_panels(&plain, k, group);
        let runs = [0..8, 0..4, 4..8, 1..7, 3..5, 2..3, 5..8];
        for m in [1, 2, 5, 6, 7, 8, 12, 13, 16, 17, 40] {
            let x = values(m * k, m as f32);
            let x: Vec<f32> = x.iter().map(|v| Bf16::from_f32(*v).to_f32()).collect();
            for run_of in runs.clone() {
                let product = |w: &[Bf16], group: usize| {
                    let mut out = vec![Bf16::from_f32(f32::NAN); m * n];
                    // SAFETY: out holds m * n elements and outlives the product
                    let ctx = unsafe { Ctx::new(&x, w, group, out.as_mut_ptr(), m, k, n) };
                    run(&ctx, run_of.clone());
                    out
                };
                let (want, got) = (product(&plain, 1), product(&grouped, group));
                let cols = run_of.start * PANEL..run_of.end * PANEL;
                for r in 0..m {
                    let row = r * n..(r + 1) * n;
                    let (want, got) = (&want[row.clone()][cols.clone()], &got[row][cols.clone()]);
                    assert!(
                        want.iter().zip(got).all(|(a, b)| a.0 == b.0),
                        "{m} rows, panels {run_of:?}, row {r}"
                    );
                }
            }
        }
    }

    #[test]
    fn bf16_direct_rows_of_every_height_give_the_blocked_paths_bits() {
        // 1..=16 rows take the direct path (at AVX512_BF16: 4 panels side by side up to 6
        // rows, 2 up to 12, the tail panels one at a time); each row must equal its row of a
        // blocked batch, whatever the grouping of panels (10 panels: groups and a tail)
        let tiles = tiles_at::<Bf16>(isa::level());
        let (k, n) = (301, 9 * PANEL + 5);
        let w = Array2::from_shape_vec((n, k), values(n * k, 42.0)).unwrap();
        let x = Array2::from_shape_vec((DIRECT_MAX_ROWS + 4, k), values(20 * k, 43.0)).unwrap();
        let blocked = run_tiles::<Bf16>(tiles, &x, &w, None, 1);
        for m in 1..=DIRECT_MAX_ROWS {
            let rows = x.slice(ndarray::s![..m, ..]).to_owned();
            for threads in [1, 2] {
                let got = run_tiles::<Bf16>(tiles, &rows, &w, None, threads);
                assert_eq!(
                    got,
                    blocked.slice(ndarray::s![..m, ..]),
                    "tile set {tiles}, {m} rows, {threads} threads"
                );
            }
        }
    }

    #[test]
    fn f32_matches_a_float64_reference_for_every_tile_height_and_ragged_panels() {
        for (m, k, n) in [
            (1, 7, 5),
            (3, 40, 33),
            (6, 64, 16),
            (7, 33, 47),
            (13, 100, 17),
        ] {
            let x = Array2::from_shape_vec((m, k), values(m * k, 1.0)).unwrap();
            let w = Array2::from_shape_vec((n, k), values(n * k, 2.0)).unwrap();
            let b = values(n, 3.0);
            for bias in [None, Some(&b[..])] {
                let got = run_f32(&x, &w, bias, 1);
                let want = reference(&x, &w, bias);
                for (g, w) in got.iter().zip(&want) {
                    assert!((*g as f64 - w).abs() < 1e-4, "{m}x{k}x{n}: {g} vs {w}");
                }
            }
        }
    }

    #[test]
    fn a_rows_result_does_not_depend_on_the_batch_or_threads() {
        let (k, n) = (300, 16 * 70 + 3);
        let x = Array2::from_shape_vec((20, k), values(20 * k, 4.0)).unwrap();
        let w = Array2::from_shape_vec((n, k), values(n * k, 5.0)).unwrap();
        let all = run_f32(&x, &w, None, 1);
        let threaded = run_f32(&x, &w, None, 3);
        assert_eq!(all, threaded);
        for r in [0, 5, 6, 19] {
            let one = run_f32(&x.slice(ndarray::s![r..r + 1, ..]).to_owned(), &w, None, 1);
            assert_eq!(one.row(0), all.row(r), "row {r}");
        }
    }

    #[test]
    fn blocked_rows_match_a_float64_reference_for_ragged_blocks_of_m_k_and_n() {
        // more than DIRECT_MAX_ROWS rows: x packed, K in slices of K_BLOCK. K = 600 is 2 whole
        // slices and a ragged one; 250 rows at K = 600 are 3 M blocks, the last tile ragged;
        // N = 37 pads the last panel
        for (m, k, n) in [(17, 600, 37), (23, 256, 16), (250, 600, 37), (40, 5, 3)] {
            let x = Array2::from_shape_vec((m, k), values(m * k, 11.0)).unwrap();
            let w = Array2::from_shape_vec((n, k), values(n * k, 12.0)).unwrap();
            let b = values(n, 13.0);
            for bias in [None, Some(&b[..])] {
                let want = reference(&x, &w, bias);
                for threads in [1, 2] {
                    let got = run_f32(&x, &w, bias, threads);
                    for (g, w) in got.iter().zip(&want) {
                        assert!((*g as f64 - w).abs() < 1e-3, "{m}x{k}x{n}: {g} vs {w}");
                    }
                }
            }
        }
    }

    #[test]
    fn blocked_rows_continue_the_direct_paths_fma_chain_bit_for_bit() {
        // 70 rows at K = 2100 (3 M blocks of ~30 rows, 9 K slices, 2 threads) against each row
        // alone (the direct path over all of K at once)
        let (m, k, n) = (70, 2100, 16 * 3 + 5);
        let x = Array2::from_shape_vec((m, k), values(m * k, 14.0)).unwrap();
        let w = Array2::from_shape_vec((n, k), values(n * k, 15.0)).unwrap();
        let b = values(n, 16.0);
        let batch = run_f32(&x, &w, Some(&b), 2);
        assert_eq!(batch, run_f32(&x, &w, Some(&b), 1));
        for r in [0, 29, 30, 31, 63, 69] {
            let one = run_f32(
                &x.slice(ndarray::s![r..r + 1, ..]).to_owned(),
                &w,
                Some(&b),
                1,
            );
            assert_eq!(one.row(0), batch.row(r), "row {r}");
        }
    }

    #[test]
    fn each_call_packs_its_own_x_even_at_the_same_shape() {
        // the thread's packed copy of x is tagged with its call: a second call on the same
        // thread, same shape, other values must not reuse the first call's copy
        let (m, k, n) = (30, 40, 20);
        let w = Array2::from_shape_vec((n, k), values(n * k, 20.0)).unwrap();
        for seed in [21.0, 22.0] {
            let x = Array2::from_shape_vec((m, k), values(m * k, seed)).unwrap();
            let want = reference(&x, &w, None);
            for (g, w) in run_f32(&x, &w, None, 1).iter().zip(&want) {
                assert!((*g as f64 - w).abs() < 1e-4, "seed {seed}: {g} vs {w}");
            }
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn pack_pairs_packs_the_rows_bf16_pairs() {
        // odd k (the last pair's high half zero), a last tile of 2 rows
        let (m, k) = (8, 7);
        let x: Vec<f32> = values(m * k, 5.0).iter().map(|v| Bf16::round(*v)).collect();
        let xk = k.div_ceil(2);
        let mut want = vec![0.0f32; m * xk];
        pack_rows(&linear_avx512::bf16_pairs(&x, k), xk, &mut want);
        let mut got = vec![0.0f32; m * xk];
        pack_pairs(&x, k, &mut got);
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&got), bits(&want));
    }

    #[test]
    fn pack_rows_stores_each_tile_step_major() {
        // 8 rows of 3: a tile of 6 then one of 2
        let x: Vec<f32> = (0..24).map(|v| v as f32).collect();
        let mut packed = vec![0.0; 24];
        pack_rows(&x, 3, &mut packed);
        let first: Vec<f32> = (0..3)
            .flat_map(|i| (0..6).map(move |r| (r * 3 + i) as f32))
            .collect();
        assert_eq!(packed[..18], first[..]);
        assert_eq!(packed[18..], [18.0, 21.0, 19.0, 22.0, 20.0, 23.0]);
    }

    /// bf16 x, weight and bias `[m, k] x [n, k]` (values seeded by `seed`, `seed + 1`, `seed +
    /// 2`) give, on each of `threads` at the widening tiles, the f32 product of their widened
    /// values rounded once.
    fn check_bf16_matches_widened_f32(m: usize, k: usize, n: usize, seed: f32, threads: &[usize]) {
        let bf16 =
            |len, s| -> Vec<Bf16> { values(len, s).into_iter().map(Bf16::from_f32).collect() };
        let (xb, wb, bb) = (
            bf16(m * k, seed),
            bf16(n * k, seed + 1.0),
            bf16(n, seed + 2.0),
        );
        let xw = Array2::from_shape_vec((m, k), xb.iter().map(|v| v.to_f32()).collect()).unwrap();
        let ww = Array2::from_shape_vec((n, k), wb.iter().map(|v| v.to_f32()).collect()).unwrap();
        let bw: Vec<f32> = bb.iter().map(|v| v.to_f32()).collect();
        let want = run_f32(&xw, &ww, Some(&bw), 1);

        let x = Array2::from_shape_vec((m, k), xb).unwrap();
        let w = Array2::from_shape_vec((n, k), wb).unwrap();
        let panels =
            Array3::from_shape_vec((n.div_ceil(PANEL), k, PANEL), pack_panels(w.view())).unwrap();
        for &t in threads {
            let mut out = Array2::from_elem((m, n), Bf16(0));
            // the widening tiles (AVX512_BF16 sums pairs: its own tests above)
            linear_with(
                widening(),
                x.view(),
                panels.view(),
                Some(&bb),
                out.view_mut(),
                t,
            )
            .unwrap();
            for (g, w) in out.iter().zip(&want) {
                assert_eq!(*g, Bf16::from_f32(*w));
            }
        }
    }

    #[test]
    fn bf16_blocked_rows_sum_the_widened_values_like_f32() {
        check_bf16_matches_widened_f32(20, 300, 21, 17.0, &[1, 2]);
    }

    #[test]
    fn bf16_sums_the_widened_values_in_f32_and_rounds_once() {
        check_bf16_matches_widened_f32(3, 45, 21, 6.0, &[1]);
    }

    #[test]
    fn portable_and_avx2_tiles_agree_within_rounding_and_packed_slices_continue_the_chain() {
        let (k, n) = (77, 16);
        let x = values(6 * k, 9.0);
        let w: Vec<f32> = pack_panels(
            Array2::from_shape_vec((n, k), values(n * k, 10.0))
                .unwrap()
                .view(),
        );
        let mut portable = [[0.0f32; PANEL]; TILE_ROWS];
        tile::<false, f32, 6, false>(&x, &w, k, k, &mut portable);
        // the packed layout of the same rows, in two slices (the second continues the sums)
        let mut packed_x = vec![0.0; 6 * k];
        pack_rows(&x, k, &mut packed_x);
        let mut sliced = [[0.0f32; PANEL]; TILE_ROWS];
        tile::<false, f32, 6, true>(&packed_x[..6 * 40], &w[..40 * PANEL], 40, k, &mut sliced);
        tile::<false, f32, 6, true>(
            &packed_x[6 * 40..],
            &w[40 * PANEL..],
            k - 40,
            k,
            &mut sliced,
        );
        assert_eq!(portable, sliced);
        #[cfg(target_arch = "x86_64")]
        if crate::cpu::simd::has_avx2_fma() {
            let mut fast = [[0.0f32; PANEL]; TILE_ROWS];
            // SAFETY: the CPU has avx2 and fma (checked above)
            unsafe { tile_avx2_fma::<f32, 6, false>(&x, &w, k, k, &mut fast) };
            for (a, b) in portable.iter().flatten().zip(fast.iter().flatten()) {
                assert!((a - b).abs() < 1e-4, "{a} vs {b}");
            }
            let mut fast_sliced = [[0.0f32; PANEL]; TILE_ROWS];
            // SAFETY: as above
            unsafe {
                tile_avx2_fma::<f32, 6, true>(
                    &packed_x[..240],
                    &w[..40 * PANEL],
                    40,
                    k,
                    &mut fast_sliced,
                );
                tile_avx2_fma::<f32, 6, true>(
                    &packed_x[240..],
                    &w[40 * PANEL..],
                    k - 40,
                    k,
                    &mut fast_sliced,
                );
            }
            assert_eq!(fast, fast_sliced);
        }
    }

    #[test]
    fn shapes_that_do_not_fit_are_rejected_with_the_reason() {
        let x = Array2::<f32>::zeros((2, 8));
        let panels = Array3::<f32>::zeros((2, 8, PANEL));
        let mut out = Array2::<f32>::zeros((2, 40));
        let err = linear(x.view(), panels.view(), None, out.view_mut(), 1).unwrap_err();
        assert!(format!("{err}").contains("out has shape"), "{err}");
        let mut out = Array2::<f32>::zeros((2, 20));
        let err = linear(x.view(), panels.view(), Some(&[0.0; 3]), out.view_mut(), 1).unwrap_err();
        assert!(format!("{err}").contains("bias has 3 elements"), "{err}");
        let wide = Array2::<f32>::zeros((2, 9));
        let err = linear(wide.view(), panels.view(), None, out.view_mut(), 1).unwrap_err();
        assert!(
            format!("{err}").contains("weight panels have shape"),
            "{err}"
        );
    }
}
