"""`pagedllm serve`: starts on the built-in model, serves, and stops cleanly on SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import httpx

from pagedllm.cli.app import build_parser, main

from server_util import free_port, wait_healthy


def test_serve_parser_takes_the_engine_and_server_flags():
    args = build_parser().parse_args(
        ["serve", "--port", "0", "--max-model-len", "64", "--scheduling", "unified",
         "--served-model-name", "m", "--api-key", "k", "--max-queued-requests", "3",
         "--max-queued-tokens", "100", "--max-request-body-bytes", "5000",
         "--max-failed-steps", "7"]
    )  # fmt: skip
    assert (args.host, args.port, args.max_model_len) == ("127.0.0.1", 0, 64)
    assert (args.served_model_name, args.api_key) == ("m", "k")
    assert (args.max_queued_requests, args.max_queued_tokens) == (3, 100)
    assert (args.max_request_body_bytes, args.max_failed_steps) == (5000, 7)


def test_serve_builds_its_engine_as_a_server(monkeypatch):
    """`serve` marks its engine's usage context (the server's default token budget)."""
    from pagedllm.entrypoints import api_server

    seen = {}

    def capture(engine_kwargs, config):
        seen.update(engine_kwargs)
        raise KeyboardInterrupt  # stop before a model loads

    monkeypatch.setattr(api_server, "build_server_app", capture)
    assert main(["serve", "--port", "0", "--max-model-len", "64"]) == 130
    assert seen["usage_context"] == "server"
    assert seen["max_num_batched_tokens"] is None  # unset: the engine config's default


def test_serve_answers_then_exits_0_on_sigterm():
    port = free_port()
    cmd = [sys.executable, "-m", "pagedllm.cli", "serve", "--port", str(port)]
    cmd += ["--max-model-len", "64", "--num-gpu-blocks", "16", "--log-level", "warning"]
    proc = subprocess.Popen(cmd, env={**os.environ, "PAGEDLLM_API_KEY": ""})
    try:
        wait_healthy(proc, f"http://127.0.0.1:{port}")
        body = {"prompt": "hi", "max_tokens": 3}
        reply = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=30)
        assert reply.status_code == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_sigterm_aborts_an_in_flight_stream_with_a_reason_and_exits_0():
    port = free_port()
    cmd = [sys.executable, "-m", "pagedllm.cli", "serve", "--port", str(port)]
    cmd += ["--max-model-len", "2048", "--num-gpu-blocks", "160", "--log-level", "warning"]
    cmd += ["--shutdown-grace", "0"]
    proc = subprocess.Popen(cmd, env={**os.environ, "PAGEDLLM_API_KEY": ""})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url)
        body = {"prompt": "hi", "max_tokens": 2000, "ignore_eos": True, "stream": True}
        chunks = []
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
            lines = response.iter_lines()
            for line in lines:
                if line.startswith("data: {"):
                    break
            proc.send_signal(signal.SIGTERM)
            chunks = [line for line in lines if line.startswith("data:")]
        assert chunks[-1] == "data: [DONE]"
        final = json.loads(chunks[-2][len("data: ") :])["choices"][0]
        assert final["finish_reason"] == "abort"
        assert final["stop_reason"] == "the server is shutting down"
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_serve_refuses_an_empty_api_key_before_loading_the_model(capsys):
    # `--api-key "$KEY"` with KEY unset must not serve without authentication
    assert main(["serve", "--api-key", "", "--model", "/no/such/model"]) == 1
    assert "API key is empty" in capsys.readouterr().err
