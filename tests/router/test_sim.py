"""The cluster simulation runs the real scheduler and router core: on a shared-prefix trace the
cache-aware policy finds more of the prompts cached than round robin, and every request gets
its first token."""

from __future__ import annotations

import pytest

from pagedllm.router.sim import multi_turn, shared_prefix, simulate


def test_cache_aware_beats_round_robin_on_hit_rate_in_the_simulation():
    prompts = shared_prefix(groups=8, questions=4, prefix=128, question=8)
    run = {
        policy: simulate(prompts, replicas=2, policy=policy, rate=20.0, blocks=48)
        for policy in ("cache_aware", "round_robin")
    }
    assert run["cache_aware"]["hit_rate"] > run["round_robin"]["hit_rate"]


def test_multi_turn_prompts_repeat_their_history():
    prompts = multi_turn(convs=2, turns=3, turn_len=5)
    assert len(prompts) == 6
    longest = max(prompts, key=len)
    assert len(longest) == 15
    assert sum(1 for p in prompts if longest[: len(p)] == p) == 3


def test_the_long_chat_workload_runs_from_the_command_line(capsys):
    from pagedllm.router.sim import main

    main(["--replicas", "2", "--workload", "long_chat", "--turns", "3", "--policies", "approx"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 2 |")]
    assert len(rows) == 1 and rows[0].startswith("| 2 | approx |")


@pytest.mark.parametrize(
    "knob, bad",
    [("token_weight", 2.0), ("affinity_weight", 2.0), ("load_weight", 2.0), ("divert_ratio", 0.5)],
)
def test_the_router_knobs_are_handed_to_the_router_core(knob, bad):
    with pytest.raises(ValueError, match=knob):
        simulate(
            multi_turn(convs=1, turns=1, turn_len=4),
            replicas=1,
            policy="cache_aware",
            rate=1.0,
            blocks=8,
            **{knob: bad},
        )


def test_the_divert_ratio_flag_reaches_the_router_core():
    from pagedllm.router.sim import main

    with pytest.raises(ValueError, match="divert_ratio"):
        main(
            ["--replicas", "2", "--workload", "long_chat", "--turns", "1", "--divert-ratio", "0.5"]
        )


def test_with_several_seeds_a_row_is_the_mean_of_their_runs(capsys):
    from pagedllm.router.sim import main

    argv = ["--replicas", "2", "--workload", "multi_turn", "--convs-per-replica", "2"]
    argv += ["--turns", "2", "--policies", "round_robin"]
    main([*argv, "--seeds", "2"])
    both = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 2 |")]
    runs = [
        simulate(
            multi_turn(convs=4, turns=2, turn_len=96, seed=seed),
            replicas=2,
            policy="round_robin",
            rate=8.0,
            blocks=128,
            seed=seed,
        )
        for seed in (0, 1)
    ]
    mean_p50 = (runs[0]["ttft_p50"] + runs[1]["ttft_p50"]) / 2
    assert len(both) == 1 and both[0].split("|")[4].strip() == f"{mean_p50:.3f}"
    assert runs[0]["ttft_p50"] != runs[1]["ttft_p50"]


def test_first_seed_picks_the_seeds_a_row_averages(capsys):
    from pagedllm.router.sim import main

    argv = ["--replicas", "2", "--workload", "multi_turn", "--convs-per-replica", "2"]
    argv += ["--turns", "2", "--policies", "round_robin", "--first-seed", "5"]
    main(argv)
    row = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 2 |")]
    run = simulate(
        multi_turn(convs=4, turns=2, turn_len=96, seed=5),
        replicas=2,
        policy="round_robin",
        rate=8.0,
        blocks=128,
        seed=5,
    )
    assert len(row) == 1 and row[0].split("|")[4].strip() == f"{run['ttft_p50']:.3f}"


def test_the_approximate_router_keeps_what_it_sent_where_after_the_request_ends():
    from pagedllm.router.sim import ApproximateRouter

    router = ApproximateRouter(2, 16)
    prompt = list(range(1000, 1040))  # 2 reusable blocks (the last token is always computed)
    replica, _, _, _, ticket = router.route(prompt, now=0.0)
    router.finish(ticket)
    again, matched, eligible, _, _ = router.route(prompt, now=1e9)  # no event ever came
    assert (again, matched, eligible) == (replica, 2, 2)
