//! A seeded random workload over every strategy, policy and preemption mode.
use super::*;

/// The strategies in the order the workloads' seeds are derived from.
const STRATEGIES: [Strategy; 3] = [
    Strategy::PrefillFirst,
    Strategy::ChunkedPrefill,
    Strategy::Unified,
];

/// Tiny deterministic generator for the seeded workload.
#[derive(Debug)]
pub(super) struct Lcg(pub(super) u64);
impl Lcg {
    pub(super) fn next(&mut self, n: u64) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (self.0 >> 33) % n
    }
}

#[test]
fn random_workloads_terminate_without_leaks() {
    let policies = [Policy::Fcfs, Policy::Priority];
    let modes = [
        PreemptionMode::Auto,
        PreemptionMode::Recompute,
        PreemptionMode::Swap,
    ];
    for (k, ((&st, &po), &mo)) in STRATEGIES
        .iter()
        .flat_map(|s| policies.iter().map(move |p| (s, p)))
        .flat_map(|sp| modes.iter().map(move |m| (sp, m)))
        .enumerate()
    {
        for seed in 0..4u64 {
            let mut rng = Lcg(k as u64 * 31 + seed + 1);
            let mut c = cfg(st, 32);
            c.policy = po;
            c.preemption_mode = mo;
            c.max_model_len = 40;
            c.max_num_seqs = 6;
            // LoRA off, or at most 1 or 2 of 3 adapters per step.
            c.max_loras = seed as usize % 3;
            let mut s = Scheduler::new(cache(4, 12, 6), c).unwrap();
            let mut added = 0;
            for stepno in 0..400 {
                if added < 30 && rng.next(2) == 0 {
                    let mut p = req(
                        rng.next(3) as u32,
                        2 + rng.next(20) as usize,
                        1 + rng.next(3) as usize,
                        1 + rng.next(12) as usize,
                    );
                    p.priority = rng.next(3) as i64;
                    p.stop.eos_token_id = Some(0);
                    if seed % 3 != 0 {
                        p.lora_id = rng.next(4);
                    }
                    s.add_request(&format!("q{added}"), p).unwrap();
                    added += 1;
                }
                if rng.next(10) == 0 && added > 0 {
                    s.abort_request(&format!("q{}", rng.next(added))).unwrap();
                }
                let out = s.schedule(stepno as f64).unwrap();
                assert!(out.num_batched_tokens <= 32);
                let mut loras: Vec<i64> = out.extras.lora_ids.clone();
                loras.retain(|&l| l != 0);
                loras.sort_unstable();
                loras.dedup();
                assert!(loras.len() <= seed as usize % 3, "{loras:?} in one step");
                let sampled: Vec<i64> =
                    (0..out.num_samples()).map(|_| rng.next(8) as i64).collect();
                s.update_from_output(out.step, &sampled, None).unwrap();
                s.check_invariants()
                    .unwrap_or_else(|e| panic!("{st:?}/{po:?}/{mo:?}: {e}"));
                if added == 30 && !s.has_unfinished_requests() {
                    break;
                }
            }
            assert!(
                !s.has_unfinished_requests(),
                "{st:?}/{po:?}/{mo:?} did not drain"
            );
            let stats = s.manager().stats();
            assert_eq!(stats.num_free_device_blocks, 12);
            assert_eq!(stats.num_free_host_blocks, 6);
        }
    }
}

/// The seeded workload with n-gram drafts every step, runs of random acceptance (the accepted
/// drafts, then a fresh token), occasional discarded steps, and the invariants after every step.
#[test]
fn random_workloads_with_drafts_terminate_without_leaks() {
    use crate::spec::NgramConfig;
    let modes = [PreemptionMode::Recompute, PreemptionMode::Swap];
    for (k, (&st, &mo)) in STRATEGIES
        .iter()
        .flat_map(|s| modes.iter().map(move |m| (s, m)))
        .enumerate()
    {
        for seed in 0..6u64 {
            let mut rng = Lcg(k as u64 * 131 + seed + 7);
            let mut c = cfg(st, 32);
            c.preemption_mode = mo;
            c.max_model_len = 40;
            c.max_num_seqs = 6;
            c.speculative = Some(NgramConfig::new(1 + seed as usize % 4, 3, 1).unwrap());
            // V0 strategies reserve the drafts' slots as lookahead slots half the time.
            if st != Strategy::Unified && seed % 2 == 0 {
                c.num_lookahead_slots = 1 + seed as usize % 4;
            }
            let caching = seed % 3 != 2;
            let mut cache_cfg = cache(4, 14, 8);
            cache_cfg.enable_prefix_caching = caching;
            let mut s = Scheduler::new(cache_cfg, c).unwrap();
            let mut added = 0;
            let mut accepted = 0;
            for stepno in 0..600 {
                if added < 30 && rng.next(2) == 0 {
                    let mut p = req(
                        rng.next(3) as u32,
                        2 + rng.next(20) as usize,
                        1 + rng.next(3) as usize,
                        1 + rng.next(12) as usize,
                    );
                    p.stop.eos_token_id = Some(0);
                    p.stop.min_tokens = (rng.next(3) as usize).min(p.stop.max_tokens);
                    s.add_request(&format!("q{added}"), p).unwrap();
                    added += 1;
                }
                if rng.next(15) == 0 && added > 0 {
                    s.abort_request(&format!("q{}", rng.next(added))).unwrap();
                }
                let out = s.schedule(stepno as f64).unwrap();
                assert!(out.num_batched_tokens <= 32);
                if rng.next(20) == 0 {
                    s.discard_step(&out).unwrap();
                    s.check_invariants().unwrap();
                    s.propose_drafts().unwrap();
                    continue;
                }
                let row_drafts = &out.extras.spec_num_draft_tokens;
                let (mut sampled, mut runs) = (Vec::new(), Vec::new());
                let mut offsets = vec![0usize; row_drafts.len()];
                let mut at = 0;
                for (r, &d) in row_drafts.iter().enumerate() {
                    offsets[r] = at;
                    at += d as usize;
                }
                for &row in &out.sample_rows {
                    let d = row_drafts.get(row as usize).copied().unwrap_or(0) as usize;
                    let a = rng.next(d as u64 + 1) as usize;
                    if d > 0 {
                        let o = offsets[row as usize];
                        sampled.extend_from_slice(&out.extras.spec_draft_token_ids[o..o + a]);
                    }
                    accepted += a;
                    sampled.push(rng.next(6) as i64);
                    runs.push(a as i64 + 1);
                }
                s.update_from_output_runs(out.step, &sampled, &runs, None)
                    .unwrap();
                s.check_invariants()
                    .unwrap_or_else(|e| panic!("{st:?}/{mo:?}/{seed}: {e}"));
                s.propose_drafts().unwrap();
                if added == 30 && !s.has_unfinished_requests() {
                    break;
                }
            }
            assert!(accepted > 0, "{st:?}/{mo:?}/{seed}: no draft accepted");
            assert!(!s.has_unfinished_requests(), "{st:?}/{mo:?} did not drain");
            let stats = s.manager().stats();
            assert_eq!(stats.num_free_device_blocks, 14);
            assert_eq!(stats.num_free_host_blocks, 8);
        }
    }
}
