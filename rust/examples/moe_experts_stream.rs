//! The bf16 grouped-expert kernel alone (`cpu::moe_experts`, one thread): time a layer and the
//! GB/s of the chosen experts' weights, at the benches' Qwen3-MoE shape (64 experts of width 512,
//! hidden 1,024, top-8), four layers' experts on huge pages called in turn (so each call streams
//! from memory), random routing. Plain panels (`1`) against the groups the kernel reads here
//! (`4` where `linear::panel_group` groups them; the weights' values do not matter for time).
//!
//!     cargo run --release --example moe_experts_stream -- [tokens] [reps] [group]
use ndarray::{ArrayView2, ArrayView4, ArrayViewMut2};
use pagedllm::cpu::{moe_experts, Bf16, Elem};
use std::time::Instant;

#[path = "huge_mapping.rs"]
mod huge_mapping;

const EXPERTS: usize = 64;
const HIDDEN: usize = 1024;
const WIDTH: usize = 512;
const TOP_K: usize = 8;
const LAYERS: usize = 4;

/// `n` bf16 weights on huge pages (as the engine places experts).
fn mapping(n: usize) -> &'static [Bf16] {
    huge_mapping::filled(n, true, |i| {
        Bf16::from_f32(((i * 7919 % 1000) as f32 - 500.0) * 1e-4)
    })
}

fn main() {
    let arg = |i: usize, default: usize| {
        std::env::args()
            .nth(i)
            .map_or(default, |a| a.parse().expect("integer arguments"))
    };
    let (m, reps, g) = (arg(1, 8), arg(2, 30), arg(3, 1));
    let gate_up: Vec<_> = (0..LAYERS)
        .map(|_| mapping(EXPERTS * 2 * WIDTH * HIDDEN))
        .collect();
    let down: Vec<_> = (0..LAYERS)
        .map(|_| mapping(EXPERTS * HIDDEN * WIDTH))
        .collect();
    let x: Vec<Bf16> = (0..m * HIDDEN)
        .map(|j| Bf16::from_f32(((j * 31 % 97) as f32 - 48.0) * 0.01))
        .collect();
    let mut out = vec![Bf16::from_f32(0.0); m * HIDDEN];
    let mut seed = 12345u64;
    let (mut times, mut chosen) = (Vec::new(), 0usize);
    for r in 0..(reps + 1) * LAYERS {
        let l = r % LAYERS;
        let mut ids = vec![0i64; m * TOP_K];
        for t in 0..m {
            let picked = &mut ids[t * TOP_K..(t + 1) * TOP_K];
            let mut n = 0;
            while n < TOP_K {
                seed = seed
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                let e = ((seed >> 33) % EXPERTS as u64) as i64;
                if !picked[..n].contains(&e) {
                    picked[n] = e;
                    n += 1;
                }
            }
        }
        let mut distinct = ids.clone();
        distinct.sort_unstable();
        distinct.dedup();
        let weights = vec![1.0 / TOP_K as f32; m * TOP_K];
        let shape = |panels: usize, depth: usize| (EXPERTS, panels / g, depth, 16 * g);
        let gu = ArrayView4::from_shape(shape(2 * WIDTH / 16, HIDDEN), gate_up[l]).unwrap();
        let dn = ArrayView4::from_shape(shape(HIDDEN / 16, WIDTH), down[l]).unwrap();
        let start = Instant::now();
        moe_experts(
            ArrayView2::from_shape((m, HIDDEN), &x).unwrap(),
            gu,
            dn,
            ArrayView2::from_shape((m, TOP_K), &ids).unwrap(),
            ArrayView2::from_shape((m, TOP_K), &weights).unwrap(),
            ArrayViewMut2::from_shape((m, HIDDEN), &mut out).unwrap(),
            1,
        )
        .expect("group 4 needs AVX-512 BF16");
        if r >= LAYERS {
            times.push(start.elapsed().as_secs_f64());
            chosen += distinct.len();
        }
    }
    times.sort_by(f64::total_cmp);
    let mean = times.iter().sum::<f64>() / times.len() as f64;
    let experts = chosen as f64 / times.len() as f64;
    let bytes = experts * (3 * WIDTH * HIDDEN * 2) as f64;
    println!(
        "{m} tokens, group {g}: median {:.3} ms a layer, {experts:.1} experts, {:.1} GB/s (mean)",
        times[times.len() / 2] * 1e3,
        bytes / mean / 1e9
    );
}
