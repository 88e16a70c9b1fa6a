//! Q4_0 rows repacked for the one-row VNNI products (`QType::Q4_0R`), written once at load
//! into the CPU worker's huge-page copy of the weights (`worker/weight_pages.py`), in place of
//! the plain copy: the same bytes per row, the same values.
//!
//! A Q4_0 block is an f16 scale and 16 bytes of nibbles (18 bytes), so a row's nibbles come in
//! 16-byte pieces 18 bytes apart and its scales 2 bytes 18 apart: the VNNI products assembled
//! 64 codes from two pieces (two loads, an insert, a shift) and gathered 8 scales word by word.
//! Repacked, a row is groups of 8 blocks (the products' unit of work; the last group of a row
//! holds the rest, `k / 32 % 8` blocks), each group its `n` scales (2n bytes) then its blocks'
//! 16-byte nibble pieces in order (16n bytes): 4 blocks' nibbles are one 64-byte load and 8
//! scales one 16-byte load. A row keeps `k / 32 · 18` bytes, so row slices, tensor-parallel
//! row shards and the huge-page buffer's sizes are those of Q4_0.
//!
//! Every path but the VNNI products reads a repacked row back as Q4_0 blocks (`q4_0_blocks`,
//! `standard_row`): the same codes and scales, so every result equals Q4_0's bit for bit.
use super::formats::QType;
use crate::cpu::invalid;
use crate::error::Result;

/// Blocks a group.
pub const GROUP: usize = 8;
/// Bytes of a Q4_0 block.
const BLOCK: usize = 18;

/// Whether weights of type `t` are repacked (to `QType::Q4_0R`) when this process copies them:
/// Q4_0, where the VNNI products read the repacked layout (AVX-512 with VNNI granted; elsewhere
/// every path would only convert them back).
pub fn repacks(t: QType) -> bool {
    t == QType::Q4_0 && super::vnni()
}

/// Q4_0 rows `src` (`k` elements each) repacked into `dst` (as many bytes); an error unless both
/// hold the same whole number of rows.
pub fn repack_q4_0(src: &[u8], dst: &mut [u8], k: usize) -> Result<()> {
    let row = QType::Q4_0.row_bytes(k)?;
    if src.len() != dst.len() || !src.len().is_multiple_of(row) {
        return Err(invalid(format!(
            "repacking Q4_0 rows of {k} elements ({row} bytes): source {} bytes, destination \
             {} bytes (both must be the same whole rows)",
            src.len(),
            dst.len()
        )));
    }
    for (s, d) in src.chunks_exact(row).zip(dst.chunks_exact_mut(row)) {
        for (sg, dg) in s.chunks(GROUP * BLOCK).zip(d.chunks_mut(GROUP * BLOCK)) {
            let n = sg.len() / BLOCK;
            let (scales, nibbles) = dg.split_at_mut(2 * n);
            for (j, b) in sg.chunks_exact(BLOCK).enumerate() {
                scales[2 * j..2 * j + 2].copy_from_slice(&b[..2]);
                nibbles[16 * j..16 * j + 16].copy_from_slice(&b[2..]);
            }
        }
    }
    Ok(())
}

/// Repacked bytes `src` (whole groups of one row from a group's start: full groups, the last
/// perhaps the row's short one) as the Q4_0 blocks they hold, into `out` (as many bytes).
pub fn q4_0_blocks(src: &[u8], out: &mut [u8]) {
    debug_assert!(src.len() == out.len() && src.len().is_multiple_of(BLOCK));
    for (sg, og) in src.chunks(GROUP * BLOCK).zip(out.chunks_mut(GROUP * BLOCK)) {
        let n = sg.len() / BLOCK;
        let (scales, nibbles) = sg.split_at(2 * n);
        for (j, b) in og.chunks_exact_mut(BLOCK).enumerate() {
            b[..2].copy_from_slice(&scales[2 * j..2 * j + 2]);
            b[2..].copy_from_slice(&nibbles[16 * j..16 * j + 16]);
        }
    }
}

/// Repacked bytes `src` (whole groups, as `q4_0_blocks` takes them) dequantized into `dst` a
/// group at a time by `dequantize` (Q4_0 blocks to their elements).
pub fn dequantize_groups(
    src: &[u8],
    dst: &mut [f32],
    mut dequantize: impl FnMut(&[u8], &mut [f32]),
) {
    let mut blocks = [0u8; GROUP * BLOCK];
    for (g, y) in src.chunks(GROUP * BLOCK).zip(dst.chunks_mut(GROUP * 32)) {
        let b = &mut blocks[..g.len()];
        q4_0_blocks(g, b);
        dequantize(b, y);
    }
}

/// The type the kernels other than the VNNI products read rows of `t` as.
pub fn read_as(t: QType) -> QType {
    if t == QType::Q4_0R {
        QType::Q4_0
    } else {
        t
    }
}

/// Row `row` of type `t` as the kernels other than the VNNI products read it: a repacked row
/// converted into `buf` as Q4_0, any other row as it is.
pub fn standard_row<'a>(t: QType, row: &'a [u8], buf: &'a mut Vec<u8>) -> (QType, &'a [u8]) {
    if t != QType::Q4_0R {
        return (t, row);
    }
    buf.resize(row.len(), 0);
    q4_0_blocks(row, buf);
    (QType::Q4_0, buf)
}
