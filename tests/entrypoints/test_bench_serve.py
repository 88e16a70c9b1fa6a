"""`pagedllm bench serve` against a live server."""

from __future__ import annotations

import math

import pytest

from pagedllm.cli.app import build_parser, main
from pagedllm.cli.bench_serve import run_bench_serve


def test_bench_serve_completes_every_request_and_reports_latencies(server):
    result = run_bench_serve(
        base_url=server.url,
        num_prompts=6,
        input_len=12,
        output_len=5,
        max_concurrency=3,
        request_rate=math.inf,
        progress=False,
    )
    assert (result["completed"], result["failed"]) == (6, 0)
    assert result["output_tokens"] == 6 * 5
    assert result["prompt_tokens"] == 6 * 13  # BOS + 12 bytes
    assert result["request_throughput"] > 0 and result["output_throughput"] > 0
    for name in ("ttft_ms", "tpot_ms", "e2e_ms"):
        p = result[name]
        assert 0 < p["p50"] <= p["p90"] <= p["p99"]
    assert result["ttft_ms"]["p50"] <= result["e2e_ms"]["p99"]
    server.wait_idle()


def test_bench_serve_reports_the_gaps_between_a_streams_chunks(server):
    result = run_bench_serve(
        base_url=server.url, num_prompts=2, input_len=8, output_len=6, progress=False
    )
    itl = result["itl_ms"]
    # every chunk after a stream's first carries one more token: 5 gaps per request at most
    assert 0 < itl["p50"] <= itl["p99"] and itl["mean"] > 0
    assert "ITL" in result["summary"]
    server.wait_idle()


def test_bench_serve_with_a_request_rate(server, capsys):
    argv = ["bench", "serve", "--base-url", server.url, "--num-prompts", "3", "--input-len", "5"]
    argv += ["--output-len", "3", "--request-rate", "50", "--no-progress"]
    assert main(argv) == 0
    assert "3/3 requests completed" in capsys.readouterr().out


def test_bench_serve_counts_failed_requests_and_exits_1(server, capsys):
    argv = ["bench", "serve", "--base-url", server.url, "--num-prompts", "2", "--no-progress"]
    argv += ["--model", "no-such-model", "--output-len", "2"]
    assert main(argv) == 1
    assert "HTTP 404" in capsys.readouterr().err


def test_plain_bench_still_parses_without_the_serve_mode():
    args = build_parser().parse_args(["bench", "--num-prompts", "4"])
    assert args.bench_mode is None and args.num_prompts == 4


@pytest.mark.parametrize("rate", ["0", "-1"])
def test_bench_serve_refuses_a_non_positive_request_rate(rate, capsys):
    assert main(["bench", "serve", "--request-rate", rate]) == 1
    assert "--request-rate" in capsys.readouterr().err
