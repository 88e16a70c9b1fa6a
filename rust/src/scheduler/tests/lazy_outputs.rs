//! Lazy outputs: tables and token arrays of an output kept across later steps.
use super::*;

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
