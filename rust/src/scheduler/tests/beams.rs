//! `fork_beams`: a beam continues another one's history on its shared blocks.
use super::*;

fn tokens_of(s: &Scheduler, id: &str) -> Vec<Vec<TokenId>> {
    let h = s.store.handle_of(id).unwrap();
    s.store
        .get(h)
        .seqs
        .iter()
        .map(|q| q.tokens.clone())
        .collect()
}

#[test]
fn fork_beams_continues_the_parent_on_shared_blocks() {
    let mut s = Scheduler::new(cache(4, 64, 0), cfg(Strategy::Unified, 64)).unwrap();
    s.add_request("a", req(0, 6, 2, 10)).unwrap();
    let out = s.schedule(0.0).unwrap();
    s.update_from_output(out.step, &[7, 8], None).unwrap();
    let out = s.schedule(0.0).unwrap();
    let free_before = s.mgr.num_free_device_blocks();
    assert_eq!(s.fork_beams(out.step, "a", &[0, 0]).unwrap(), 1);
    s.check_invariants().unwrap();
    // sequence 1 gave back its own tail block and now shares all of sequence 0's
    assert_eq!(s.mgr.num_free_device_blocks(), free_before + 1);
    s.update_from_output(out.step, &[9, 10], None).unwrap();
    let p = prompt(0, 6);
    let toks = tokens_of(&s, "a");
    assert_eq!(toks[0], [&p[..], &[7, 9]].concat());
    assert_eq!(toks[1], [&p[..], &[7, 10]].concat());
    // the next append copies the shared tail instead of writing into it
    let _ = step(&mut s, 3);
}

#[test]
fn fork_beams_refuses_a_parent_that_moves() {
    let mut s = Scheduler::new(cache(4, 64, 0), cfg(Strategy::Unified, 64)).unwrap();
    s.add_request("a", req(0, 6, 3, 10)).unwrap();
    let out = s.schedule(0.0).unwrap();
    s.update_from_output(out.step, &[7, 8, 9], None).unwrap();
    let out = s.schedule(0.0).unwrap();
    let err = s.fork_beams(out.step, "a", &[1, 2, 2]).unwrap_err();
    assert!(err.to_string().contains("does not keep its place"), "{err}");
    assert!(s.fork_beams(out.step, "a", &[0, 0]).is_err());
    assert!(s.fork_beams(out.step, "b", &[0, 0, 0]).is_err());
}
