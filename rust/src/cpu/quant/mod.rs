//! Linear layers over weights kept in their GGUF types (ggml's block formats: Q8_0, Q4_0,
//! Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, and F16 / BF16 / F32 rows), as the file stores them.
//!
//! A weight `[N, K]` is a list of row segments, each of one type (`QuantMatrix`; fused q/k/v
//! projections of a Q4_K_M file mix types). `quant_linear` multiplies f32 activations by the
//! weights dequantized on the fly, summing in f32, so its result equals `x @ dequantize(W).T`
//! up to summation order:
//! - at decode row counts (`DECODE_MAX_ROWS`) the product is memory-bound: each weight row is
//!   streamed once, a chunk of it dequantized into an L1 buffer and dotted with every row of x
//!   while it is there; threads take runs of output rows;
//! - above that (prefill chunks, compute-bound) each thread dequantizes a panel of output rows
//!   once into an L2-sized f32 scratch in `linear`'s panel layout and runs `linear`'s register
//!   tiles over it for all rows of x, 16 at a time (read in place, no packing).
//!   With 16-bit activations, weights all of quantized types take integer panels instead
//!   (`gemm16`; `vpdpwssd` at AVX-512 with VNNI, and the decode rows' VNNI products in `vnni`).
//!
//! Dequantization (`formats`, portable; `formats_avx2`, runtime-detected) is bit-exact with
//! the `gguf` package's.
mod dot_avx2;
pub mod formats;
mod formats_avx2;
mod gemm16;
mod int16;
mod int8;
#[cfg(target_arch = "x86_64")]
mod kquant4;
mod matmul;
#[cfg(target_arch = "x86_64")]
mod q4_1r;
#[cfg(target_arch = "x86_64")]
mod q8_0r;
mod quantize;
pub mod repack;
#[cfg(target_arch = "x86_64")]
mod vnni;
#[cfg(target_arch = "x86_64")]
mod vnni4;

#[cfg(test)]
mod gemm_tests;
#[cfg(test)]
mod repack_tests;
#[cfg(test)]
mod tests;
#[cfg(all(test, target_arch = "x86_64"))]
mod vnni_tests;

use std::ops::Range;

use ndarray::{ArrayView2, ArrayViewMut2};

pub use formats::QType;
pub use matmul::{quant_linear, quant_linear_with, Activations, DECODE_MAX_ROWS};

use super::invalid;
use crate::error::Result;

/// Rows of one ggml type: `rows` rows of `row_bytes(K)` bytes each, contiguous.
#[derive(Clone, Copy, Debug)]
pub struct Segment<'a> {
    pub qtype: QType,
    pub data: &'a [u8],
    pub rows: usize,
}

/// A weight `[N, K]` as row segments (`N` = the sum of their rows), validated.
#[derive(Debug)]
pub struct QuantMatrix<'a> {
    segments: Vec<Segment<'a>>,
    /// The first row of each segment, and `N` last.
    starts: Vec<usize>,
    k: usize,
}

impl<'a> QuantMatrix<'a> {
    /// The weight of `segments` with rows of `k` elements; an error naming the segment whose
    /// bytes do not make whole rows of its type.
    pub fn new(segments: Vec<Segment<'a>>, k: usize) -> Result<Self> {
        let mut starts = vec![0];
        for (i, s) in segments.iter().enumerate() {
            let row = s.qtype.row_bytes(k)?;
            if s.data.len() != s.rows * row {
                return Err(invalid(format!(
                    "segment {i} ({}) has {} bytes; {} rows of {k} elements take {}",
                    s.qtype.name(),
                    s.data.len(),
                    s.rows,
                    s.rows * row
                )));
            }
            starts.push(starts[i] + s.rows);
        }
        Ok(Self {
            segments,
            starts,
            k,
        })
    }

    /// Output features (rows).
    pub fn n(&self) -> usize {
        *self.starts.last().unwrap_or(&0)
    }

    /// Input features (elements of a row).
    pub fn k(&self) -> usize {
        self.k
    }

    /// Rows `rows` a segment at a time: (first row, type, bytes of a row, the rows' bytes), the
    /// segments walked once (no search or division per row).
    fn runs_in(
        &self,
        rows: Range<usize>,
    ) -> impl Iterator<Item = (usize, QType, usize, &'a [u8])> + '_ {
        let first = self
            .starts
            .partition_point(|start| *start <= rows.start)
            .max(1)
            - 1;
        self.segments[first..]
            .iter()
            .zip(&self.starts[first..])
            .map_while(move |(seg, start)| {
                let (from, to) = (rows.start.max(*start), rows.end.min(start + seg.rows));
                (from < to).then(|| {
                    let bytes = seg.data.len() / seg.rows;
                    let data = &seg.data[(from - start) * bytes..(to - start) * bytes];
                    (from, seg.qtype, bytes, data)
                })
            })
    }

    /// Row `r`'s type and bytes.
    fn row(&self, r: usize) -> (QType, &'a [u8]) {
        let s = self.starts.partition_point(|start| *start <= r) - 1;
        let seg = &self.segments[s];
        let bytes = seg.data.len() / seg.rows;
        let i = r - self.starts[s];
        (seg.qtype, &seg.data[i * bytes..(i + 1) * bytes])
    }
}

/// Elements `start..start + dst.len()` (whole blocks but perhaps the last) of a row of type
/// `t` dequantized into `dst`, on the AVX2 path when `fast`.
#[inline(always)]
fn dequantize_range(t: QType, row: &[u8], start: usize, dst: &mut [f32], fast: bool) {
    let (elems, bytes) = t.block();
    debug_assert!(start.is_multiple_of(elems) && dst.len().is_multiple_of(elems));
    let src = &row[start / elems * bytes..(start + dst.len()) / elems * bytes];
    #[cfg(target_arch = "x86_64")]
    if fast {
        // SAFETY: `fast` is set only where `formats_avx2::available()` said so.
        unsafe { formats_avx2::dequantize_blocks(t, src, dst) };
        return;
    }
    let _ = fast;
    formats::dequantize_blocks(t, src, dst);
}

/// Whether this CPU takes the AVX2 paths (checked once per call).
fn fast() -> bool {
    #[cfg(target_arch = "x86_64")]
    return formats_avx2::available();
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// Whether the kernels take the AVX-512 VNNI paths (`isa` grants `avx512vnni` at its level; a
/// lower `PAGEDLLM_CPU_ISA` turns them off).
fn vnni() -> bool {
    #[cfg(target_arch = "x86_64")]
    return crate::cpu::isa::has(crate::cpu::isa::Extension::Avx512Vnni);
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// The whole weight as f32 into `out [N, K]`.
pub fn dequantize(w: &QuantMatrix<'_>, mut out: ArrayViewMut2<f32>) -> Result<()> {
    if out.dim() != (w.n(), w.k()) {
        return Err(invalid(format!(
            "out has shape {:?}, expected [{}, {}]",
            out.shape(),
            w.n(),
            w.k()
        )));
    }
    let fast = fast();
    for (r, mut dst) in out.rows_mut().into_iter().enumerate() {
        let dst = dst
            .as_slice_mut()
            .ok_or_else(|| invalid("out must be contiguous"))?;
        let (t, row) = w.row(r);
        dequantize_range(t, row, 0, dst, fast);
    }
    Ok(())
}

/// Rows `ids` of the weight (an embedding table) as f32 into `out [ids.len(), K]`.
pub fn embedding(w: &QuantMatrix<'_>, ids: &[i64], mut out: ArrayViewMut2<f32>) -> Result<()> {
    if out.dim() != (ids.len(), w.k()) {
        return Err(invalid(format!(
            "out has shape {:?}, expected [{}, {}]",
            out.shape(),
            ids.len(),
            w.k()
        )));
    }
    let n = w.n();
    if let Some(bad) = ids.iter().find(|id| !(0..n as i64).contains(id)) {
        return Err(invalid(format!(
            "token id {bad} is outside the embedding's {n} rows"
        )));
    }
    let fast = fast();
    for (id, mut dst) in ids.iter().zip(out.rows_mut()) {
        let dst = dst
            .as_slice_mut()
            .ok_or_else(|| invalid("out must be contiguous"))?;
        let (t, row) = w.row(*id as usize);
        dequantize_range(t, row, 0, dst, fast);
    }
    Ok(())
}

/// `w [N, K]` quantized to `t` (Q8_0 or Q4_0) into `out [N, row_bytes(K)]`.
pub fn quantize(w: ArrayView2<f32>, t: QType, mut out: ArrayViewMut2<u8>) -> Result<()> {
    let (n, k) = w.dim();
    let row = t.row_bytes(k)?;
    if out.dim() != (n, row) {
        return Err(invalid(format!(
            "out has shape {:?}, expected [{n}, {row}] ({n} rows of {k} {} elements)",
            out.shape(),
            t.name()
        )));
    }
    let src = w
        .to_slice()
        .ok_or_else(|| invalid("the weight must be contiguous"))?;
    let dst = out
        .as_slice_mut()
        .ok_or_else(|| invalid("out must be contiguous"))?;
    quantize::quantize_blocks(t, src, dst)
}
