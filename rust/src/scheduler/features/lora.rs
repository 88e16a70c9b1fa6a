//! Multi-LoRA scheduling: a step holds at most `max_loras` distinct adapters (vLLM's
//! `max_loras`; adapter 0, the base model, is not counted).
//!
//! The tally of a step starts with the adapters of every request in `running` (they keep their
//! device slots until they leave it), then grows with each admission and swap-in
//! ([`Scheduler::admit_from`]). A candidate whose adapter is not held and would be one too many
//! waits ([`LoraTally::admits`] in `schedule::admission::conditions`): it keeps its place and
//! does not hold back those behind it (vLLM V1's `scheduled_loras`).
//!
//! Why this cannot deadlock or overflow: only admission adds a request to `running`, and it
//! admits against a tally that already holds every running adapter, so the adapters in
//! `running` never exceed `max_loras` (checked by `check_invariants`) and running requests
//! never wait on the limit. A waiting adapter waits only while running requests hold other
//! adapters; those progress, finish or are preempted, and with nothing of another adapter
//! running the first candidate always fits.
use crate::scheduler::output::StepOutput;
use crate::scheduler::schedule::budget::Budget;
use crate::scheduler::Scheduler;

/// The adapters a step holds, at most `max` (0 = LoRA off: only adapter 0 exists).
#[derive(Debug, Clone, Default)]
pub(in crate::scheduler) struct LoraTally {
    max: usize,
    /// Distinct non-zero adapter ids (a handful: a linear scan beats hashing).
    held: Vec<u64>,
}

impl LoraTally {
    /// Whether a request of adapter `lora` fits this step.
    #[inline]
    pub(in crate::scheduler) fn admits(&self, lora: u64) -> bool {
        lora == 0 || self.held.len() < self.max || self.held.contains(&lora)
    }

    /// Counts adapter `lora` as held by this step.
    #[inline]
    pub(in crate::scheduler) fn hold(&mut self, lora: u64) {
        if lora != 0 && !self.held.contains(&lora) {
            self.held.push(lora);
        }
    }
}

impl Scheduler {
    /// Seeds the step's adapter tally from `running`. Free while LoRA is off, and skipped
    /// when nothing waits to be admitted (the tally is read by admission only).
    pub(in crate::scheduler) fn seed_lora_tally(&self, budget: &mut Budget) {
        let max = self.cfg.max_loras;
        if max == 0 || (self.queues.waiting.is_empty() && self.queues.swapped.is_empty()) {
            return;
        }
        budget.loras.max = max;
        for &h in &self.queues.running {
            budget.loras.hold(self.store.get(h).extras.lora_id);
        }
    }

    /// Fills `out.extras.lora_ids`, the adapter of each row, once the step is decided (so
    /// the decode fast path records nothing for it). Nothing while LoRA is off.
    pub(in crate::scheduler) fn record_lora_ids(&self, out: &mut StepOutput) {
        if self.cfg.max_loras == 0 {
            return;
        }
        let ids = &mut out.extras.lora_ids;
        ids.clear();
        // Every row's request is live: a request leaves the store during a step only when
        // it is finished as ignored, before any row of it is recorded.
        ids.extend(
            out.handles
                .iter()
                .map(|&h| self.store.get(h).extras.lora_id as i64),
        );
    }

    /// Distinct adapters among the running requests (for `check_invariants`).
    pub(in crate::scheduler) fn running_loras(&self) -> usize {
        let mut tally = LoraTally::default();
        for &h in &self.queues.running {
            tally.hold(self.store.get(h).extras.lora_id);
        }
        tally.held.len()
    }
}

#[cfg(test)]
mod tests {
    use super::LoraTally;
    use crate::error::Error;
    use crate::ids::TokenId;
    use crate::kv::CacheConfig;
    use crate::scheduler::{
        Policy, PreemptionMode, RequestParams, Scheduler, SchedulerConfig, StepOutput, StopParams,
        Strategy,
    };

    fn sched(strategy: Strategy, max_loras: usize, device_blocks: usize) -> Scheduler {
        let cfg = SchedulerConfig {
            max_num_batched_tokens: 64,
            max_num_seqs: 16,
            max_model_len: 256,
            strategy,
            policy: Policy::Fcfs,
            preemption_mode: PreemptionMode::Auto,
            long_prefill_token_threshold: 0,
            num_lookahead_slots: 0,
            delay_factor: 0.0,
            max_loras,
            speculative: None,
        };
        let cache = CacheConfig {
            block_size: 4,
            num_device_blocks: device_blocks,
            num_host_blocks: 16,
            watermark: 0.0,
            enable_prefix_caching: true,
        };
        Scheduler::new(cache, cfg).unwrap()
    }

    fn req(prompt: Vec<TokenId>, n: usize, max_tokens: usize, lora_id: u64) -> RequestParams {
        RequestParams {
            prompt,
            n,
            priority: 0,
            arrival_time: 0.0,
            stop: StopParams {
                max_tokens,
                ..Default::default()
            },
            extra_key: 0,
            lora_id,
            structured_output: false,
        }
    }

    fn step(s: &mut Scheduler) -> StepOutput {
        let out = s.schedule(0.0).unwrap();
        s.update_from_output(out.step, &vec![1; out.num_samples()], None)
            .unwrap();
        s.check_invariants().unwrap();
        out
    }

    fn distinct_loras(out: &StepOutput) -> Vec<i64> {
        let mut v: Vec<i64> = out.extras.lora_ids.clone();
        v.retain(|&l| l != 0);
        v.sort_unstable();
        v.dedup();
        v
    }

    #[test]
    fn an_adapter_over_the_limit_waits_in_place_without_blocking_others() {
        for strategy in Strategy::ALL {
            let mut s = sched(strategy, 1, 64);
            s.add_request("a1", req(vec![1; 6], 1, 3, 1)).unwrap();
            s.add_request("b1", req(vec![2; 6], 1, 3, 2)).unwrap();
            s.add_request("base", req(vec![3; 6], 1, 3, 0)).unwrap();
            s.add_request("a2", req(vec![4; 6], 1, 3, 1)).unwrap();
            let out = step(&mut s);
            assert_eq!(out.extras.lora_ids, vec![1, 0, 1], "{strategy:?}");
            assert_eq!(s.waiting_ids(), vec!["b1"], "{strategy:?}");
            let mut steps = 1;
            while s.has_unfinished_requests() {
                let out = step(&mut s);
                assert!(distinct_loras(&out).len() <= 1, "{strategy:?}: {out:?}");
                assert_eq!(out.extras.lora_ids.len(), out.num_seqs());
                steps += 1;
                assert!(steps < 50, "{strategy:?} did not drain");
            }
        }
    }

    #[test]
    fn preemption_and_swap_keep_the_adapter() {
        for mode in [PreemptionMode::Recompute, PreemptionMode::Swap] {
            let mut s = sched(Strategy::Unified, 2, 6);
            // n=2 groups so the swap mode has something to swap; 6 blocks of 4 run out.
            s.add_request("a", req(vec![5; 7], 2, 12, 7)).unwrap();
            s.add_request("b", req(vec![6; 7], 2, 12, 9)).unwrap();
            let mut preempted = false;
            while s.has_unfinished_requests() {
                let out = step(&mut s);
                preempted |= !out.preempted.is_empty();
                for (i, &h) in out.handles.iter().enumerate() {
                    let id = s.resolve_id(h, out.gens[i]).unwrap_or("");
                    let want = if id == "a" { 7 } else { 9 };
                    assert_eq!(out.extras.lora_ids[i], want, "{mode:?} row of {id}");
                }
            }
            assert!(preempted, "{mode:?}: the workload must preempt");
        }
    }

    #[test]
    fn the_same_prompt_under_another_adapter_is_no_prefix_hit() {
        let mut s = sched(Strategy::Unified, 2, 64);
        let prompt: Vec<TokenId> = (10..30).collect();
        s.add_request("first", req(prompt.clone(), 1, 2, 3))
            .unwrap();
        while s.has_unfinished_requests() {
            step(&mut s);
        }
        for (id, lora) in [("base", 0), ("other", 4), ("same", 3)] {
            s.add_request(id, req(prompt.clone(), 1, 2, lora)).unwrap();
            step(&mut s);
            let cached = s.request(id).unwrap().num_cached_tokens;
            let want = if lora == 3 { 16 } else { 0 };
            assert_eq!(cached, want, "{id}");
            while s.has_unfinished_requests() {
                step(&mut s);
            }
        }
    }

    #[test]
    fn an_adapter_without_lora_enabled_is_refused_up_front() {
        let mut s = sched(Strategy::Unified, 0, 64);
        let err = s.add_request("x", req(vec![1; 4], 1, 2, 5)).unwrap_err();
        assert!(matches!(err, Error::InvalidArgument(_)), "{err:?}");
        assert!(err.to_string().contains("max_loras=0"), "{err}");
        assert!(!s.has_unfinished_requests());
        let out = s.schedule(0.0).unwrap();
        assert!(out.extras.lora_ids.is_empty(), "LoRA off records nothing");
    }

    #[test]
    fn tally_admits_held_adapters_and_the_base_model_when_full() {
        let mut t = LoraTally {
            max: 2,
            held: Vec::new(),
        };
        assert!(t.admits(7));
        t.hold(7);
        t.hold(7);
        t.hold(0);
        assert!(t.admits(9));
        t.hold(9);
        assert_eq!(t.held, vec![7, 9]);
        assert!(!t.admits(11), "a third adapter is one too many");
        assert!(t.admits(7) && t.admits(9) && t.admits(0));
    }

    #[test]
    fn lora_off_admits_only_the_base_model() {
        let t = LoraTally::default();
        assert!(t.admits(0));
        assert!(!t.admits(1));
    }
}
