//! Unit tests of the scheduler core (the Python tests cover every SPEC scenario through the
//! bindings; these pin the core mechanics and run a seeded random workload).
use super::store::Slot;
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

fn req(tag: u32, len: usize, n: usize, max_tokens: usize) -> RequestParams {
    RequestParams {
        prompt: prompt(tag, len),
        n,
        priority: 0,
        arrival_time: tag as f64,
        stop: StopParams {
            max_tokens,
            ..Default::default()
        },
        extra_key: 0,
        lora_id: 0,
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

#[test]
fn n_above_max_num_seqs_is_rejected_before_allocation() {
    let mut c = cfg(Strategy::Unified, 64);
    c.max_num_seqs = 4;
    let mut s = Scheduler::new(cache(4, 8, 0), c).unwrap();
    // 2**40 sequences would abort the process if they were allocated first
    for n in [5, 1 << 40] {
        let err = s.add_request("big", req(0, 4, n, 4)).unwrap_err();
        assert!(matches!(err, Error::InvalidArgument(_)), "{err:?}");
        let msg = err.to_string();
        assert!(
            msg.contains("\"big\"") && msg.contains("max_num_seqs=4"),
            "{msg}"
        );
    }
    assert!(!s.has_unfinished_requests() && s.request_status("big").is_none());
    s.add_request("ok", req(1, 4, 4, 2)).unwrap();
    let (out, _) = step(&mut s, 7);
    assert_eq!(out.num_samples(), 4);
}

#[test]
fn prefill_first_batches_prompts_then_decodes() {
    let mut s = Scheduler::new(cache(4, 8, 0), cfg(Strategy::PrefillFirst, 64)).unwrap();
    for t in 0..4 {
        s.add_request(&format!("r{t}"), req(t, 4, 1, 8)).unwrap();
    }
    let (out, _) = step(&mut s, 7);
    assert_eq!(out.num_batched_tokens, 16);
    assert_eq!(out.num_tokens, vec![4; 4]);
    assert_eq!(out.query_start_loc(), vec![0, 4, 8, 12, 16]);
    assert_eq!(out.sample_rows, vec![0, 1, 2, 3]);
    let (out, _) = step(&mut s, 7);
    assert_eq!(out.num_tokens, vec![1; 4]);
    assert!(out.is_decode_only());
    assert!(out.blocks_to_copy.is_empty() && out.blocks_to_swap_in.is_empty());
    // Position 4 opens each sequence's second block; the slot is that block's first slot.
    let (tables, w) = s.block_tables(&out);
    let (slots, positions, ids) = (s.slot_mapping(&out), out.positions(), s.input_ids(&out));
    for row in 0..4 {
        assert_eq!(w, 2);
        assert_eq!(slots[row], tables[row * w + 1] as i64 * 4);
        assert_eq!(positions[row], 4);
        assert_eq!(ids[row], 7);
    }
}

#[test]
fn chunked_prefill_puts_decodes_before_chunks() {
    let mut s = Scheduler::new(cache(4, 64, 0), cfg(Strategy::ChunkedPrefill, 64)).unwrap();
    s.add_request("a", req(0, 60, 1, 8)).unwrap();
    s.add_request("b", req(1, 60, 1, 8)).unwrap();
    let (out, _) = step(&mut s, 5);
    assert_eq!(out.num_tokens, vec![60, 4]);
    let (out, _) = step(&mut s, 5);
    assert_eq!(out.num_tokens, vec![1, 56]);
    assert_eq!(out.start_pos, vec![60, 4]);
}

#[test]
fn unified_caps_long_prefills() {
    let mut c = cfg(Strategy::Unified, 1024);
    c.long_prefill_token_threshold = 400;
    let mut s = Scheduler::new(cache(16, 200, 0), c).unwrap();
    for t in 0..3 {
        s.add_request(&format!("r{t}"), req(t, 800, 1, 8)).unwrap();
    }
    let per_step: Vec<Vec<i32>> = (0..3).map(|_| step(&mut s, 3).0.num_tokens).collect();
    assert_eq!(
        per_step,
        vec![vec![400, 400, 224], vec![400, 400, 224], vec![1, 1, 352]]
    );
}

#[test]
fn tail_is_preempted_before_the_request_preempts_itself() {
    // A: 1 block; B: n=2 group sharing 1 block; C: 1 block; one block left over.
    let mut c = cfg(Strategy::PrefillFirst, 64);
    c.preemption_mode = PreemptionMode::Recompute;
    let mut s = Scheduler::new(cache(4, 4, 0), c).unwrap();
    s.add_request("A", req(0, 4, 1, 8)).unwrap();
    s.add_request("B", req(1, 4, 2, 8)).unwrap();
    s.add_request("C", req(2, 4, 1, 8)).unwrap();
    let (out, _) = step(&mut s, 9);
    assert_eq!(out.num_samples(), 4);
    assert_eq!(out.sample_rows, vec![0, 1, 1, 2]);
    let (out, _) = step(&mut s, 9);
    assert_eq!(out.preempted, vec!["C".to_string(), "B".to_string()]);
    assert_eq!(out.num_seqs(), 1);
    assert_eq!(s.waiting_ids(), vec!["B", "C"]);
}

#[test]
fn n2_group_swaps_out_and_back_with_shared_blocks_once() {
    let mut s = Scheduler::new(cache(4, 3, 4), cfg(Strategy::PrefillFirst, 64)).unwrap();
    s.add_request("X", req(0, 4, 1, 2)).unwrap();
    s.add_request("G", req(1, 6, 2, 8)).unwrap();
    step(&mut s, 1);
    let (out, fin) = step(&mut s, 1);
    assert_eq!(out.preempted, vec!["G".to_string()]);
    assert_eq!(
        out.blocks_to_swap_out.len(),
        4,
        "two distinct blocks, each once"
    );
    assert!(fin
        .iter()
        .any(|f| f.request_id == "X" && f.request_finished));
    s.add_request("Y", req(2, 4, 1, 2)).unwrap();
    let (back, _) = step(&mut s, 1);
    let hosts_out: Vec<i64> = out.blocks_to_swap_out.chunks(2).map(|p| p[1]).collect();
    let hosts_in: Vec<i64> = back.blocks_to_swap_in.chunks(2).map(|p| p[0]).collect();
    assert_eq!(hosts_out, hosts_in);
    assert_eq!(back.num_seqs(), 2);
    assert_eq!(
        back.blocks_to_copy.len(),
        2,
        "first append to the shared tail copies it"
    );
    assert_eq!(s.waiting_ids(), vec!["Y"]);
}

#[test]
fn recomputed_group_refills_prompt_once_then_each_sequence() {
    let mut c = cfg(Strategy::Unified, 64);
    c.preemption_mode = PreemptionMode::Recompute;
    // Without prefix caching, so the recomputed prompt is not served from the cache.
    let mut s = Scheduler::new(
        CacheConfig {
            enable_prefix_caching: false,
            ..cache(4, 16, 0)
        },
        c,
    )
    .unwrap();
    s.add_request("G", req(0, 6, 3, 10)).unwrap();
    step(&mut s, 1);
    step(&mut s, 2);
    // Force a recompute preemption by hand through an overloaded step is covered by the
    // random test; here drive the internal path directly.
    let h = s.handle_of("G").unwrap();
    s.queues.remove_running(h, &s.store);
    let mut scratch = StepOutput::default();
    s.preempt(h, &mut scratch, true).unwrap();
    s.queues.requeue_preempted(&s.store);
    s.check_invariants().unwrap();
    let (out, _) = step(&mut s, 3);
    assert_eq!(
        out.num_tokens,
        vec![6],
        "the leader recomputes the prompt alone"
    );
    assert_eq!(
        out.num_samples(),
        0,
        "every sequence already has its tokens past the prompt"
    );
    let (out, _) = step(&mut s, 3);
    assert_eq!(
        out.num_tokens,
        vec![2, 2, 2],
        "each sequence re-prefills its own tokens"
    );
    assert_eq!(out.start_pos, vec![6, 6, 6]);
    assert_eq!(out.num_samples(), 3);
}

#[test]
fn stop_rules_apply_in_update() {
    let mut s = Scheduler::new(cache(4, 64, 0), cfg(Strategy::Unified, 64)).unwrap();
    let mut p = req(0, 4, 1, 10);
    p.stop.eos_token_id = Some(2);
    p.stop.min_tokens = 2;
    s.add_request("a", p).unwrap();
    let (_, fin) = step(&mut s, 2);
    assert!(fin.is_empty(), "min_tokens holds EOS back");
    let (_, fin) = step(&mut s, 2);
    assert_eq!(fin[0].reason, FinishReason::Stop);
    assert!(fin[0].request_finished);
    assert!(!s.has_unfinished_requests());
}

#[test]
fn update_requires_the_latest_output() {
    let mut s = Scheduler::new(cache(4, 64, 0), cfg(Strategy::Unified, 64)).unwrap();
    s.add_request("a", req(0, 4, 1, 10)).unwrap();
    let out = s.schedule(0.0).unwrap();
    assert!(matches!(s.schedule(0.0), Err(Error::InvalidState(_))));
    assert!(matches!(
        s.update_from_output(out.step, &[], None),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(
        s.update_from_output(out.step, &[-1], None),
        Err(Error::InvalidArgument(_))
    ));
    s.update_from_output(out.step, &[5], None).unwrap();
    assert!(matches!(
        s.update_from_output(out.step, &[5], None),
        Err(Error::InvalidState(_))
    ));
}

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

/// The workload of the lazy-output tests: a tiny pool, n=2 groups (forks, CoW of their
/// tails) and enough requests that `mode` preempts.
fn lockstep_workload(mode: PreemptionMode) -> Scheduler {
    let mut c = cfg(Strategy::Unified, 64);
    c.preemption_mode = mode;
    let mut s = Scheduler::new(cache(4, 24, 24), c).unwrap();
    for t in 0..6 {
        let n = if t % 2 == 0 { 2 } else { 1 };
        s.add_request(&format!("r{t}"), req(t, 6 + t as usize, n, 10 + t as usize))
            .unwrap();
    }
    s
}

/// Block tables are built lazily: an output kept across later steps (CoW of forked tails,
/// preemption by recompute and swap, finishes, released requests) must still report the
/// tables of its own step. Two identical schedulers run in lockstep; one reads each step's
/// tables at once, the other keeps every output and reads them all at the end.
#[test]
fn lazy_block_tables_survive_later_steps() {
    for mode in [PreemptionMode::Recompute, PreemptionMode::Swap] {
        let (mut eager, mut lazy) = (lockstep_workload(mode), lockstep_workload(mode));
        let mut expected = Vec::new();
        let mut kept = Vec::new();
        let mut preemptions = 0;
        while eager.has_unfinished_requests() {
            let (out, _) = step(&mut eager, 7);
            expected.push(eager.block_tables(&out));
            preemptions += out.preempted.len();
            let (out, _) = step(&mut lazy, 7);
            kept.push(out);
        }
        assert!(preemptions > 0, "the workload must preempt ({mode:?})");
        for (k, (out, want)) in kept.iter().zip(&expected).enumerate() {
            assert_eq!(&lazy.block_tables(out), want, "step {k} ({mode:?})");
        }
    }
}

#[test]
fn slot_generation_and_hot_request_fields_share_a_line() {
    use std::mem::{align_of, offset_of, size_of};
    assert_eq!(align_of::<Slot>(), 64);
    assert_eq!(offset_of!(Slot, gen), 0);
    // Option<Request> takes no tag (niche), so the request starts right after the generation.
    assert_eq!(size_of::<Option<Request>>(), size_of::<Request>());
    assert_eq!(offset_of!(Slot, req), 8);
}

/// `input_ids`, `positions` and `slot_mapping` are built lazily too, from per-row data and
/// the sequences' tables and token histories: an output kept across later steps (CoW,
/// preemption by recompute and swap, finishes, released requests) must still report its own
/// step's values. Same lockstep pair as above; the eager side is also checked against the
/// prompts (token at position p of request r{t} is `prompt(t)[p]`, later ones are the
/// sampled 7) and against its block tables.
#[test]
fn lazy_token_arrays_survive_later_steps() {
    for mode in [PreemptionMode::Recompute, PreemptionMode::Swap] {
        let (mut eager, mut lazy) = (lockstep_workload(mode), lockstep_workload(mode));
        let mut expected = Vec::new();
        let mut kept = Vec::new();
        let (mut preemptions, mut copies, mut prefill_rows) = (0, 0, 0);
        while eager.has_unfinished_requests() {
            let out = eager.schedule(0.0).unwrap();
            let ids = eager.input_ids(&out);
            let positions = out.positions();
            let slots = eager.slot_mapping(&out);
            let (tables, w) = eager.block_tables(&out);
            assert_eq!(ids.len(), out.num_batched_tokens);
            let mut t = 0;
            for row in 0..out.num_seqs() {
                let id = eager.resolve_id(out.handles[row], out.gens[row]).unwrap();
                let tag: u32 = id[1..].parse().unwrap();
                let plen = 6 + tag as usize;
                let start = out.start_pos[row] as usize;
                prefill_rows += (out.num_tokens[row] > 1) as usize;
                for p in start..start + out.num_tokens[row] as usize {
                    assert_eq!(positions[t], p as i64);
                    let want = if p < plen {
                        prompt(tag, plen)[p] as i64
                    } else {
                        7
                    };
                    assert_eq!(ids[t], want, "token {t} of row {row}");
                    assert_eq!(
                        slots[t],
                        (tables[row * w + p / 4] as usize * 4 + p % 4) as i64
                    );
                    t += 1;
                }
            }
            preemptions += out.preempted.len();
            copies += out.blocks_to_copy.len();
            let sampled = vec![7; out.num_samples()];
            eager.update_from_output(out.step, &sampled, None).unwrap();
            expected.push((ids, positions, slots));
            let (out, _) = step(&mut lazy, 7);
            kept.push(out);
        }
        assert!(preemptions > 0, "the workload must preempt ({mode:?})");
        assert!(
            copies > 0 && prefill_rows > 0,
            "the workload must CoW and prefill ({mode:?})"
        );
        for (k, (out, want)) in kept.iter().zip(&expected).enumerate() {
            let got = (lazy.input_ids(out), out.positions(), lazy.slot_mapping(out));
            assert_eq!(&got, want, "step {k} ({mode:?})");
        }
    }
}

/// The admission seam (`admission::conditions`): a request a feature condition holds back
/// with `Wait` keeps its place and lets those behind it in, under every strategy, and is
/// admitted once the condition clears; `Later(Condition)` admits nobody behind it.
#[test]
fn admission_conditions_hold_a_request_in_place() {
    use super::admission::{Short, Verdict};
    for st in [
        Strategy::PrefillFirst,
        Strategy::ChunkedPrefill,
        Strategy::Unified,
    ] {
        let mut s = Scheduler::new(cache(4, 64, 0), cfg(st, 64)).unwrap();
        for t in 0..3 {
            s.add_request(&format!("r{t}"), req(t, 4, 1, 4)).unwrap();
        }
        let held = s.handle_of("r0").unwrap();
        s.store.get_mut(held).extras.condition = Some(Verdict::Wait);
        step(&mut s, 7);
        assert_eq!(s.waiting_ids(), vec!["r0"], "{st:?}");
        assert_eq!(s.running_ids(), vec!["r1", "r2"], "{st:?}");
        s.store.get_mut(held).extras.condition = None;
        let (out, _) = step(&mut s, 7);
        assert!(s.waiting_ids().is_empty(), "{st:?}");
        assert_eq!(out.num_tokens.last(), Some(&4), "{st:?}: r0's prompt");

        let mut s = Scheduler::new(cache(4, 64, 0), cfg(st, 64)).unwrap();
        for t in 0..3 {
            s.add_request(&format!("r{t}"), req(t, 4, 1, 4)).unwrap();
        }
        let h = s.handle_of("r1").unwrap();
        s.store.get_mut(h).extras.condition = Some(Verdict::Later(Short::Condition));
        step(&mut s, 7);
        assert_eq!(s.running_ids(), vec!["r0"], "{st:?}");
        assert_eq!(s.waiting_ids(), vec!["r1", "r2"], "{st:?}");
    }
}

/// The `priority` probe reads the same conditions: it preempts nobody for a request a
/// condition holds back, and makes room once the condition clears.
#[test]
fn priority_probe_respects_admission_conditions() {
    use super::admission::Verdict;
    for st in [Strategy::PrefillFirst, Strategy::Unified] {
        let mut c = cfg(st, 64);
        c.policy = Policy::Priority;
        c.max_num_seqs = 1;
        let mut s = Scheduler::new(cache(4, 64, 0), c).unwrap();
        let mut low = req(0, 4, 1, 8);
        low.priority = 5;
        s.add_request("low", low).unwrap();
        step(&mut s, 7);
        s.add_request("high", req(1, 4, 1, 8)).unwrap();
        let h = s.handle_of("high").unwrap();
        s.store.get_mut(h).extras.condition = Some(Verdict::Wait);
        let (out, _) = step(&mut s, 7);
        assert!(out.preempted.is_empty(), "{st:?}");
        assert_eq!(s.running_ids(), vec!["low"], "{st:?}");
        s.store.get_mut(h).extras.condition = None;
        let (out, _) = step(&mut s, 7);
        assert_eq!(out.preempted, vec!["low".to_string()], "{st:?}");
        assert_eq!(s.running_ids(), vec!["high"], "{st:?}");
    }
}
