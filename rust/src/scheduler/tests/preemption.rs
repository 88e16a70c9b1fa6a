//! Preemption: who goes first, and how swapped and recomputed groups come back.
use super::*;

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
