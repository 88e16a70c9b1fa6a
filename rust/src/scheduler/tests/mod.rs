//! Unit tests of the scheduler core (the Python tests cover every scenario through the
//! bindings; these pin the core mechanics and run a seeded random workload), one file per
//! behaviour; the shared fixtures live here.
mod admission;
mod beams;
mod connector;
mod grammar;
mod hybrid;
mod intake;
mod layout;
mod lazy_outputs;
mod preemption;
mod random;
mod spec;
mod strategies;
mod update;

use super::state::store::Slot;
use super::*;
use crate::error::Error;
use crate::ids::TokenId;

fn cfg(strategy: Strategy, budget: usize) -> SchedulerConfig {
    SchedulerConfig {
        max_num_batched_tokens: budget,
        max_num_seqs: 256,
        max_model_len: 2048,
        strategy,
        policy: Policy::Fcfs,
        preemption_mode: PreemptionMode::Auto,
        long_prefill_token_threshold: 0,
        num_lookahead_slots: 0,
        delay_factor: 0.0,
        max_loras: 0,
        speculative: None,
    }
}

fn cache(bs: usize, device: usize, host: usize) -> CacheConfig {
    CacheConfig {
        block_size: bs,
        num_device_blocks: device,
        num_host_blocks: host,
        watermark: 0.0,
        enable_prefix_caching: true,
    }
}

/// A prompt of `len` tokens unique to `tag` (no accidental prefix hits).
fn prompt(tag: u32, len: usize) -> Vec<TokenId> {
    (0..len as u32).map(|i| 1000 * (tag + 1) + i).collect()
}

/// A single-sequence request for `prompt` with `max_tokens`, nothing else set.
fn params(prompt: Vec<TokenId>, max_tokens: usize) -> RequestParams {
    RequestParams {
        prompt,
        n: 1,
        priority: 0,
        arrival_time: 0.0,
        stop: StopParams {
            max_tokens,
            ..Default::default()
        },
        extra_key: 0,
        lora_id: 0,
        structured_output: false,
    }
}

fn req(tag: u32, len: usize, n: usize, max_tokens: usize) -> RequestParams {
    RequestParams {
        n,
        arrival_time: tag as f64,
        ..params(prompt(tag, len), max_tokens)
    }
}

/// One schedule + update with every sample = `token`; checks the invariants.
fn step(s: &mut Scheduler, token: i64) -> (StepOutput, Vec<FinishedSeq>) {
    let out = s.schedule(0.0).unwrap();
    let sampled = vec![token; out.num_samples()];
    let fin = s.update_from_output(out.step, &sampled, None).unwrap();
    s.check_invariants().unwrap();
    (out, fin)
}
