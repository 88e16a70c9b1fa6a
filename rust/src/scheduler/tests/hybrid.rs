//! Hybrid KV groups (full + sliding-window layers) under the scheduler: the seeded workload
//! with shared prefixes, n > 1 and every preemption mode drains without leaks, and a long
//! decode keeps a window's blocks bounded.
use super::random::Lcg;
use super::*;
use crate::kv::NULL_BLOCK;

const STRATEGIES: [Strategy; 3] = [
    Strategy::PrefillFirst,
    Strategy::ChunkedPrefill,
    Strategy::Unified,
];

#[test]
fn random_hybrid_workloads_terminate_without_leaks() {
    let modes = [PreemptionMode::Recompute, PreemptionMode::Swap];
    let layouts = [
        vec![None, Some(6)],
        vec![Some(5)],
        vec![Some(9), None, Some(4)],
    ];
    for (k, (&st, &mo)) in STRATEGIES
        .iter()
        .flat_map(|s| modes.iter().map(move |m| (s, m)))
        .enumerate()
    {
        for (seed, layout) in layouts.iter().enumerate() {
            let mut rng = Lcg(k as u64 * 17 + seed as u64 + 3);
            let mut c = cfg(st, 32);
            c.preemption_mode = mo;
            c.max_model_len = 40;
            c.max_num_seqs = 6;
            let blocks = 12 * layout.len();
            let mut s = Scheduler::new(cache(4, blocks, 6 * layout.len()), c).unwrap();
            s.set_kv_groups(layout.clone()).unwrap();
            let mut added = 0;
            for stepno in 0..400 {
                if added < 30 && rng.next(2) == 0 {
                    // Three prompt families: later requests hit earlier ones' blocks.
                    let mut p = req(
                        rng.next(3) as u32,
                        2 + rng.next(20) as usize,
                        1 + rng.next(3) as usize,
                        1 + rng.next(12) as usize,
                    );
                    p.stop.eos_token_id = Some(0);
                    s.add_request(&format!("q{added}"), p).unwrap();
                    added += 1;
                }
                let out = s.schedule(stepno as f64).unwrap();
                check_group_arrays(&s, &out);
                let sampled: Vec<i64> =
                    (0..out.num_samples()).map(|_| rng.next(8) as i64).collect();
                s.update_from_output(out.step, &sampled, None).unwrap();
                s.check_invariants()
                    .unwrap_or_else(|e| panic!("{st:?}/{mo:?}/{layout:?}: {e}"));
                s.manager()
                    .check_invariants()
                    .unwrap_or_else(|e| panic!("{st:?}/{mo:?}/{layout:?}: {e}"));
                if added == 30 && !s.has_unfinished_requests() {
                    break;
                }
            }
            assert!(!s.has_unfinished_requests(), "{st:?}/{mo:?}/{layout:?}");
            let stats = s.manager().stats();
            assert_eq!(stats.num_free_device_blocks, blocks);
        }
    }
}

#[test]
fn a_long_decode_holds_only_the_window_blocks_of_a_sliding_group() {
    let mut c = cfg(Strategy::ChunkedPrefill, 64);
    c.max_model_len = 200;
    let mut s = Scheduler::new(cache(4, 200, 0), c).unwrap();
    s.set_kv_groups(vec![None, Some(8)]).unwrap();
    s.add_request("r", params(prompt(0, 10), 150)).unwrap();
    for _ in 0..150 {
        step(&mut s, 5);
        let Some(h) = s.handle_of("r") else { break };
        let seq = s.store.get(h).seqs[0].id;
        let row = s.manager().group_block_table(seq, 1).unwrap();
        let held = row.iter().filter(|&&b| b != NULL_BLOCK).count();
        // Window 8 over blocks of 4: at most the 3 blocks keys 8 back can span, plus the
        // block opened for the next token.
        assert!(held <= 4, "{held} blocks held: {row:?}");
    }
    assert!(!s.has_unfinished_requests());
}

#[test]
fn kv_groups_are_set_before_requests() {
    let mut s = Scheduler::new(cache(4, 16, 0), cfg(Strategy::Unified, 32)).unwrap();
    s.add_request("r", params(prompt(0, 4), 2)).unwrap();
    assert!(matches!(
        s.set_kv_groups(vec![Some(8)]),
        Err(Error::InvalidState(_))
    ));
}

/// The step's group tables and slots are each group's live rows: a row's table is the group's
/// row (-1 where released), and every token's slot lies in a block its group holds.
fn check_group_arrays(s: &Scheduler, out: &StepOutput) {
    let (tables, width) = s.group_tables(out).unwrap();
    let slots = s.group_slots(out).unwrap();
    let (groups, rows, bs) = (s.manager().num_groups(), out.num_seqs(), s.block_size());
    assert_eq!(tables.len(), groups * rows * width);
    assert_eq!(slots.len(), groups * out.num_batched_tokens);
    let mut token = 0;
    for g in 0..groups {
        for (i, &seq) in out.seq_ids.iter().enumerate() {
            let row = s.manager().group_block_table(seq as u64, g).unwrap();
            let got = &tables[(g * rows + i) * width..][..row.len()];
            let want: Vec<i32> = row
                .iter()
                .map(|&b| if b == NULL_BLOCK { -1 } else { b as i32 })
                .collect();
            assert_eq!(got, want.as_slice());
            for _ in 0..out.num_tokens[i] {
                let block = (slots[token] as usize / bs) as u32;
                assert!(row.contains(&block) && block != NULL_BLOCK);
                token += 1;
            }
        }
    }
}

#[test]
fn group_tables_are_read_only_while_their_step_is_open() {
    let mut s = Scheduler::new(cache(4, 32, 0), cfg(Strategy::Unified, 32)).unwrap();
    s.set_kv_groups(vec![None, Some(4)]).unwrap();
    s.add_request("r", params(prompt(0, 10), 4)).unwrap();
    let out = s.schedule(0.0).unwrap();
    let (tables, width) = s.group_tables(&out).unwrap();
    assert_eq!((tables.len(), width), (2 * 3, 3));
    s.update_from_output(out.step, &[5], None).unwrap();
    assert!(matches!(s.group_tables(&out), Err(Error::InvalidState(_))));
    assert!(matches!(s.group_slots(&out), Err(Error::InvalidState(_))));
}

#[test]
fn group_tables_are_refused_without_hybrid_groups() {
    let mut s = Scheduler::new(cache(4, 32, 0), cfg(Strategy::Unified, 32)).unwrap();
    s.add_request("r", params(prompt(0, 10), 4)).unwrap();
    let out = s.schedule(0.0).unwrap();
    assert!(matches!(s.group_tables(&out), Err(Error::InvalidState(_))));
}

#[test]
fn a_chunked_prompt_longer_than_every_group_at_full_length_is_admitted() {
    // 6 groups (5 of window 8) x 50 blocks would be 300 blocks; chunks of 16 bound each
    // window group to its window and two chunks: 50 + 5 x 11 blocks
    let mut c = cfg(Strategy::ChunkedPrefill, 16);
    c.max_model_len = 256;
    let mut s = Scheduler::new(cache(4, 110, 0), c).unwrap();
    let mut groups = vec![Some(8); 5];
    groups.insert(0, None);
    s.set_kv_groups(groups).unwrap();
    s.add_request("r", params(prompt(0, 200), 4)).unwrap();
    let mut steps = 0;
    while s.has_unfinished_requests() {
        let out = s.schedule(steps as f64).unwrap();
        assert!(out.finished.is_empty(), "refused: {:?}", out.finished);
        let sampled = vec![5; out.num_samples()];
        s.update_from_output(out.step, &sampled, None).unwrap();
        s.check_invariants().unwrap();
        steps += 1;
        assert!(steps < 100);
    }
}
