"""`pagedllm run-batch`: OpenAI batch files answered as `pagedllm serve` answers them."""

from __future__ import annotations

import contextlib
import io
import json
import sys
from pathlib import Path

import httpx
import pytest

from pagedllm.cli import main

sys.path.insert(0, str(Path(__file__).parents[1] / "entrypoints"))
from server_util import ENGINE, MODEL, live_server  # noqa: E402

ENGINE_FLAGS = [
    "--device",
    "cpu",
    "--max-model-len",
    str(ENGINE["max_model_len"]),
    "--num-gpu-blocks",
    str(ENGINE["num_gpu_blocks"]),
    "--block-size",
    str(ENGINE["block_size"]),
    "--max-num-seqs",
    str(ENGINE["max_num_seqs"]),
]
CHAT = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "Hello there"}],
    "max_tokens": 5,
    "temperature": 0,
}
COMPLETION = {"model": MODEL, "prompt": "The sky is", "max_tokens": 6, "temperature": 0}
GOOD = {"chat": ("/v1/chat/completions", CHAT), "cmpl": ("/v1/completions", COMPLETION)}


def _line(custom_id: str, url: str, body: dict) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


MIXED = [
    _line("chat", *GOOD["chat"]),
    "{this is not json",
    _line("cmpl", *GOOD["cmpl"]),
    _line("nowhere", "/v1/images/generations", {"prompt": "a cat"}),
    _line("bad-body", "/v1/completions", {**COMPLETION, "max_tokens": -1}),
    _line("embed", "/v1/embeddings", {"model": MODEL, "input": "hi"}),
]


@pytest.fixture(scope="module")
def batch(tmp_path_factory):
    """The mixed file run once: (output lines, rc, stderr)."""
    folder = tmp_path_factory.mktemp("batch")
    (folder / "in.jsonl").write_text("\n".join(MIXED) + "\n")
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        rc = main(
            ["run-batch", "-i", str(folder / "in.jsonl"), "-o", str(folder / "out.jsonl")]
            + ENGINE_FLAGS
        )
    lines = (folder / "out.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines], rc, stderr.getvalue()


def _comparable(body: dict) -> dict:
    """An answer without what differs between two runs of one request (id, time)."""
    return {k: v for k, v in body.items() if k not in ("id", "created")}


def test_run_batch_writes_one_line_per_input_line_in_order(batch):
    results, rc, _ = batch
    assert rc == 0
    assert [r["custom_id"] for r in results] == [
        "chat",
        None,
        "cmpl",
        "nowhere",
        "bad-body",
        "embed",
    ]
    assert len({r["id"] for r in results}) == len(results)


def test_run_batch_answers_good_lines_as_the_server_does(batch):
    results, _, _ = batch
    by_id = {r["custom_id"]: r for r in results}
    with live_server() as server:
        for custom_id, (url, body) in GOOD.items():
            expected = httpx.post(f"{server.url}{url}", json=body, timeout=30).json()
            result = by_id[custom_id]
            assert result["error"] is None
            assert result["response"]["status_code"] == 200
            assert result["response"]["request_id"] == result["response"]["body"]["id"]
            assert _comparable(result["response"]["body"]) == _comparable(expected)


def test_run_batch_turns_bad_lines_into_error_lines(batch):
    results, _, _ = batch
    malformed, unknown_url, bad_body, embed = results[1], results[3], results[4], results[5]
    assert malformed["response"] is None and malformed["error"]["code"] == "invalid_json"
    assert "line 2" in malformed["error"]["message"]
    assert unknown_url["response"] is None and unknown_url["error"]["code"] == "invalid_url"
    assert "/v1/images/generations" in unknown_url["error"]["message"]
    assert bad_body["response"]["status_code"] == 400
    assert bad_body["response"]["body"]["error"]["param"] == "max_tokens"
    assert bad_body["error"]["code"] == "invalid_request_error"
    # a generating model refuses embeddings, as `pagedllm serve` does
    assert embed["response"]["status_code"] == 400
    assert embed["response"]["body"]["error"]["param"] == "model"


def test_run_batch_prints_a_summary_of_the_counts(batch):
    results, _, stderr = batch
    tokens = sum(r["response"]["body"]["usage"]["total_tokens"] for r in results if not r["error"])
    assert f"run-batch: 2 completed, 4 failed, {tokens} tokens in " in stderr


def test_run_batch_refuses_a_missing_input_file(tmp_path, capsys):
    missing = tmp_path / "nope.jsonl"
    assert main(["run-batch", "-i", str(missing), "-o", str(tmp_path / "o.jsonl")]) == 1
    err = capsys.readouterr().err
    assert f"--input-file '{missing}': no such file" in err
    assert not (tmp_path / "o.jsonl").exists()


def test_run_batch_refuses_a_url(tmp_path, capsys):
    url = "https://example.com/requests.jsonl"
    assert main(["run-batch", "-i", url, "-o", str(tmp_path / "o.jsonl")]) == 1
    assert "a URL; run-batch reads and writes local files only" in capsys.readouterr().err


def test_run_batch_answers_embeddings_on_a_pooling_model(tmp_path):
    from pooling.checkpoints import save_embedding_checkpoint

    model = str(save_embedding_checkpoint(tmp_path / "embed"))
    body = {"model": "e", "input": ["hello world", "paged attention"]}
    (tmp_path / "in.jsonl").write_text(_line("emb", "/v1/embeddings", body) + "\n")
    flags = ["--model", model, "--runner", "pooling", "--served-model-name", "e", "--no-progress"]
    out = tmp_path / "out.jsonl"
    assert main(["run-batch", "-i", str(tmp_path / "in.jsonl"), "-o", str(out)] + flags) == 0
    (result,) = [json.loads(line) for line in out.read_text().splitlines()]
    with live_server({"model": model, "runner": "pooling"}, served_model_name="e") as server:
        expected = httpx.post(f"{server.url}/v1/embeddings", json=body, timeout=30).json()
    assert result["error"] is None
    assert _comparable(result["response"]["body"]) == _comparable(expected)
