//! Per-strategy batching and the up-front checks of `add_request`.
use super::*;

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
            msg.contains("request 'big'") && msg.contains("max_num_seqs=4"),
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
fn fast_path_rows_keep_running_order_across_chunks_and_general_rows() {
    // 300 single-sequence decodes (the fast path opens rows in chunks of 8, 16, ... 256) with an n = 2
    // request (the general path) at position 280 of `running`.
    let mut c = cfg(Strategy::Unified, 4096);
    c.max_num_seqs = 400;
    let mut s = Scheduler::new(cache(4, 2048, 0), c).unwrap();
    for t in 0..301 {
        let n = if t == 280 { 2 } else { 1 };
        s.add_request(&format!("r{t}"), req(t, 3, n, 8)).unwrap();
    }
    step(&mut s, 7);
    let (out, _) = step(&mut s, 7);
    // Rows in running order: r0..r279, both sequences of r280, then r281..r300.
    let handles: Vec<u32> = (0..281).chain([280]).chain(281..301).collect();
    assert_eq!(out.handles, handles);
    let mut seq_index = vec![0; 302];
    seq_index[281] = 1;
    assert_eq!(out.seq_index, seq_index);
    assert_eq!(out.num_tokens, vec![1; 302]);
    assert_eq!(out.start_pos, vec![3; 302]);
    assert_eq!(out.num_batched_tokens, 302);
    // Every row samples once, in row order.
    assert_eq!(out.sample_rows, (0..302).collect::<Vec<i64>>());
    assert_eq!(
        (
            &out.sample_seq_ids,
            &out.sample_handles,
            &out.sample_gens,
            &out.sample_seq_index
        ),
        (&out.seq_ids, &out.handles, &out.gens, &out.seq_index)
    );
    // Each row's token and KV slot: position 3 is the last slot of the sequence's one block.
    let (tables, w) = s.block_tables(&out);
    let (slots, ids) = (s.slot_mapping(&out), s.input_ids(&out));
    for row in 0..302 {
        assert_eq!((ids[row], slots[row]), (7, tables[row * w] as i64 * 4 + 3));
    }
}
