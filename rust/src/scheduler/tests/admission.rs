//! The admission seam: feature conditions holding requests back.
use super::*;

/// The admission seam (`schedule::admission::conditions`): a request a feature condition holds
/// back with `Wait` keeps its place and lets those behind it in, under every strategy, and is
/// admitted once the condition clears; `Later(Condition)` admits nobody behind it.
#[test]
fn admission_conditions_hold_a_request_in_place() {
    use crate::scheduler::schedule::admission::{Short, Verdict};
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
    use crate::scheduler::schedule::admission::Verdict;
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
