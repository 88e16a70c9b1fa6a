//! A KV connector attached: requests wait for remote KV without blocking others, loads that
//! fail are computed again, held blocks come back, and a seeded random workload with a fake
//! connector (random matches, delays, failures, reordered reports) over every strategy,
//! policy and preemption mode, LoRA salts and drafts keeps the invariants and leaks nothing.
use super::random::Lcg;
use super::*;
use crate::connector::{
    ConnectorMeta, ConnectorOutput, ConnectorRequest, KvConnector, OffloadConnector,
};
use crate::kv::prefix_cache::PrefixCache;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};

/// Offers a random run of blocks past every device hit and saves finished requests' blocks
/// half of the time; the harness plays the workers.
#[derive(Debug)]
struct FakeConnector {
    rng: Lcg,
    block_size: usize,
    pending: ConnectorMeta,
}

impl KvConnector for FakeConnector {
    fn get_num_new_matched_tokens(
        &mut self,
        req: &ConnectorRequest<'_>,
        num_computed: usize,
    ) -> (usize, bool) {
        let bs = self.block_size;
        let eligible = PrefixCache::eligible_blocks(req.tokens.len(), bs);
        let start = num_computed / bs;
        if start >= eligible {
            return (0, true);
        }
        let k = self.rng.next((eligible - start + 1) as u64) as usize;
        (k * bs, self.rng.next(2) == 0)
    }

    fn update_state_after_alloc(&mut self, req: &ConnectorRequest<'_>, blocks: &[u32], n: usize) {
        let k = n / self.block_size;
        for (i, &b) in blocks.iter().enumerate().skip(blocks.len() - k) {
            self.pending
                .push_load(req.job, b, i as u32, req.block_hashes[i]);
        }
    }

    fn build_connector_meta(&mut self, meta: &mut ConnectorMeta) {
        self.pending.drain_into(meta);
    }

    fn request_finished(&mut self, req: &ConnectorRequest<'_>, blocks: &[u32]) -> bool {
        if blocks.is_empty() || self.rng.next(2) == 0 {
            return false;
        }
        for (i, &b) in blocks.iter().enumerate() {
            self.pending
                .push_save(req.job, b, i as u32, req.block_hashes[i]);
        }
        true
    }

    fn update_connector_output(&mut self, _out: &ConnectorOutput<'_>) {}
}

/// The workers of the tests: transfers in flight, reported after a delay.
#[derive(Default)]
struct Workers {
    /// (due step, job, is a load, its device blocks)
    in_flight: Vec<(u64, u64, bool, Vec<u32>)>,
}

impl Workers {
    fn take(&mut self, meta: &ConnectorMeta, now: u64, mut delay: impl FnMut() -> u64) {
        let mut add = |jobs: &[u64], blocks: &[i64], load: bool| {
            for (&j, &b) in jobs.iter().zip(blocks) {
                match self.in_flight.iter_mut().find(|t| t.1 == j) {
                    Some(t) => t.3.push(b as u32),
                    None => self
                        .in_flight
                        .push((now + delay(), j, load, vec![b as u32])),
                }
            }
        };
        add(&meta.load_jobs, &meta.load_blocks, true);
        add(&meta.save_jobs, &meta.save_blocks, false);
    }

    /// Reports the step's synchronous loads at once (the workers copy them in before the
    /// forward), with the load blocks `fail` picks marked invalid; true when one failed (the
    /// step is then discarded). Call after `take`.
    fn sync_loads(
        &mut self,
        s: &mut Scheduler,
        meta: &ConnectorMeta,
        mut fail: impl FnMut(u32) -> bool,
    ) -> bool {
        if meta.sync_jobs.is_empty() {
            return false;
        }
        let mut invalid = Vec::new();
        self.in_flight.retain(|t| {
            if !meta.sync_jobs.contains(&t.1) {
                return true;
            }
            invalid.extend(t.3.iter().copied().filter(|&b| fail(b)));
            false
        });
        s.update_connector_output(&meta.sync_jobs, &[], &invalid)
            .unwrap();
        !invalid.is_empty()
    }

    /// Reports what is due (all when `now` is None), in the order `shuffle` gives, with the
    /// load blocks `fail` picks marked invalid.
    fn report(
        &mut self,
        s: &mut Scheduler,
        now: Option<u64>,
        mut shuffle: impl FnMut(usize) -> usize,
        mut fail: impl FnMut(u32) -> bool,
    ) {
        let mut due = Vec::new();
        self.in_flight.retain(|t| {
            let ready = now.is_none_or(|n| t.0 <= n);
            if ready {
                due.push(t.clone());
            }
            !ready
        });
        for i in (1..due.len()).rev() {
            due.swap(i, shuffle(i + 1));
        }
        let (mut recv, mut send, mut invalid) = (Vec::new(), Vec::new(), Vec::new());
        for (_, job, load, blocks) in due {
            if load {
                recv.push(job);
                invalid.extend(blocks.into_iter().filter(|&b| fail(b)));
            } else {
                send.push(job);
            }
        }
        s.update_connector_output(&recv, &send, &invalid).unwrap();
    }
}

/// The host tier with asynchronous loads (requests park while they load).
fn with_offload(bs: usize, device: usize, slots: usize, budget: usize) -> Scheduler {
    let mut s = Scheduler::new(cache(bs, device, 0), cfg(Strategy::Unified, budget)).unwrap();
    s.set_kv_connector(Box::new(
        OffloadConnector::new(bs, slots).with_async_loads(),
    ))
    .unwrap();
    s
}

/// The host tier as the engine attaches it: synchronous loads.
fn with_sync_offload(bs: usize, device: usize, slots: usize, budget: usize) -> Scheduler {
    let mut s = Scheduler::new(cache(bs, device, 0), cfg(Strategy::Unified, budget)).unwrap();
    s.set_kv_connector(Box::new(OffloadConnector::new(bs, slots)))
        .unwrap();
    s
}

/// Runs steps (sampling `token`, the workers reporting everything right after each step)
/// until nothing is left.
fn drain(s: &mut Scheduler, w: &mut Workers) {
    for _ in 0..100 {
        let out = s.schedule(0.0).unwrap();
        w.take(out.kv_meta(), 0, || 0);
        w.sync_loads(s, out.kv_meta(), |_| false);
        let sampled = vec![7; out.num_samples()];
        s.update_from_output(out.step, &sampled, None).unwrap();
        w.report(s, None, |_| 0, |_| false);
        s.check_invariants().unwrap();
        if !s.has_unfinished_requests() && !s.has_pending_transfers() {
            return;
        }
    }
    panic!("did not drain: {:?} {:?}", s.waiting_ids(), s.running_ids());
}

#[test]
fn a_finished_requests_blocks_are_held_until_saved_then_loaded_by_a_later_request() {
    let mut s = with_offload(4, 8, 16, 64);
    let mut w = Workers::default();
    s.add_request("a", params(prompt(0, 13), 1)).unwrap();
    let out = s.schedule(0.0).unwrap();
    s.update_from_output(out.step, &[7], None).unwrap();
    // Finished, but its 3 full blocks stay allocated while the tier saves them.
    assert!(s.has_pending_transfers());
    assert_eq!(s.manager().num_free_device_blocks(), 8 - 4);
    s.check_invariants().unwrap();
    let out = s.schedule(0.0).unwrap();
    assert_eq!(out.kv_meta().save_blocks.len(), 3);
    w.take(out.kv_meta(), 0, || 0);
    w.report(&mut s, None, |_| 0, |_| false);
    assert!(!s.has_pending_transfers());
    assert_eq!(s.manager().num_free_device_blocks(), 8);
    // The device cache forgets the prefix; the tier still has it.
    s.mgr.reset_prefix_cache();
    s.add_request("b", params(prompt(0, 13), 1)).unwrap();
    let out = s.schedule(0.0).unwrap();
    assert_eq!(out.num_seqs(), 0);
    assert_eq!(out.kv_meta().load_blocks.len(), 3);
    assert_eq!(
        s.request_status("b"),
        Some(RequestStatus::WaitingForRemoteKvs)
    );
    s.check_invariants().unwrap();
    s.update_from_output(out.step, &[], None).unwrap();
    w.take(out.kv_meta(), 0, || 0);
    w.report(&mut s, None, |_| 0, |_| false);
    assert_eq!(s.request_status("b"), Some(RequestStatus::Waiting));
    let out = s.schedule(0.0).unwrap();
    // Only the last token is computed: the 12 before it were loaded.
    assert_eq!(out.num_tokens, vec![1]);
    assert_eq!(s.request("b").unwrap().num_cached_tokens, 12);
    assert_eq!(s.request("b").unwrap().extras.num_external_tokens, 12);
    s.update_from_output(out.step, &[7], None).unwrap();
    drain(&mut s, &mut w);
    assert_eq!(s.manager().num_free_device_blocks(), 8);
}

#[test]
fn a_request_preempted_by_recompute_has_its_blocks_saved_and_loaded_later() {
    let mut s = with_offload(4, 8, 16, 64);
    let mut w = Workers::default();
    s.add_request("a", params(prompt(0, 13), 6)).unwrap();
    s.add_request("b", params(prompt(1, 13), 6)).unwrap();
    let mut saved = None;
    for _ in 0..10 {
        let out = s.schedule(0.0).unwrap();
        w.take(out.kv_meta(), 0, || 0);
        let preempted = out.preempted.contains(&"b".to_string());
        if preempted {
            saved = Some(out.kv_meta().save_blocks.len());
            // Its blocks stay allocated (held by a fork) until the save is reported.
            assert!(s.has_pending_transfers());
        }
        let sampled = vec![7; out.num_samples()];
        s.update_from_output(out.step, &sampled, None).unwrap();
        s.check_invariants().unwrap();
        if preempted {
            break;
        }
        w.report(&mut s, None, |_| 0, |_| false);
    }
    // 13 prompt tokens and 3 generated: 4 full blocks.
    assert_eq!(saved, Some(4));
    // "b" never comes back: only its preemption saved its prefix.
    s.abort_request("b").unwrap();
    w.report(&mut s, None, |_| 0, |_| false);
    drain(&mut s, &mut w);
    assert_eq!(s.manager().num_free_device_blocks(), 8);
    s.mgr.reset_prefix_cache();
    s.add_request("c", params(prompt(1, 13), 1)).unwrap();
    let out = s.schedule(0.0).unwrap();
    assert_eq!(out.kv_meta().load_blocks.len(), 3);
    assert_eq!(
        s.request_status("c"),
        Some(RequestStatus::WaitingForRemoteKvs)
    );
    s.update_from_output(out.step, &[], None).unwrap();
    w.take(out.kv_meta(), 0, || 0);
    drain(&mut s, &mut w);
    assert_eq!(s.manager().num_free_device_blocks(), 8);
}

/// Puts `prompt(0, 13)`'s 3 full blocks into the tier and clears the device cache.
fn seeded_tier(s: &mut Scheduler, w: &mut Workers) {
    s.add_request("seed", params(prompt(0, 13), 1)).unwrap();
    drain(s, w);
    s.mgr.reset_prefix_cache();
}

#[test]
fn a_request_waiting_for_remote_kv_does_not_block_those_behind_it() {
    let mut s = with_offload(4, 16, 16, 64);
    let mut w = Workers::default();
    seeded_tier(&mut s, &mut w);
    s.add_request("loads", params(prompt(0, 13), 1)).unwrap();
    s.add_request("other", params(prompt(5, 6), 3)).unwrap();
    let out = s.schedule(0.0).unwrap();
    // "other" runs this step while "loads" waits for its load (not reported yet).
    assert_eq!(out.num_seqs(), 1);
    assert_eq!(
        s.request_status("loads"),
        Some(RequestStatus::WaitingForRemoteKvs)
    );
    assert_eq!(s.waiting_ids(), vec!["loads"]);
    w.take(out.kv_meta(), 3, || 0);
    s.update_from_output(out.step, &[7], None).unwrap();
    for now in 0..3 {
        let out = s.schedule(0.0).unwrap();
        w.take(out.kv_meta(), now, || 0);
        s.update_from_output(out.step, &vec![7; out.num_samples()], None)
            .unwrap();
        w.report(&mut s, Some(now), |_| 0, |_| false);
        s.check_invariants().unwrap();
    }
    assert_eq!(
        s.request_status("loads"),
        Some(RequestStatus::WaitingForRemoteKvs)
    );
    w.report(&mut s, Some(3), |_| 0, |_| false);
    assert_eq!(s.request_status("loads"), Some(RequestStatus::Waiting));
    drain(&mut s, &mut w);
}

#[test]
fn a_failed_load_recomputes_from_the_first_failed_block() {
    let mut s = with_offload(4, 16, 16, 64);
    let mut w = Workers::default();
    seeded_tier(&mut s, &mut w);
    s.add_request("b", params(prompt(0, 13), 1)).unwrap();
    let out = s.schedule(0.0).unwrap();
    let failed = out.kv_meta().load_blocks[1] as u32;
    w.take(out.kv_meta(), 0, || 0);
    s.update_from_output(out.step, &[], None).unwrap();
    w.report(&mut s, None, |_| 0, |b| b == failed);
    let out = s.schedule(0.0).unwrap();
    // Block 0 loaded; blocks 1 (failed) and 2 (after it) are computed with the last token.
    assert_eq!(out.num_tokens, vec![9]);
    assert_eq!(s.request("b").unwrap().extras.num_external_tokens, 4);
    let stats = s.kv_connector().unwrap().offload_stats().unwrap();
    assert_eq!((stats.loaded_blocks, stats.failed_blocks), (2, 1));
    s.update_from_output(out.step, &[7], None).unwrap();
    drain(&mut s, &mut w);
    assert_eq!(s.manager().num_free_device_blocks(), 16);
}

#[test]
fn an_aborted_loading_request_keeps_its_blocks_until_the_load_is_reported() {
    let mut s = with_offload(4, 16, 16, 64);
    let mut w = Workers::default();
    seeded_tier(&mut s, &mut w);
    s.add_request("b", params(prompt(0, 13), 1)).unwrap();
    let out = s.schedule(0.0).unwrap();
    w.take(out.kv_meta(), 0, || 0);
    s.update_from_output(out.step, &[], None).unwrap();
    assert!(s.abort_request("b").unwrap());
    assert!(!s.has_unfinished_requests());
    assert_eq!(s.manager().num_free_device_blocks(), 16 - 3);
    s.check_invariants().unwrap();
    w.report(&mut s, None, |_| 0, |_| false);
    assert!(!s.has_pending_transfers());
    assert_eq!(s.manager().num_free_device_blocks(), 16);
    s.check_invariants().unwrap();
}

#[test]
fn a_lone_running_request_short_of_blocks_held_by_a_load_waits_instead_of_being_ignored() {
    let mut s = with_offload(4, 5, 16, 64);
    let mut w = Workers::default();
    s.add_request("seed", params(prompt(0, 13), 1)).unwrap();
    drain(&mut s, &mut w);
    s.mgr.reset_prefix_cache();
    s.add_request("loads", params(prompt(0, 13), 1)).unwrap();
    s.add_request("grows", params(prompt(1, 4), 8)).unwrap();
    let out = s.schedule(0.0).unwrap();
    w.take(out.kv_meta(), 0, || 0);
    s.update_from_output(out.step, &[7], None).unwrap();
    // "loads" holds 3 blocks, "grows" 1: one left, and "grows" needs a third at token 9.
    for _ in 0..6 {
        let out = s.schedule(0.0).unwrap();
        assert!(out.finished.is_empty(), "{:?}", out.finished);
        s.update_from_output(out.step, &vec![7; out.num_samples()], None)
            .unwrap();
        s.check_invariants().unwrap();
    }
    assert_eq!(s.request("grows").unwrap().seqs[0].tokens.len(), 4 + 5);
    w.report(&mut s, None, |_| 0, |_| false);
    drain(&mut s, &mut w);
    assert_eq!(s.manager().num_free_device_blocks(), 5);
}

#[test]
fn a_request_whose_loaded_blocks_are_evicted_before_admission_loads_again_counted_once() {
    let mut s = with_offload(4, 16, 16, 64);
    let mut w = Workers::default();
    seeded_tier(&mut s, &mut w);
    s.add_request("b", params(prompt(0, 13), 1)).unwrap();
    for _ in 0..2 {
        let out = s.schedule(0.0).unwrap();
        assert_eq!(out.kv_meta().load_blocks.len(), 3);
        w.take(out.kv_meta(), 0, || 0);
        s.update_from_output(out.step, &[], None).unwrap();
        w.report(&mut s, None, |_| 0, |_| false);
        // Promoted, but the device cache lets the loaded blocks go before it is admitted.
        s.mgr.reset_prefix_cache();
    }
    s.mgr.reset_prefix_cache();
    let out = s.schedule(0.0).unwrap();
    w.take(out.kv_meta(), 0, || 0);
    s.update_from_output(out.step, &[], None).unwrap();
    w.report(&mut s, None, |_| 0, |_| false);
    let out = s.schedule(0.0).unwrap();
    assert_eq!(out.num_tokens, vec![1]);
    let r = s.request("b").unwrap();
    assert_eq!(
        (r.num_cached_tokens, r.extras.num_external_tokens),
        (12, 12)
    );
    s.update_from_output(out.step, &[7], None).unwrap();
    drain(&mut s, &mut w);
}

#[test]
fn a_synchronous_load_admits_the_request_in_the_step_that_loads_it() {
    let mut s = with_sync_offload(4, 16, 16, 64);
    let mut w = Workers::default();
    seeded_tier(&mut s, &mut w);
    s.add_request("b", params(prompt(0, 13), 2)).unwrap();
    let out = s.schedule(0.0).unwrap();
    // Its 12 loaded tokens count as computed: only the last one runs, in this very step.
    assert_eq!(out.num_tokens, vec![1]);
    assert_eq!(out.kv_meta().load_blocks.len(), 3);
    assert_eq!(out.kv_meta().sync_jobs.len(), 1);
    assert_eq!(s.running_ids(), vec!["b"]);
    assert_eq!(s.num_waiting_for_remote_kvs(), 0);
    s.check_invariants().unwrap();
    w.take(out.kv_meta(), 0, || 0);
    assert!(!w.sync_loads(&mut s, out.kv_meta(), |_| false));
    s.update_from_output(out.step, &[7], None).unwrap();
    let r = s.request("b").unwrap();
    assert_eq!(
        (r.num_cached_tokens, r.extras.num_external_tokens),
        (12, 12)
    );
    drain(&mut s, &mut w);
    assert_eq!(s.manager().num_free_device_blocks(), 16);
}

#[test]
fn a_step_with_an_unreported_synchronous_load_is_neither_applied_nor_discarded() {
    let mut s = with_sync_offload(4, 16, 16, 64);
    let mut w = Workers::default();
    seeded_tier(&mut s, &mut w);
    s.add_request("b", params(prompt(0, 13), 2)).unwrap();
    let out = s.schedule(0.0).unwrap();
    let err = s.update_from_output(out.step, &[7], None).unwrap_err();
    assert!(err.to_string().contains("not reported"), "{err}");
    assert!(s.discard_step(&out).is_err());
    assert!(s.schedule(0.0).is_err());
    w.take(out.kv_meta(), 0, || 0);
    w.sync_loads(&mut s, out.kv_meta(), |_| false);
    s.update_from_output(out.step, &[7], None).unwrap();
    drain(&mut s, &mut w);
    assert_eq!(s.manager().num_free_device_blocks(), 16);
}

#[test]
fn a_failed_synchronous_load_discards_the_step_and_recomputes_from_the_failed_block() {
    let mut s = with_sync_offload(4, 16, 16, 64);
    let mut w = Workers::default();
    seeded_tier(&mut s, &mut w);
    s.add_request("b", params(prompt(0, 13), 2)).unwrap();
    let out = s.schedule(0.0).unwrap();
    let failed = out.kv_meta().load_blocks[1] as u32;
    w.take(out.kv_meta(), 0, || 0);
    assert!(w.sync_loads(&mut s, out.kv_meta(), |b| b == failed));
    // The step read a block that never loaded: it is discarded, not applied.
    let err = s.update_from_output(out.step, &[7], None).unwrap_err();
    assert!(err.to_string().contains("discard_step"), "{err}");
    assert!(s.schedule(0.0).is_err());
    assert_eq!(s.discard_step(&out).unwrap(), vec!["b"]);
    let out = s.schedule(0.0).unwrap();
    // Block 0 loads again; blocks 1 (failed, forgotten by the tier) and 2 are computed.
    assert_eq!(out.num_tokens, vec![9]);
    assert_eq!(out.kv_meta().load_blocks.len(), 1);
    w.take(out.kv_meta(), 0, || 0);
    assert!(!w.sync_loads(&mut s, out.kv_meta(), |_| false));
    s.update_from_output(out.step, &[7], None).unwrap();
    let stats = s.kv_connector().unwrap().offload_stats().unwrap();
    assert_eq!((stats.loaded_blocks, stats.failed_blocks), (3, 1));
    // Counted as served from the tier: the one block that loaded in the step that ran.
    let r = s.request("b").unwrap();
    assert_eq!((r.num_cached_tokens, r.extras.num_external_tokens), (4, 4));
    drain(&mut s, &mut w);
    assert_eq!(s.manager().num_free_device_blocks(), 16);
}

#[test]
fn a_request_aborted_before_its_synchronous_load_is_reported_keeps_its_blocks_until_then() {
    let mut s = with_sync_offload(4, 16, 16, 64);
    let mut w = Workers::default();
    seeded_tier(&mut s, &mut w);
    s.add_request("b", params(prompt(0, 13), 2)).unwrap();
    let out = s.schedule(0.0).unwrap();
    assert!(s.abort_request("b").unwrap());
    // 3 loaded blocks and the one of its last token: the workers may be writing them.
    assert_eq!(s.manager().num_free_device_blocks(), 16 - 4);
    s.check_invariants().unwrap();
    w.take(out.kv_meta(), 0, || 0);
    w.sync_loads(&mut s, out.kv_meta(), |_| false);
    s.update_from_output(out.step, &[7], None).unwrap();
    assert!(!s.has_pending_transfers() && !s.has_unfinished_requests());
    assert_eq!(s.manager().num_free_device_blocks(), 16);
    s.check_invariants().unwrap();
}

/// The multi-turn benchmark's shape in small (`benches/multi_turn_offload.py`): `convs`
/// conversations, each turn the whole history plus a new user message, one turn of every
/// conversation submitted at once, a device cache holding about a quarter of the final
/// histories and the host tier on. Returns the steps taken; panics past `max_steps`.
fn multi_turn(s: &mut Scheduler, convs: u32, turns: usize, max_steps: usize) -> usize {
    let mut w = Workers::default();
    let mut histories: Vec<Vec<TokenId>> = (0..convs).map(|c| prompt(c, 8)).collect();
    let (reply, user) = (4, 4);
    let mut steps = 0;
    for turn in 0..turns {
        for (c, h) in histories.iter_mut().enumerate() {
            if turn > 0 {
                h.extend(prompt(100 + c as u32 * 10 + turn as u32, user));
            }
            s.add_request(&format!("c{c}t{turn}"), params(h.clone(), reply))
                .unwrap();
        }
        while s.has_unfinished_requests() || s.has_pending_transfers() {
            steps += 1;
            assert!(
                steps <= max_steps,
                "turn {turn}: no end after {max_steps} steps: waiting {:?} ({} loading), \
                 running {:?}, {} free blocks",
                s.waiting_ids(),
                s.num_waiting_for_remote_kvs(),
                s.running_ids(),
                s.manager().num_free_device_blocks()
            );
            let out = s.schedule(steps as f64).unwrap();
            w.take(out.kv_meta(), 0, || 0);
            w.sync_loads(s, out.kv_meta(), |_| false);
            // every reply token is 7 (the histories stay distinct by their user messages)
            s.update_from_output(out.step, &vec![7; out.num_samples()], None)
                .unwrap();
            w.report(s, None, |_| 0, |_| false);
            s.check_invariants().unwrap();
        }
        for h in histories.iter_mut() {
            h.extend([7; 4]);
        }
    }
    steps
}

#[test]
fn a_multi_turn_workload_over_a_small_device_cache_runs_to_completion_with_the_tier() {
    // 12 conversations of up to 8 + 3 x 4 + 4 x 4 = 36 tokens (9 blocks): 108 blocks in
    // all against 28 on the device, 4 running at a time.
    // Both ways of loading: parked while loading (async), admitted with the load (sync).
    for async_loads in [true, false] {
        let mut c = cfg(Strategy::Unified, 256);
        c.max_num_seqs = 4;
        let mut s = Scheduler::new(cache(4, 28, 0), c).unwrap();
        let tier = OffloadConnector::new(4, 256);
        let tier = if async_loads {
            tier.with_async_loads()
        } else {
            tier
        };
        s.set_kv_connector(Box::new(tier)).unwrap();
        // 4 turns x 12 requests of 4 tokens each, 4 at a time: about 50 decode steps and
        // a few for prefills and loads; 600 is far past what a run that makes progress needs.
        let steps = multi_turn(&mut s, 12, 4, 600);
        let stats = s.kv_connector().unwrap().offload_stats().unwrap();
        assert!(
            stats.loaded_blocks > 0,
            "the tier was never used: {stats:?}"
        );
        assert_eq!(
            s.manager().num_free_device_blocks(),
            28,
            "after {steps} steps (async loads: {async_loads})"
        );
    }
}

#[test]
fn loading_and_loaded_requests_hold_their_seats_until_admitted() {
    let mut c = cfg(Strategy::Unified, 64);
    c.max_num_seqs = 2;
    let mut s = Scheduler::new(cache(4, 32, 0), c).unwrap();
    s.set_kv_connector(Box::new(OffloadConnector::new(4, 64).with_async_loads()))
        .unwrap();
    let mut w = Workers::default();
    for i in 0..3 {
        s.add_request(&format!("seed{i}"), params(prompt(i, 13), 1))
            .unwrap();
    }
    drain(&mut s, &mut w);
    s.mgr.reset_prefix_cache();
    for i in 0..3 {
        s.add_request(&format!("r{i}"), params(prompt(i, 13), 2))
            .unwrap();
    }
    let out = s.schedule(0.0).unwrap();
    // Two seats: two requests load, the third waits for a seat (it would load too early).
    assert_eq!(s.num_waiting_for_remote_kvs(), 2);
    assert_eq!(s.request_status("r2"), Some(RequestStatus::Waiting));
    w.take(out.kv_meta(), 0, || 0);
    s.update_from_output(out.step, &[], None).unwrap();
    w.report(&mut s, None, |_| 0, |_| false);
    s.check_invariants().unwrap();
    // Promoted: they still hold both seats, so "r2" is not parked before they run.
    let out = s.schedule(0.0).unwrap();
    assert_eq!(s.running_ids(), vec!["r0", "r1"]);
    assert_eq!(s.num_waiting_for_remote_kvs(), 0);
    assert!(out.kv_meta().load_jobs.is_empty());
    s.update_from_output(out.step, &[7, 7], None).unwrap();
    drain(&mut s, &mut w);
    assert_eq!(s.manager().num_free_device_blocks(), 32);
}

#[test]
fn a_more_urgent_request_short_only_of_seats_held_by_loads_lets_the_loaded_ones_run() {
    let mut c = cfg(Strategy::Unified, 64);
    c.max_num_seqs = 2;
    c.policy = Policy::Priority;
    let mut s = Scheduler::new(cache(4, 32, 0), c).unwrap();
    s.set_kv_connector(Box::new(OffloadConnector::new(4, 64).with_async_loads()))
        .unwrap();
    let mut w = Workers::default();
    for i in 0..2 {
        s.add_request(&format!("seed{i}"), params(prompt(i, 13), 1))
            .unwrap();
    }
    drain(&mut s, &mut w);
    s.mgr.reset_prefix_cache();
    for i in 0..2 {
        s.add_request(&format!("r{i}"), params(prompt(i, 13), 2))
            .unwrap();
    }
    let out = s.schedule(0.0).unwrap();
    assert_eq!(s.num_waiting_for_remote_kvs(), 2);
    w.take(out.kv_meta(), 0, || 0);
    s.update_from_output(out.step, &[], None).unwrap();
    // Ranked before both (priority -1 < 0, nothing to load): first in `waiting`, while the
    // two seats are theirs.
    let mut urgent = params(prompt(7, 6), 2);
    urgent.priority = -1;
    s.add_request("urgent", urgent).unwrap();
    w.report(&mut s, None, |_| 0, |_| false);
    assert_eq!(s.waiting_ids()[0], "urgent");
    // It steps aside for them (else it would wait first in line for seats only they free).
    let out = s.schedule(0.0).unwrap();
    assert_eq!(s.running_ids(), vec!["r0", "r1"]);
    s.update_from_output(out.step, &[7, 7], None).unwrap();
    drain(&mut s, &mut w);
    assert_eq!(s.manager().num_free_device_blocks(), 32);
}

#[test]
fn loads_that_fill_the_device_cache_do_not_stop_the_first_of_them_from_running() {
    // 12 blocks; three 17-token prompts whose first 4 blocks the tier holds: their loads
    // take all 12, and the first needs a 13th for its last token.
    let mut c = cfg(Strategy::Unified, 64);
    c.max_num_seqs = 3;
    let mut s = Scheduler::new(cache(4, 12, 0), c).unwrap();
    s.set_kv_connector(Box::new(OffloadConnector::new(4, 64).with_async_loads()))
        .unwrap();
    let mut w = Workers::default();
    for i in 0..3 {
        s.add_request(&format!("seed{i}"), params(prompt(i, 17), 1))
            .unwrap();
        drain(&mut s, &mut w);
    }
    s.mgr.reset_prefix_cache();
    for i in 0..3 {
        s.add_request(&format!("r{i}"), params(prompt(i, 17), 2))
            .unwrap();
    }
    let out = s.schedule(0.0).unwrap();
    assert_eq!(s.num_waiting_for_remote_kvs(), 3);
    assert_eq!(s.manager().num_free_device_blocks(), 0);
    w.take(out.kv_meta(), 0, || 0);
    s.update_from_output(out.step, &[], None).unwrap();
    w.report(&mut s, None, |_| 0, |_| false);
    drain(&mut s, &mut w);
    assert_eq!(s.manager().num_free_device_blocks(), 12);
}

#[test]
fn unknown_or_repeated_transfer_ids_are_refused() {
    let mut s = with_offload(4, 16, 16, 64);
    let err = s.update_connector_output(&[5], &[], &[]).unwrap_err();
    assert!(err.to_string().contains("transfer 5"), "{err}");
    assert!(s.update_connector_output(&[], &[6], &[]).is_err());
}

#[test]
fn a_connector_needs_prefix_caching() {
    let mut c = cache(4, 16, 0);
    c.enable_prefix_caching = false;
    let mut s = Scheduler::new(c, cfg(Strategy::Unified, 64)).unwrap();
    let err = s
        .set_kv_connector(Box::new(OffloadConnector::new(4, 4)))
        .unwrap_err();
    assert!(err.to_string().contains("enable_prefix_caching"), "{err}");
}

#[test]
fn random_workloads_with_a_fake_connector_keep_invariants_and_leak_nothing() {
    let strategies = [
        Strategy::PrefillFirst,
        Strategy::ChunkedPrefill,
        Strategy::Unified,
    ];
    let modes = [
        PreemptionMode::Recompute,
        PreemptionMode::Swap,
        PreemptionMode::Auto,
    ];
    let policies = [Policy::Fcfs, Policy::Priority];
    let mut k = 0u64;
    for &st in &strategies {
        for &mo in &modes {
            for &po in &policies {
                for seed in 0..30u64 {
                    k += 1;
                    run_random(
                        st,
                        mo,
                        po,
                        seed,
                        k,
                        seed % 3 == 1 && mo != PreemptionMode::Auto,
                    );
                }
            }
        }
    }
    let (sync, failed) = (SYNC.load(Relaxed), SYNC_FAILURES.load(Relaxed));
    assert!(
        sync > 100 && failed > 10,
        "{sync} synchronous loads, {failed} failed"
    );
}

/// Synchronous loads, and steps discarded for a failed one, over every random workload.
static SYNC: AtomicUsize = AtomicUsize::new(0);
static SYNC_FAILURES: AtomicUsize = AtomicUsize::new(0);

fn run_random(st: Strategy, mo: PreemptionMode, po: Policy, seed: u64, k: u64, drafts: bool) {
    let mut rng = Lcg(k * 977 + seed + 3);
    let mut c = cfg(st, 32);
    c.policy = po;
    c.preemption_mode = mo;
    c.max_model_len = 40;
    c.max_num_seqs = 6;
    c.max_loras = seed as usize % 3;
    if drafts {
        c.speculative = Some(crate::spec::NgramConfig::new(2, 3, 1).unwrap());
    }
    let mut s = Scheduler::new(cache(4, 14, 6), c).unwrap();
    s.set_kv_connector(Box::new(FakeConnector {
        rng: Lcg(k + 11),
        block_size: 4,
        pending: ConnectorMeta::default(),
    }))
    .unwrap();
    let mut w = Workers::default();
    let mut delays = Lcg(k + 5);
    let mut added = 0;
    let (mut loads, mut saves) = (0, 0);
    let (mut sync_loads, mut sync_failures) = (0, 0);
    let ctx = format!("{st:?}/{mo:?}/{po:?}/{seed}");
    for stepno in 0..800u64 {
        if added < 30 && rng.next(2) == 0 {
            // Few distinct prompts: the connector's matches land on shared prefixes too.
            let mut p = req(
                rng.next(3) as u32,
                2 + rng.next(20) as usize,
                1 + (rng.next(4) / 3) as usize,
                1 + rng.next(12) as usize,
            );
            p.priority = rng.next(3) as i64;
            p.stop.eos_token_id = Some(0);
            if !seed.is_multiple_of(3) {
                p.lora_id = rng.next(3);
            }
            s.add_request(&format!("q{added}"), p).unwrap();
            added += 1;
        }
        if rng.next(10) == 0 && added > 0 {
            s.abort_request(&format!("q{}", rng.next(added))).unwrap();
        }
        let out = s.schedule(stepno as f64).unwrap();
        loads += out.kv_meta().load_jobs.len();
        saves += out.kv_meta().save_jobs.len();
        sync_loads += out.kv_meta().sync_jobs.len();
        w.take(out.kv_meta(), stepno, || delays.next(4));
        let mut r3 = Lcg(stepno * 7 + k);
        if w.sync_loads(&mut s, out.kv_meta(), |_| r3.next(4) == 0) {
            // A synchronous load failed: the step cannot be applied.
            assert!(s
                .update_from_output(out.step, &vec![0; out.num_samples()], None)
                .is_err());
            s.discard_step(&out).unwrap();
            sync_failures += 1;
        } else if drafts && rng.next(20) == 0 {
            s.discard_step(&out).unwrap();
        } else if drafts {
            let runs = vec![1i64; out.num_samples()];
            let sampled: Vec<i64> = (0..out.num_samples()).map(|_| rng.next(8) as i64).collect();
            s.update_from_output_runs(out.step, &sampled, &runs, None)
                .unwrap();
        } else {
            let sampled: Vec<i64> = (0..out.num_samples()).map(|_| rng.next(8) as i64).collect();
            s.update_from_output(out.step, &sampled, None).unwrap();
        }
        let (mut r1, mut r2) = (Lcg(stepno + k), Lcg(stepno * 3 + k));
        w.report(
            &mut s,
            Some(stepno),
            |n| r1.next(n as u64) as usize,
            |_| r2.next(4) == 0,
        );
        s.check_invariants()
            .unwrap_or_else(|e| panic!("{ctx}: step {stepno}: {e}"));
        if drafts {
            s.propose_drafts().unwrap();
        }
        if added == 30 && !s.has_unfinished_requests() && !s.has_pending_transfers() {
            break;
        }
    }
    assert!(!s.has_unfinished_requests(), "{ctx} did not drain");
    assert!(!s.has_pending_transfers(), "{ctx}: transfers left");
    assert!(
        loads > 0 && saves > 0,
        "{ctx}: {loads} loads, {saves} saves"
    );
    SYNC.fetch_add(sync_loads, Relaxed);
    SYNC_FAILURES.fetch_add(sync_failures, Relaxed);
    let stats = s.manager().stats();
    assert_eq!(stats.num_free_device_blocks, 14, "{ctx}");
    assert_eq!(stats.num_free_host_blocks, 6, "{ctx}");
}
