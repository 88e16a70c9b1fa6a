"""`pagedllm router`'s flags: replicas required (pagedllm's or external ones), the policy among
the core's, and the router core's balance defaults unless given."""

from __future__ import annotations

import pytest

from pagedllm.cli.app import build_parser, main


def test_router_needs_a_replica(capsys):
    assert main(["router"]) == 1
    assert "give at least one --replica URL (or --external-replica)" in capsys.readouterr().err


@pytest.mark.parametrize("values", [["http://x"], ["http://x", "tcp://x:1", "tcp://x:2", "y"]])
def test_an_external_replica_takes_its_url_events_and_optional_replay_endpoint(capsys, values):
    assert main(["router", "--external-replica", *values]) == 1
    assert (
        "--external-replica takes URL EVENTS_ENDPOINT [REPLAY_ENDPOINT]" in capsys.readouterr().err
    )


def test_an_unknown_routing_policy_is_refused(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["router", "--replica", "http://x", "--routing-policy", "rnd"])
    assert "cache_aware" in capsys.readouterr().err


def test_router_flags_parse_with_the_cores_defaults_left_unset():
    args = build_parser().parse_args(
        ["router", "--replica", "http://a:1", "--replica", "http://b:2", "--port", "9000"]
    )
    assert args.replica == ["http://a:1", "http://b:2"]
    assert args.routing_policy == "cache_aware"
    assert (args.balance_abs_threshold, args.balance_rel_threshold) == (None, None)
    assert args.token_weight is None
    assert (args.affinity_weight, args.unresponsive_after) == (None, None)


def test_a_token_weight_outside_zero_to_one_is_refused(capsys):
    args = build_parser().parse_args(["router", "--replica", "http://a:1", "--token-weight", "1"])
    assert args.token_weight == 1.0
    with pytest.raises(SystemExit):
        build_parser().parse_args(["router", "--replica", "http://a:1", "--token-weight", "2"])
    assert "--token-weight" in capsys.readouterr().err


def test_an_affinity_weight_outside_zero_to_one_is_refused(capsys):
    base = ["router", "--replica", "http://a:1", "--affinity-weight"]
    assert build_parser().parse_args([*base, "0"]).affinity_weight == 0.0
    with pytest.raises(SystemExit):
        build_parser().parse_args([*base, "1.5"])
    assert "--affinity-weight" in capsys.readouterr().err


def test_unresponsive_after_must_be_positive(capsys):
    base = ["router", "--replica", "http://a:1", "--unresponsive-after"]
    assert build_parser().parse_args([*base, "2.5"]).unresponsive_after == 2.5
    with pytest.raises(SystemExit):
        build_parser().parse_args([*base, "0"])
    assert "--unresponsive-after" in capsys.readouterr().err


def test_serve_takes_a_kv_events_config_as_json(capsys):
    args = build_parser().parse_args(
        ["serve", "--kv-events-config", '{"enable_kv_cache_events": true, "publisher": "zmq"}']
    )
    assert args.kv_events_config == {"enable_kv_cache_events": True, "publisher": "zmq"}
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--kv-events-config", "[1]"])
