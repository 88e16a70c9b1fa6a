//! A seeded random workload over every strategy, policy and preemption mode.
use super::*;

/// Tiny deterministic generator for the seeded workload.
struct Lcg(u64);
impl Lcg {
    fn next(&mut self, n: u64) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (self.0 >> 33) % n
    }
}

#[test]
fn random_workloads_terminate_without_leaks() {
    let strategies = [
        Strategy::PrefillFirst,
        Strategy::ChunkedPrefill,
        Strategy::Unified,
    ];
    let policies = [Policy::Fcfs, Policy::Priority];
    let modes = [
        PreemptionMode::Auto,
        PreemptionMode::Recompute,
        PreemptionMode::Swap,
    ];
    for (k, ((&st, &po), &mo)) in strategies
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
