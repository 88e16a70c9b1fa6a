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
