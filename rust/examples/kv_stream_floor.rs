//! The read-bandwidth floor of CPU decode attention: a pure streaming loop (sum of every float)
//! over the same bytes the kernel reads at a decode step, each sequence's K and V blocks in its
//! block-table order, no arithmetic beyond the adds. The kernel cannot read its context faster
//! than this; `benches/cpu_attention_kernel.py` prints the kernel's GB/s to compare.
//!
//!     cargo run --release --example kv_stream_floor -- [threads] [seqs] [context]
//!
//! Defaults: 1 thread, 64 sequences of context 512, the 56M Llama's cache shape (4 KV heads,
//! head size 64, block size 16, f32: a block of one layer's K is 16 KiB). Variants, alternated
//! run by run (medians of 40): the caches on 4 KiB pages or on transparent huge pages
//! (`madvise(MADV_HUGEPAGE)` before first touch, as `CacheEngine` allocates them), blocks
//! scattered (a random permutation, as a long-running cache hands them out) or contiguous.
use std::time::Instant;

const BLOCK: usize = 16;
const KV_HEADS: usize = 4;
const HEAD_DIM: usize = 64;
const BLOCK_FLOATS: usize = BLOCK * KV_HEADS * HEAD_DIM;
#[path = "huge_mapping.rs"]
mod huge_mapping;

/// `floats` floats filled with a pattern in a mapping advised onto huge pages or not.
fn mapping(floats: usize, huge: bool) -> &'static [f32] {
    huge_mapping::filled(floats, huge, |i| (i % 7) as f32)
}

/// Sum of one block, four independent accumulators (the adds never wait on each other).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn sum_block(p: *const f32) -> f32 {
    use std::arch::x86_64::*;
    let mut a = [_mm256_setzero_ps(); 4];
    for i in (0..BLOCK_FLOATS).step_by(32) {
        for (k, a) in a.iter_mut().enumerate() {
            *a = _mm256_add_ps(*a, _mm256_loadu_ps(p.add(i + 8 * k)));
        }
    }
    let v = _mm256_add_ps(_mm256_add_ps(a[0], a[1]), _mm256_add_ps(a[2], a[3]));
    let mut out = [0f32; 8];
    _mm256_storeu_ps(out.as_mut_ptr(), v);
    out.iter().sum()
}

#[cfg(not(target_arch = "x86_64"))]
unsafe fn sum_block(p: *const f32) -> f32 {
    std::slice::from_raw_parts(p, BLOCK_FLOATS).iter().sum()
}

/// Every block of sequences `seqs`, K then V of each block, in table order.
fn stream(
    k: &[f32],
    v: &[f32],
    tables: &[usize],
    width: usize,
    seqs: std::ops::Range<usize>,
) -> f32 {
    let mut total = 0.0;
    for s in seqs {
        for &b in &tables[s * width..(s + 1) * width] {
            let at = b * BLOCK_FLOATS;
            // SAFETY: `b` < the blocks both caches hold; avx2 is checked in `main`.
            total += unsafe { sum_block(k[at..].as_ptr()) + sum_block(v[at..].as_ptr()) };
        }
    }
    total
}

fn main() {
    #[cfg(target_arch = "x86_64")]
    assert!(std::arch::is_x86_feature_detected!("avx2"), "needs AVX2");
    let arg = |i: usize, default: usize| {
        std::env::args()
            .nth(i)
            .map_or(default, |a| a.parse().expect("integer arguments"))
    };
    let (threads, seqs, context) = (arg(1, 1), arg(2, 64), arg(3, 512));
    let width = context.div_ceil(BLOCK);
    let blocks = seqs * width;
    let caches = [false, true].map(|huge| {
        (
            mapping(blocks * BLOCK_FLOATS, huge),
            mapping(blocks * BLOCK_FLOATS, huge),
        )
    });
    let contiguous: Vec<usize> = (0..blocks).collect();
    let mut scattered = contiguous.clone();
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    for i in (1..blocks).rev() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        scattered.swap(i, (x % (i as u64 + 1)) as usize);
    }
    let bytes = (2 * blocks * BLOCK_FLOATS * 4) as f64;
    let variants = [(false, true), (false, false), (true, true), (true, false)];
    let mut times = vec![Vec::new(); variants.len()];
    for _ in 0..40 {
        for (i, &(huge, scatter)) in variants.iter().enumerate() {
            let (k, v) = caches[huge as usize];
            let tables = if scatter { &scattered } else { &contiguous };
            let t = Instant::now();
            std::thread::scope(|scope| {
                for th in 0..threads {
                    let share = th * seqs / threads..(th + 1) * seqs / threads;
                    scope.spawn(move || std::hint::black_box(stream(k, v, tables, width, share)));
                }
            });
            times[i].push(t.elapsed().as_secs_f64());
        }
    }
    println!(
        "{seqs} sequences x context {context}, {threads} thread(s), {:.1} MB of K and V",
        bytes / 1e6
    );
    for (t, (huge, scatter)) in times.iter_mut().zip(variants) {
        t.sort_by(f64::total_cmp);
        let median = t[t.len() / 2];
        println!(
            "{:<5} pages, {:<10} blocks: {:7.2} ms  {:5.1} GB/s",
            if huge { "huge" } else { "4 KiB" },
            if scatter { "scattered" } else { "contiguous" },
            median * 1e3,
            bytes / median / 1e9
        );
    }
}
