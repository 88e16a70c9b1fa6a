//! Steady decode through the scheduler core alone (no Python): `running` single-sequence
//! requests with 512-token prompts, all decoding, one `schedule` + `update_from_output` per
//! step, outputs recycled. The loop to profile is `steady` (never inlined):
//!
//!     cargo build --release --example steady_decode
//!     valgrind --tool=callgrind --collect-atstart=no --toggle-collect='steady_decode::steady' \
//!         target/release/examples/steady_decode 1024 16 on 100
//!
//! Arguments: running (1024), block size (16), prefix caching on|off (on), steps (200),
//! drafts per sequence (0). With drafts k > 0 (speculative decoding, n-gram proposer, as
//! `benches/test_bench_spec_decode.py`): the prompts repeat a 32-token passage, each step is
//! `propose_drafts` + `schedule` + `update_from_output_runs` with every draft rejected, and
//! `schedule` alone is `spec_schedule` (toggle-collect it to count the scheduler's part):
//!
//!     valgrind --tool=callgrind --collect-atstart=no --toggle-collect='steady_decode::spec_schedule' \
//!         target/release/examples/steady_decode 1024 16 on 100 4
//!
//! Prints microseconds per step after 10 warm-up steps: wall clock, and on-CPU time (Linux's
//! per-thread schedstat; less disturbed on a shared machine, where the thread waits for a
//! core).
use std::time::Instant;

use pagedllm::kv::CacheConfig;
use pagedllm::scheduler::{
    Policy, PreemptionMode, RequestParams, Scheduler, SchedulerConfig, StepOutput, StopParams,
    Strategy,
};
use pagedllm::spec::NgramConfig;

const PROMPT: usize = 512;
const MAX_MODEL_LEN: usize = 2048;

fn prefilled(running: usize, block_size: usize, caching: bool, drafts: usize) -> Scheduler {
    let cfg = SchedulerConfig {
        max_num_batched_tokens: 8192.max(running),
        max_num_seqs: running,
        max_model_len: MAX_MODEL_LEN,
        strategy: Strategy::Unified,
        policy: Policy::Fcfs,
        preemption_mode: PreemptionMode::Auto,
        long_prefill_token_threshold: 0,
        num_lookahead_slots: 0,
        delay_factor: 0.0,
        max_loras: 0,
        speculative: (drafts > 0)
            .then(|| NgramConfig::new(drafts, 4, 1).expect("valid n-gram parameters")),
    };
    let cache = CacheConfig {
        block_size,
        num_device_blocks: running * (MAX_MODEL_LEN / block_size + 1),
        num_host_blocks: 0,
        watermark: 0.01,
        enable_prefix_caching: caching,
    };
    let mut s = Scheduler::new(cache, cfg).expect("valid configuration");
    let mut x: u64 = 12345;
    for i in 0..running {
        // Random prompts (an LCG): no two requests share a block. With drafts, a random
        // 32-token passage repeated, so its suffix always recurs.
        let mut random = |n: usize| -> Vec<u32> {
            (0..n)
                .map(|_| {
                    x = x
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    ((x >> 33) % 50_000) as u32
                })
                .collect()
        };
        let prompt = if drafts > 0 {
            random(32).repeat(PROMPT / 32)
        } else {
            random(PROMPT)
        };
        let params = RequestParams {
            prompt,
            n: 1,
            priority: 0,
            arrival_time: 0.0,
            stop: StopParams {
                max_tokens: 1024,
                ignore_eos: true,
                ..Default::default()
            },
            extra_key: 0,
            lora_id: 0,
            structured_output: false,
        };
        s.add_request(&format!("r{i}"), params)
            .expect("valid request");
    }
    loop {
        let out = s.schedule(0.0).expect("schedules");
        let sampled = vec![7i64; out.num_samples()];
        let steady = out.is_decode_only() && out.num_seqs() == running;
        s.update_from_output(out.step, &sampled, None)
            .expect("updates");
        s.recycle(out);
        if steady {
            return s;
        }
    }
}

#[inline(never)]
fn steady(s: &mut Scheduler, steps: usize, sampled: &[i64]) {
    for _ in 0..steps {
        let out = s.schedule(0.0).expect("schedules");
        s.update_from_output(out.step, sampled, None)
            .expect("updates");
        s.recycle(out);
    }
}

/// `schedule` of a step with drafts (the part `test_bench_spec_decode.py` times).
#[inline(never)]
fn spec_schedule(s: &mut Scheduler) -> StepOutput {
    s.schedule(0.0).expect("schedules")
}

/// Steps with drafts: propose, schedule, apply with every draft rejected (one token a sample).
#[inline(never)]
fn spec_steady(s: &mut Scheduler, steps: usize, sampled: &[i64], ones: &[i64]) {
    for _ in 0..steps {
        s.propose_drafts().expect("proposes");
        let out = spec_schedule(s);
        s.update_from_output_runs(out.step, sampled, ones, None)
            .expect("updates");
        s.recycle(out);
    }
}

/// Nanoseconds this thread has run on a CPU (Linux; None elsewhere).
fn on_cpu_ns() -> Option<u64> {
    let stat = std::fs::read_to_string("/proc/thread-self/schedstat").ok()?;
    stat.split_whitespace().next()?.parse().ok()
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let arg = |i: usize, default: usize| args.get(i).map_or(default, |a| a.parse().unwrap());
    let (running, block_size, steps) = (arg(1, 1024), arg(2, 16), arg(4, 200));
    let drafts = arg(5, 0);
    let caching = args.get(3).is_none_or(|a| a != "off");
    let mut s = prefilled(running, block_size, caching, drafts);
    let sampled = vec![7i64; running];
    let ones = vec![1i64; running];
    let run = |s: &mut Scheduler, steps: usize| {
        if drafts > 0 {
            spec_steady(s, steps, &sampled, &ones);
        } else {
            steady(s, steps, &sampled);
        }
    };
    run(&mut s, 10);
    let (t, cpu) = (Instant::now(), on_cpu_ns());
    run(&mut s, steps);
    let us = t.elapsed().as_secs_f64() / steps as f64 * 1e6;
    let cpu_us = match (cpu, on_cpu_ns()) {
        (Some(a), Some(b)) => format!("{:.2}", (b - a) as f64 / steps as f64 / 1e3),
        _ => "-".to_string(),
    };
    let tokens = s.stats().counters.num_batched_tokens_total;
    println!(
        "{running} running, block {block_size}, caching {caching}, drafts {drafts}: {us:.2} \
         us/step wall, {cpu_us} on CPU ({tokens} tokens)"
    );
}
