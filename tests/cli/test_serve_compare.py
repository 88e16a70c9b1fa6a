"""`pagedllm bench serve --compare-vllm-python`: the two servers started in turn, the same
workload against each, medians and ratios. vLLM's server is stood in for by a second
`pagedllm serve` (the command that starts it is the driver's only vLLM-specific part)."""

from __future__ import annotations

import sys

import pytest

from pagedllm.cli import serve_compare
from pagedllm.cli.app import main

WORKLOAD = dict(num_prompts=2, input_len=8, output_len=4)


def _stand_in(starts: list[int]):
    def command(model: str, port: int, max_model_len: int) -> list[str]:
        starts.append(port)
        return serve_compare.pagedllm_command(model, port, max_model_len)

    return command


def test_servers_alternate_and_both_are_reported():
    starts: list[int] = []
    result = serve_compare.run_serve_compare(
        model="pagedllm/tiny-random",
        vllm_python=sys.executable,
        rounds=2,
        max_model_len=64,
        vllm_server=_stand_in(starts),
        **WORKLOAD,
    )
    assert len(starts) == 2  # one vLLM start per round
    for name in ("pagedllm", "vllm"):
        assert len(result["runs"][name]) == 2
        assert result["median"][name]["output_throughput"] > 0
        assert result["median"][name]["tpot_p50_ms"] > 0
    assert result["pagedllm_over_vllm"]["output_throughput"] > 0
    assert "ratio" in result["summary"] and "itl_p99_ms" in result["summary"]


def test_a_server_that_exits_is_named_with_its_log():
    def broken(model: str, port: int, max_model_len: int) -> list[str]:
        return [sys.executable, "-c", "import sys; print('no vllm here'); sys.exit(3)"]

    with pytest.raises(RuntimeError, match=r"vllm server .* exited with status 3(.|\n)*no vllm"):
        serve_compare.run_serve_compare(
            model="pagedllm/tiny-random",
            vllm_python=sys.executable,
            rounds=1,
            max_model_len=64,
            vllm_server=broken,
            **WORKLOAD,
        )


def test_a_missing_interpreter_is_refused_before_any_server_starts(capsys):
    argv = ["bench", "serve", "--compare-vllm-python", "/no/such/python", "--model", "m"]
    assert main(argv) == 1
    assert "/no/such/python" in capsys.readouterr().err


def test_compare_mode_needs_the_model_folder(capsys):
    assert main(["bench", "serve", "--compare-vllm-python", sys.executable]) == 1
    assert "needs --model" in capsys.readouterr().err


def test_a_named_dtype_is_passed_to_both_servers():
    argvs: list[list[str]] = []
    real_running_server = serve_compare.running_server

    def recording(name, command, port, env):
        argvs.append(command)
        return real_running_server(name, command, port, env)

    serve_compare.running_server, saved = recording, serve_compare.running_server
    try:
        result = serve_compare.run_serve_compare(
            model="pagedllm/tiny-random",
            vllm_python=sys.executable,
            rounds=1,
            max_model_len=64,
            dtype="bfloat16",
            vllm_server=_stand_in([]),
            **WORKLOAD,
        )
    finally:
        serve_compare.running_server = saved
    assert len(argvs) == 2
    assert all(argv[-2:] == ["--dtype", "bfloat16"] for argv in argvs)
    assert result["dtype"] == "bfloat16"


def test_an_unknown_dtype_is_refused_before_any_server_starts():
    with pytest.raises(ValueError, match=r"--dtype must be one of .*got 'fp8'"):
        serve_compare.run_serve_compare(
            model="pagedllm/tiny-random",
            vllm_python=sys.executable,
            dtype="fp8",
            vllm_server=_stand_in([]),
            **WORKLOAD,
        )


def test_a_server_process_keeps_its_output_in_the_named_log(tmp_path):
    log = tmp_path / "serve.log"
    command = [sys.executable, "-c", "import sys; print('starting up'); sys.exit(2)"]
    port = serve_compare.free_port()
    with (
        pytest.raises(RuntimeError, match=r"exited with status 2(.|\n)*starting up"),
        serve_compare.server_process("pagedllm", command, port, log=log),
    ):
        pass
    assert "starting up" in log.read_text()
