"""A stream whose replica breaks off after the first event ends, for the client, with an error
event and [DONE] (not a silent truncation), and the replica leaves rotation."""

from __future__ import annotations

import json
import socket
import threading

import httpx
from router_util import start, stop

from pagedllm.router.app import build_router_app
from pagedllm.router.replicas import ReplicaSet


def breaking_replica() -> tuple[str, socket.socket]:
    """An HTTP server whose /load answers and whose completions send one chunked SSE event,
    then drop the connection."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()

    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            if conn.recv(65536).startswith(b"GET /load"):
                load = json.dumps(
                    {"instance_id": "x", "num_waiting": 0, "num_running": 0, "kv_usage": 0.0}
                ).encode()
                conn.sendall(
                    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                    + f"content-length: {len(load)}\r\nconnection: close\r\n\r\n".encode()
                    + load
                )
                conn.close()
                continue
            event = b'data: {"choices": [{"text": "hi", "index": 0}]}\n\n'
            conn.sendall(
                b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                b"transfer-encoding: chunked\r\n\r\n"
                + f"{len(event):x}\r\n".encode()
                + event
                + b"\r\n"
            )
            conn.close()  # no terminating chunk: the stream breaks

    threading.Thread(target=serve, daemon=True).start()
    return f"http://127.0.0.1:{listener.getsockname()[1]}", listener


def test_a_stream_broken_mid_way_ends_with_an_error_event():
    url, listener = breaking_replica()
    replicas = ReplicaSet([url], block_size=16, policy="round_robin", health_interval=30)
    router = start(build_router_app(replicas), int(_free_port()))
    try:
        body = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 4, "stream": True}
        with httpx.stream("POST", f"{router.url}/v1/completions", json=body, timeout=30) as r:
            lines = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert json.loads(lines[0][6:])["choices"][0]["text"] == "hi"
        error = json.loads(lines[1][6:])["error"]
        assert error["code"] == 502 and "mid-stream" in error["message"]
        assert lines[2] == "data: [DONE]"
        assert not replicas.replicas[0].alive
    finally:
        stop(router)
        listener.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
