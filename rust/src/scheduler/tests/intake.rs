//! `validate_request`: the request rules, owned by the core alone, asked without side effects.
use super::*;

fn sched() -> Scheduler {
    let mut c = cfg(Strategy::Unified, 64);
    c.max_num_seqs = 4;
    Scheduler::new(cache(4, 64, 0), c).unwrap()
}

#[test]
fn validate_request_has_no_side_effect() {
    let mut s = sched();
    s.validate_request("a", &req(0, 4, 2, 8)).unwrap();
    assert!(!s.has_unfinished_requests());
    s.check_invariants().unwrap();
    s.add_request("a", req(0, 4, 2, 8)).unwrap();
    let err = s.validate_request("a", &req(1, 4, 1, 8)).unwrap_err();
    assert_eq!(
        err,
        Error::InvalidArgument("request 'a': duplicate request id".into())
    );
}

/// Spoils one field of a good request.
type Spoil = fn(&mut RequestParams);

#[test]
fn each_request_rule_names_the_request_the_field_and_the_limit() {
    let s = sched();
    let cases: [(Spoil, &str); 7] = [
        (|p| p.prompt.clear(), "empty prompt"),
        (|p| p.n = 0, "n must be >= 1"),
        (
            |p| p.n = 5,
            "n=5 exceeds max_num_seqs=4 (the most sequences one request may have)",
        ),
        (|p| p.stop.max_tokens = 0, "max_tokens must be >= 1"),
        (
            |p| p.stop.min_tokens = 9,
            "min_tokens (9) must not exceed max_tokens (8)",
        ),
        (
            |p| p.arrival_time = f64::NAN,
            "arrival_time must be a finite number of seconds, got NaN",
        ),
        (|p| p.lora_id = 2, "lora_id=2 given but LoRA is not enabled"),
    ];
    for (spoil, message) in cases {
        let mut p = req(0, 4, 1, 8);
        spoil(&mut p);
        let err = s.validate_request("r'1", &p).unwrap_err().to_string();
        assert!(
            err.contains(&format!("request \"r'1\": {message}")),
            "{err}"
        );
    }
}

#[test]
fn request_ids_are_shown_as_python_shows_them() {
    assert_eq!(request_repr("a-1"), "'a-1'");
    assert_eq!(request_repr("it's"), "\"it's\"");
    assert_eq!(request_repr("a\\b\n"), "'a\\\\b\\n'");
    assert_eq!(request_repr("'\""), "'\\'\"'");
}
