//! Speculative decoding in the scheduler: drafts proposed, scheduled within the limits, runs
//! applied under the stop rules, rejected blocks given back.
use super::{cache, cfg, params, step};
use crate::scheduler::{Scheduler, Strategy};
use crate::spec::NgramConfig;

/// Unified, 16 seats, model length 32, block 4, 64 blocks, `budget` tokens a step.
fn sched_with(speculative: Option<NgramConfig>, budget: usize, caching: bool) -> Scheduler {
    let mut c = cfg(Strategy::Unified, budget);
    c.max_num_seqs = 16;
    c.max_model_len = 32;
    c.speculative = speculative;
    let mut k = cache(4, 64, 0);
    k.enable_prefix_caching = caching;
    Scheduler::new(k, c).unwrap()
}

fn sched(speculative: Option<NgramConfig>) -> Scheduler {
    sched_with(speculative, 64, false)
}

fn add(s: &mut Scheduler, id: &str, prompt: Vec<u32>, max_tokens: usize) {
    s.add_request(id, params(prompt, max_tokens)).unwrap();
}

#[test]
fn proposes_for_decoding_sequences_only() {
    let mut s = sched(Some(NgramConfig::new(3, 2, 1).unwrap()));
    add(&mut s, "a", vec![1, 2, 3, 4, 5, 1], 16);
    add(&mut s, "b", vec![7, 8, 9], 16);
    // nothing computed yet: nothing decodes next step
    assert_eq!(s.propose_drafts().unwrap().seq_ids.len(), 0);
    step(&mut s, 2);
    let p = s.propose_drafts().unwrap();
    // "a" is 1 2 3 4 5 1 2: [1, 2] recurs, followed by 3 4 5; "b" (7 8 9 2) has no repeat
    assert_eq!(p.seq_ids, vec![0]);
    assert_eq!(p.num_draft_tokens, vec![3]);
    assert_eq!(p.draft_token_ids, vec![3, 4, 5]);
}

#[test]
fn drafts_are_trimmed_to_max_tokens_and_model_length() {
    let mut s = sched(Some(NgramConfig::new(4, 2, 1).unwrap()));
    // after one step: 2 generated of max 4 ... a step yields drafts + 1, so 1 draft
    add(&mut s, "a", vec![1, 2, 3, 4, 5, 6, 1], 3);
    step(&mut s, 2);
    assert_eq!(s.propose_drafts().unwrap().draft_token_ids, vec![3]);
    let mut s = sched(Some(NgramConfig::new(4, 2, 1).unwrap()));
    // 28 tokens + 1 sampled = 29 of max_model_len 32: a run of 2 drafts and a token ends
    // at 32
    let mut prompt: Vec<u32> = (10..34).collect();
    prompt.extend([1, 2, 3, 4, 1]);
    prompt.drain(..1);
    add(&mut s, "b", prompt, 100);
    step(&mut s, 2);
    assert_eq!(s.propose_drafts().unwrap().draft_token_ids, vec![3, 4]);
}

#[test]
fn set_drafts_keeps_decoding_sequences_trimmed_to_their_room() {
    let mut s = sched(Some(NgramConfig::new(3, 2, 1).unwrap()));
    add(&mut s, "a", vec![1, 2, 3], 16);
    add(&mut s, "b", vec![7, 8, 9], 3);
    step(&mut s, 2);
    // seq 0 ("a") takes 3 of its 4, seq 1 ("b", 1 of max 3 generated) room for 1; seq 9 unknown
    let p = s
        .set_drafts(&[0, 1, 9], &[4, 2, 1], &[10, 11, 12, 13, 20, 21, 30])
        .unwrap();
    assert_eq!(p.seq_ids, vec![0, 1]);
    assert_eq!(p.num_draft_tokens, vec![3, 1]);
    assert_eq!(p.draft_token_ids, vec![10, 11, 12, 20]);
    let out = s.schedule(0.0).unwrap();
    assert_eq!(out.num_batched_tokens, 2 + 3 + 1);
}

#[test]
fn set_drafts_rejects_inconsistent_arrays() {
    let mut s = sched(Some(NgramConfig::new(3, 2, 1).unwrap()));
    assert!(s.set_drafts(&[0], &[2], &[1]).is_err());
    assert!(s.set_drafts(&[0, 1], &[1], &[1]).is_err());
    assert!(s.set_drafts(&[0], &[1], &[-1]).is_err());
    assert!(sched(None).set_drafts(&[], &[], &[]).is_err());
}

/// A request decoding `1 2 3 4 5 1 | 2` with drafts `3 4 5` proposed.
fn drafted(caching: bool) -> Scheduler {
    let mut s = sched_with(Some(NgramConfig::new(3, 2, 1).unwrap()), 64, caching);
    add(&mut s, "a", vec![1, 2, 3, 4, 5, 1], 16);
    step(&mut s, 2);
    assert_eq!(s.propose_drafts().unwrap().draft_token_ids, vec![3, 4, 5]);
    s
}

#[test]
fn drafts_are_scheduled_after_the_next_token() {
    let mut s = drafted(false);
    let out = s.schedule(0.0).unwrap();
    assert_eq!(out.num_tokens, vec![4]);
    assert_eq!(out.start_pos, vec![6]);
    assert_eq!(out.extras.spec_num_draft_tokens, vec![3]);
    assert_eq!(out.extras.spec_draft_token_ids, vec![3, 4, 5]);
    assert_eq!(s.input_ids(&out), vec![2, 3, 4, 5]);
    // slots for positions 6..10: three blocks of 4
    assert_eq!(s.slot_mapping(&out).len(), 4);
    assert_eq!(s.request("a").unwrap().seqs[0].table.len(), 3);
    // drafts are not computed until verified
    assert_eq!(s.request("a").unwrap().seqs[0].num_computed, 7);
    s.check_invariants().unwrap();
}

#[test]
fn a_run_moves_computed_over_accepted_drafts_and_frees_rejected_blocks() {
    let mut s = drafted(true);
    let free = s.manager().num_free_device_blocks();
    let out = s.schedule(0.0).unwrap();
    assert_eq!(s.manager().num_free_device_blocks(), free - 1);
    // drafts 3 accepted, 4 rejected -> the target's 9
    let fin = s
        .update_from_output_runs(out.step, &[3, 9], &[2], None)
        .unwrap();
    assert!(fin.is_empty());
    let seq = &s.request("a").unwrap().seqs[0];
    assert_eq!(seq.tokens, vec![1, 2, 3, 4, 5, 1, 2, 3, 9]);
    assert_eq!(seq.num_computed, 8);
    // positions 8 and 9 held only rejected drafts: their block went back
    assert_eq!(seq.table.len(), 2);
    assert_eq!(s.manager().num_free_device_blocks(), free);
    // the block of positions 4..8 is full of accepted tokens: registered
    assert!(s.manager().block_hash(seq.table[1]).is_some());
    s.check_invariants().unwrap();
    // the next step decodes the target's token alone
    let out = s.schedule(0.0).unwrap();
    assert_eq!(
        (out.num_tokens.clone(), out.start_pos.clone()),
        (vec![1], vec![8])
    );
    assert!(out.extras.spec_num_draft_tokens.is_empty());
}

/// Request "a" with stop id `stop`, decoding, its drafts [3, 4, 5] proposed.
fn drafted_with_stop_id(s: &mut Scheduler, stop: u32) {
    let mut p = params(vec![1, 2, 3, 4, 5, 1], 16);
    p.stop.stop_token_ids = vec![stop];
    s.add_request("a", p).unwrap();
    step(s, 2);
    s.propose_drafts().unwrap();
}

#[test]
fn a_stop_inside_a_run_drops_the_tokens_after_it() {
    let mut s = sched(Some(NgramConfig::new(3, 2, 1).unwrap()));
    drafted_with_stop_id(&mut s, 4);
    let out = s.schedule(0.0).unwrap();
    let fin = s
        .update_from_output_runs(out.step, &[3, 4, 5, 7], &[4], None)
        .unwrap();
    assert_eq!(fin.len(), 1);
    assert_eq!(fin[0].stop_reason, Some(4));
    assert!(!s.has_unfinished_requests());
    assert_eq!(s.manager().num_free_device_blocks(), 64);
    s.check_invariants().unwrap();
}

#[test]
fn stop_cuts_end_each_run_where_the_update_does() {
    let mut s = sched(Some(NgramConfig::new(3, 2, 1).unwrap()));
    drafted_with_stop_id(&mut s, 4);
    let out = s.schedule(0.0).unwrap();
    // the stop id 4 is the run's second token: two kept, ended by that token, and nothing
    // changed by asking
    let cuts = s.stop_cuts(out.step, &[3, 4, 5, 7], Some(&[4])).unwrap();
    assert_eq!((cuts.kept, cuts.by_token), (vec![2], vec![true]));
    let cuts = s.stop_cuts(out.step, &[3, 5], Some(&[2])).unwrap();
    assert_eq!((cuts.kept, cuts.by_token), (vec![2], vec![false]));
    assert!(s.stop_cuts(out.step, &[3, 4], Some(&[3])).is_err());
    assert!(s
        .stop_cuts(out.step + 1, &[3, 4, 5, 7], Some(&[4]))
        .is_err());
    let fin = s
        .update_from_output_runs(out.step, &[3, 4, 5, 7], &[4], None)
        .unwrap();
    assert_eq!((fin.len(), fin[0].stop_reason), (1, Some(4)));
    // applied: the step's runs can no longer be asked about
    assert!(s.stop_cuts(out.step, &[3, 4, 5, 7], Some(&[4])).is_err());
}

#[test]
fn runs_longer_than_the_drafts_are_refused() {
    let mut s = drafted(false);
    let out = s.schedule(0.0).unwrap();
    assert!(s
        .update_from_output_runs(out.step, &[3, 4, 5, 6, 7], &[5], None)
        .is_err());
    assert!(s
        .update_from_output_runs(out.step, &[3], &[2], None)
        .is_err());
    assert!(s
        .update_from_output_runs(out.step, &[3, 4], &[2], None)
        .is_ok());
}

#[test]
fn the_budget_trims_the_drafts() {
    let mut s = sched_with(Some(NgramConfig::new(3, 2, 1).unwrap()), 3, false);
    add(&mut s, "a", vec![1, 2, 3, 4, 5, 1], 16);
    // the prompt takes two steps of 3 tokens
    step(&mut s, 2);
    step(&mut s, 2);
    s.propose_drafts().unwrap();
    let out = s.schedule(0.0).unwrap();
    assert_eq!(out.num_tokens, vec![3]);
    assert_eq!(out.extras.spec_draft_token_ids, vec![3, 4]);
    s.check_invariants().unwrap();
}

#[test]
fn constrained_requests_get_drafts_for_the_engine_to_check() {
    let mut s = sched(Some(NgramConfig::new(3, 2, 1).unwrap()));
    let mut p = params(vec![1, 2, 3, 4, 5, 1], 16);
    p.structured_output = true;
    s.add_request("a", p).unwrap();
    assert!(s.grammar_ready("a").unwrap());
    step(&mut s, 2);
    // the engine cuts them to what the grammar accepts (set_drafts) before the step
    let drafts = s.propose_drafts().unwrap();
    assert_eq!(drafts.seq_ids.len(), 1);
    assert!(drafts.num_draft_tokens[0] > 0);
    let kept = s
        .set_drafts(&drafts.seq_ids, &[1], &drafts.draft_token_ids[..1])
        .unwrap();
    assert_eq!(kept.num_draft_tokens, vec![1]);
}

#[test]
fn off_without_a_configuration() {
    let mut s = sched(None);
    assert!(s.propose_drafts().is_err());
}
