//! Structured output: requests waiting for their grammar, `grammar_ready`, the step's
//! constrained samples.
use super::*;

/// Structured output: a request whose grammar compiles waits in place while those behind it
/// run, under every strategy; it is admitted the step after `grammar_ready`, and from then on
/// its samples are listed as constrained.
#[test]
fn grammar_compiling_request_waits_without_blocking_others() {
    for st in [
        Strategy::PrefillFirst,
        Strategy::ChunkedPrefill,
        Strategy::Unified,
    ] {
        let mut s = Scheduler::new(cache(4, 64, 0), cfg(st, 64)).unwrap();
        let mut so = req(0, 4, 2, 4);
        so.structured_output = true;
        s.add_request("so", so).unwrap();
        s.add_request("free", req(1, 4, 1, 4)).unwrap();
        let (out, _) = step(&mut s, 7);
        assert_eq!(s.waiting_ids(), vec!["so"], "{st:?}");
        assert_eq!(s.running_ids(), vec!["free"], "{st:?}");
        assert!(s.structured_samples(&out).is_empty(), "{st:?}");
        let (out, _) = step(&mut s, 7);
        assert_eq!(s.waiting_ids(), vec!["so"], "{st:?}: still compiling");
        assert_eq!(out.num_samples(), 1, "{st:?}");

        assert!(s.grammar_ready("so").unwrap(), "{st:?}");
        assert!(!s.grammar_ready("so").unwrap(), "{st:?}: marked once");
        let out = s.schedule(0.0).unwrap();
        assert!(s.waiting_ids().is_empty(), "{st:?}");
        let constrained: Vec<usize> = s
            .structured_samples(&out)
            .iter()
            .map(|&k| k as usize)
            .collect();
        let so_samples: Vec<usize> = (0..out.num_samples())
            .filter(|&k| out.sample_handles[k] == s.handle_of("so").unwrap())
            .collect();
        assert_eq!(constrained, so_samples, "{st:?}");
        assert_eq!(
            constrained.len(),
            2,
            "{st:?}: n=2 forks at its first sample"
        );
        s.update_from_output(out.step, &vec![7; out.num_samples()], None)
            .unwrap();
        s.check_invariants().unwrap();
    }
}

/// `grammar_ready` on an unconstrained request is an argument error; on unknown ids a no-op.
#[test]
fn grammar_ready_refuses_unconstrained_requests() {
    let mut s = Scheduler::new(cache(4, 64, 0), cfg(Strategy::Unified, 64)).unwrap();
    s.add_request("free", req(0, 4, 1, 4)).unwrap();
    assert!(matches!(
        s.grammar_ready("free"),
        Err(Error::InvalidArgument(_))
    ));
    assert!(!s.grammar_ready("nobody").unwrap());
}

/// A grammar that fails to compile: the engine aborts the request, which leaves nothing
/// behind and disturbs nobody.
#[test]
fn aborting_a_compiling_request_frees_it() {
    let mut s = Scheduler::new(cache(4, 64, 0), cfg(Strategy::Unified, 64)).unwrap();
    let mut so = req(0, 4, 1, 4);
    so.structured_output = true;
    s.add_request("so", so).unwrap();
    s.add_request("free", req(1, 4, 1, 4)).unwrap();
    step(&mut s, 7);
    assert!(s.abort_request("so").unwrap());
    assert!(!s.grammar_ready("so").unwrap());
    step(&mut s, 7);
    assert!(s.waiting_ids().is_empty());
    assert_eq!(s.running_ids(), vec!["free"]);
    assert_eq!(s.stats().counters.num_aborted, 1);
    for _ in 0..3 {
        step(&mut s, 7);
    }
    assert!(!s.has_unfinished_requests());
}

/// A constrained request preempted by recompute keeps its grammar ready: it is re-admitted
/// without waiting again, and its samples stay constrained.
#[test]
fn preempted_structured_request_stays_ready() {
    let mut c = cfg(Strategy::Unified, 64);
    c.preemption_mode = PreemptionMode::Recompute;
    let mut s = Scheduler::new(cache(4, 3, 0), c).unwrap();
    // Added last, it is the tail of `running`: the victim when blocks run out.
    s.add_request("free", req(1, 4, 1, 8)).unwrap();
    let mut so = req(0, 4, 1, 8);
    so.structured_output = true;
    s.add_request("so", so).unwrap();
    s.grammar_ready("so").unwrap();
    let mut preempted = false;
    for _ in 0..20 {
        let (out, _) = step(&mut s, 7);
        preempted |= out.preempted.iter().any(|id| id == "so");
        for &k in &s.structured_samples(&out) {
            assert_eq!(out.sample_handles[k as usize], s.handle_of("so").unwrap());
        }
        if !s.has_unfinished_requests() {
            break;
        }
    }
    assert!(
        preempted,
        "the workload must preempt the constrained request"
    );
    assert!(!s.has_unfinished_requests());
}
