//! Q4_0 and Q5_0 rows repacked for the one-row VNNI products (`QType::Q4_0R`, `QType::Q5_0R`),
//! written once at load into the CPU worker's huge-page copy of the weights
//! (`worker/weight_pages.py`), in place of the plain copy: the same bytes per row, the same values.
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
//! A Q5_0 block (22 bytes) has a 32-bit qh between its scale and nibbles: bit j is element
//! j's bit 4. Repacked, a group is its `n` scales (2n bytes), the low 16 bits of each block's
//! qh (2n bytes: elements 0-15, the low nibbles' bits), the high 16 bits of each (2n bytes:
//! elements 16-31), then the nibbles as Q4_0R's (16n bytes): 4 blocks' low (high) nibbles'
//! bits 4 are one 64-bit mask load, which adds 16 to those bytes in one instruction. A full
//! group (8 blocks) stores instead 4 64-bit masks (2n bytes twice) and its nibbles' 4-byte
//! words transposed (`q5_0_masks_and_words`): each 64-byte load holds words 2c, 2c + 1 of all 8
//! blocks and one mask for its low and one for its high nibbles, so `vnni4` sums each block in
//! the same two lanes over the group.
//!
//! A Q8_0 block (34 bytes) is its scale and 32 signed codes. Repacked, a group is its `n`
//! scales (2n bytes) then its blocks' codes (32n bytes): in a full group (8 blocks) as an 8 x 8
//! matrix of 4-byte words transposed (word j of block b at word 8j + b, `transpose_words`), so
//! a 64-byte load holds words j, j + 1 of all 8 blocks and `q8_0r` sums each block in the same
//! two lanes of one accumulator over the group (no per-load reduction); a short last group keeps
//! its blocks' codes in order.
//!
//! A Q4_1 block (20 bytes) is its scale, its min and 16 bytes of nibbles. Repacked, a group is
//! its `n` scales (2n bytes), its `n` mins (2n), then the nibbles as Q4_0R's (16n), read by
//! `q4_1r` four weight rows a pass (with x's permuted planes; the mins in their own lanes).
//!
//! The VNNI products (four weight rows a pass at one row of x and, two rows of x a call, at
//! 2-8: `vnni4`, `q8_0r`, `matmul::repacked_passes`) and the integer panels' widening (> 8
//! rows: `int16::avx2::repacked_codes`, `gemm16`) read the groups where they are; every other
//! path reads a repacked row back as the plain type's blocks (`blocks`, `standard_row`). The
//! same codes and scales either way, so every result equals the plain type's bit for bit.
use super::formats::QType;
use crate::cpu::invalid;
use crate::error::Result;

/// Blocks a group.
pub const GROUP: usize = 8;
/// Bytes of the largest group (Q8_0R's): a buffer for one group read back as plain blocks.
pub const GROUP_BYTES_MAX: usize = GROUP * 34;

/// The repacked type of rows of `t`, if it has one.
pub fn repacked_type(t: QType) -> Option<QType> {
    match t {
        QType::Q4_0 => Some(QType::Q4_0R),
        QType::Q5_0 => Some(QType::Q5_0R),
        QType::Q8_0 => Some(QType::Q8_0R),
        QType::Q4_1 => Some(QType::Q4_1R),
        _ => None,
    }
}

/// Whether `t` is a repacked type (`QType::Q4_0R`, `QType::Q5_0R`, `QType::Q8_0R`,
/// `QType::Q4_1R`).
pub fn repacked(t: QType) -> bool {
    matches!(t, QType::Q4_0R | QType::Q5_0R | QType::Q8_0R | QType::Q4_1R)
}

/// Whether weights of type `t` are repacked (to `repacked_type(t)`) when this process copies
/// them: Q4_0, Q5_0 and Q8_0, where the VNNI products read the repacked layouts (AVX-512 with VNNI
/// granted; elsewhere every path would only convert them back).
pub fn repacks(t: QType) -> bool {
    repacked_type(t).is_some() && super::vnni()
}

/// Bytes of a block of the plain type and of its fields between the scale and the codes (Q5_0's
/// qh, Q4_1's min; 0 for Q4_0 and Q8_0), each 2 bytes of which a group keeps together.
fn block_and_qh(t: QType) -> (usize, usize) {
    match read_as(t) {
        QType::Q5_0 => (22, 4),
        QType::Q4_1 => (20, 2),
        QType::Q8_0 => (34, 0),
        _ => (18, 0),
    }
}

/// Rows `src` of type `t` (Q4_0, Q5_0 or Q8_0, `k` elements each) repacked into `dst` (as many
/// bytes), returning the repacked type; an error for another type or unless both hold the same
/// whole number of rows.
pub fn repack(t: QType, src: &[u8], dst: &mut [u8], k: usize) -> Result<QType> {
    let Some(to) = repacked_type(t) else {
        return Err(invalid(format!(
            "{} rows have no repacked layout",
            t.name()
        )));
    };
    let row = t.row_bytes(k)?;
    if src.len() != dst.len() || !src.len().is_multiple_of(row) {
        return Err(invalid(format!(
            "repacking {} rows of {k} elements ({row} bytes): source {} bytes, destination \
             {} bytes (both must be the same whole rows)",
            t.name(),
            src.len(),
            dst.len()
        )));
    }
    let (block, qh) = block_and_qh(t);
    for (s, d) in src.chunks_exact(row).zip(dst.chunks_exact_mut(row)) {
        for (sg, dg) in s.chunks(GROUP * block).zip(d.chunks_mut(GROUP * block)) {
            let n = sg.len() / block;
            for (j, b) in sg.chunks_exact(block).enumerate() {
                // the scale, then each 2 bytes of the fields after it (Q4_1's min; Q5_0's qh low
                // 16 bits, then its high 16 bits), each with its kind
                for i in 0..1 + qh / 2 {
                    let at = 2 * i * n + 2 * j;
                    dg[at..at + 2].copy_from_slice(&b[2 * i..2 * i + 2]);
                }
                // the codes: 16 bytes of nibbles (Q4_0, Q5_0) or 32 bytes (Q8_0)
                let (at, codes) = ((2 + qh) * n + (block - 2 - qh) * j, block - 2 - qh);
                dg[at..at + codes].copy_from_slice(&b[2 + qh..]);
            }
            if n == GROUP {
                match t {
                    QType::Q8_0 => transpose_words(&mut dg[2 * GROUP..]),
                    QType::Q5_0 => q5_0_masks_and_words(dg, true),
                    _ => {}
                }
            }
        }
    }
    Ok(to)
}

/// Repacked bytes `src` of type `t` (whole groups of one row from a group's start: full
/// groups, the last perhaps the row's short one) as the plain type's blocks they hold, into
/// `out` (as many bytes).
pub fn blocks(t: QType, src: &[u8], out: &mut [u8]) {
    let (block, qh) = block_and_qh(t);
    debug_assert!(src.len() == out.len() && src.len().is_multiple_of(block));
    let mut copy = [0u8; GROUP_BYTES_MAX];
    for (sg, og) in src.chunks(GROUP * block).zip(out.chunks_mut(GROUP * block)) {
        let n = sg.len() / block;
        let sg = if n == GROUP && matches!(t, QType::Q8_0R | QType::Q5_0R) {
            // a full Q8_0R / Q5_0R group as its blocks in order, on a copy
            let copy = &mut copy[..sg.len()];
            copy.copy_from_slice(sg);
            if t == QType::Q8_0R {
                transpose_words(&mut copy[2 * GROUP..]);
            } else {
                q5_0_masks_and_words(copy, false);
            }
            &copy[..]
        } else {
            sg
        };
        for (j, b) in og.chunks_exact_mut(block).enumerate() {
            for i in 0..1 + qh / 2 {
                let at = 2 * i * n + 2 * j;
                b[2 * i..2 * i + 2].copy_from_slice(&sg[at..at + 2]);
            }
            let (at, codes) = ((2 + qh) * n + (block - 2 - qh) * j, block - 2 - qh);
            b[2 + qh..].copy_from_slice(&sg[at..at + codes]);
        }
    }
}

/// The 256 bytes `codes` (a full Q8_0 group's, 8 blocks of 32) as an 8 x 8 matrix of 4-byte
/// words (row b: block b's words 0-7) transposed in place: word j of block b moves to word
/// 8j + b and back (its own inverse).
fn transpose_words(codes: &mut [u8]) {
    let mut w = [[0u8; 4]; GROUP * 8];
    for (w, c) in w.iter_mut().zip(codes.chunks_exact(4)) {
        w.copy_from_slice(c);
    }
    for (i, c) in codes[..GROUP * 32].chunks_exact_mut(4).enumerate() {
        let (b, j) = (i / 8, i % 8);
        c.copy_from_slice(&w[8 * j + b]);
    }
}

/// A full Q5_0R group (8 blocks, 176 bytes) from its blocks-in-order form (`to`: the scales,
/// each block's qh low halves, then high halves, then each block's 16 bytes of nibbles) to the
/// stored one, or back (`!to`): the scales; then 4 64-bit masks, for each half c of the nibbles
/// (c = 0, 1) the bits 4 of the low nibbles' elements then of the high nibbles' (bit 4l + i of
/// mask (c, h): element 16h + 4j + i of block l % 8, j = 2c + l / 8); then the nibbles' 4-byte
/// words transposed (word j of block b at word 8j + b), so the 64-byte half c holds words 2c,
/// 2c + 1 of all 8 blocks and mask (c, h) adds the 16s of its low (h = 0) or high nibbles in one
/// masked add (`vnni4`).
fn q5_0_masks_and_words(g: &mut [u8], to: bool) {
    const QH: usize = 2 * GROUP;
    const NIBBLES: usize = 6 * GROUP;
    let mut qh = [0u32; GROUP];
    let mut masks = [0u64; 4];
    if to {
        for (b, q) in qh.iter_mut().enumerate() {
            let lo = u16::from_le_bytes([g[QH + 2 * b], g[QH + 2 * b + 1]]);
            let hi = u16::from_le_bytes([g[2 * QH + 2 * b], g[2 * QH + 2 * b + 1]]);
            *q = u32::from(lo) | (u32::from(hi) << 16);
        }
    } else {
        for (c, m) in masks.iter_mut().enumerate() {
            let at = QH + 8 * c;
            *m = u64::from_le_bytes(g[at..at + 8].try_into().unwrap());
        }
    }
    for (c, h, l, i) in
        (0..4).flat_map(|ch| (0..16).flat_map(move |l| (0..4).map(move |i| (ch / 2, ch % 2, l, i))))
    {
        let (b, j) = (l % 8, 2 * c + l / 8);
        let (bit, mbit) = (16 * h + 4 * j + i, 4 * l + i);
        let m = &mut masks[2 * c + h];
        if to {
            *m |= u64::from(qh[b] >> bit & 1) << mbit;
        } else {
            qh[b] |= ((*m >> mbit & 1) as u32) << bit;
        }
    }
    if to {
        for (c, m) in masks.iter().enumerate() {
            g[QH + 8 * c..QH + 8 * c + 8].copy_from_slice(&m.to_le_bytes());
        }
    } else {
        for (b, q) in qh.iter().enumerate() {
            g[QH + 2 * b..QH + 2 * b + 2].copy_from_slice(&(*q as u16).to_le_bytes());
            g[2 * QH + 2 * b..2 * QH + 2 * b + 2]
                .copy_from_slice(&((*q >> 16) as u16).to_le_bytes());
        }
    }
    // 32 words of nibbles: 8 x 4 (block b's word j at 4b + j) <-> 4 x 8 (at 8j + b)
    let mut w = [[0u8; 4]; 4 * GROUP];
    for (w, c) in w.iter_mut().zip(g[NIBBLES..].chunks_exact(4)) {
        w.copy_from_slice(c);
    }
    for (i, c) in g[NIBBLES..NIBBLES + 16 * GROUP]
        .chunks_exact_mut(4)
        .enumerate()
    {
        let from = if to {
            // word i is 8j + b
            4 * (i % 8) + i / 8
        } else {
            // word i is 4b + j
            8 * (i % 4) + i / 4
        };
        c.copy_from_slice(&w[from]);
    }
}

/// Repacked bytes `src` of type `t` (whole groups, as `blocks` takes them) dequantized into
/// `dst` a group at a time by `dequantize` (the plain type's blocks to their elements).
pub fn dequantize_groups(
    t: QType,
    src: &[u8],
    dst: &mut [f32],
    mut dequantize: impl FnMut(&[u8], &mut [f32]),
) {
    let (block, _) = block_and_qh(t);
    let mut plain = [0u8; GROUP_BYTES_MAX];
    for (g, y) in src.chunks(GROUP * block).zip(dst.chunks_mut(GROUP * 32)) {
        let b = &mut plain[..g.len()];
        blocks(t, g, b);
        dequantize(b, y);
    }
}

/// The type the kernels other than the VNNI products read rows of `t` as.
pub fn read_as(t: QType) -> QType {
    match t {
        QType::Q4_0R => QType::Q4_0,
        QType::Q5_0R => QType::Q5_0,
        QType::Q8_0R => QType::Q8_0,
        QType::Q4_1R => QType::Q4_1,
        _ => t,
    }
}

/// Row `row` of type `t` as the kernels other than the VNNI products read it: a repacked row
/// converted into `buf` as its plain type, any other row as it is.
pub fn standard_row<'a>(t: QType, row: &'a [u8], buf: &'a mut Vec<u8>) -> (QType, &'a [u8]) {
    if !repacked(t) {
        return (t, row);
    }
    buf.resize(row.len(), 0);
    blocks(t, row, buf);
    (read_as(t), buf)
}
