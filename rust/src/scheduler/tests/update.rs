//! `update_from_output`: the stop rules and the latest-output check.
use super::*;

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

#[test]
fn a_single_token_is_cut_as_a_run_of_one() {
    // the same stop rule as the update: EOS held back by min_tokens, then ending the
    // sequence by itself; the length cap ends it without being the token's own stop
    let mut s = Scheduler::new(cache(4, 64, 0), cfg(Strategy::Unified, 64)).unwrap();
    let mut p = req(0, 4, 1, 3);
    p.stop.eos_token_id = Some(2);
    p.stop.min_tokens = 2;
    s.add_request("a", p).unwrap();
    let out = s.schedule(0.0).unwrap();
    let cuts = s.stop_cuts(out.step, &[2], None).unwrap();
    assert_eq!((cuts.kept, cuts.by_token), (vec![1], vec![false]));
    assert!(s.stop_cuts(out.step, &[2, 2], None).is_err());
    s.update_from_output(out.step, &[2], None).unwrap();
    let out = s.schedule(0.0).unwrap();
    let cuts = s.stop_cuts(out.step, &[2], None).unwrap();
    assert_eq!(cuts.by_token, vec![true]);
    assert_eq!(cuts, s.stop_cuts(out.step, &[2], Some(&[1])).unwrap());
    assert_eq!(
        s.stop_cuts(out.step, &[7], None).unwrap().by_token,
        vec![false]
    );
    s.update_from_output(out.step, &[7], None).unwrap();
    let out = s.schedule(0.0).unwrap();
    // the third token reaches max_tokens: it stays in, and is not a stop token's
    let cuts = s.stop_cuts(out.step, &[7], None).unwrap();
    assert_eq!((cuts.kept, cuts.by_token), (vec![1], vec![false]));
    let fin = s.update_from_output(out.step, &[7], None).unwrap();
    assert_eq!(fin[0].reason, FinishReason::Length);
}
