"""A stand-in `pagedllm serve` replica in its own process (so a test can SIGSTOP it): stdlib
HTTP only. GET /load answers the JSON in LOAD_FILE (re-read each time, so a test can change it);
POST /v1/completions streams one SSE event every 50 ms, `max_tokens` of them, then [DONE]
(`stream`), or answers at once; with --hang it never answers a completion. POST /tokenize and
/detokenize answer fixed bodies; the runtime LoRA routes answer `--lora-status` (200: vLLM's
line) and log each call to LOAD_FILE.lora.log. With --api-key, every path but /health and
/metrics wants it.

    python fake_replica.py PORT LOAD_FILE [--hang] [--api-key KEY] [--lora-status N]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx

GOOD_LOAD = {"instance_id": "fake", "num_waiting": 0, "num_running": 0, "kv_usage": 0.0}
EVENT_INTERVAL_S = 0.05


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    options: argparse.Namespace

    def log_message(self, *args) -> None:  # quiet
        pass

    def _authorized(self) -> bool:
        key = self.options.api_key
        if key is None or self.path in ("/health", "/metrics"):
            return True
        if self.headers.get("authorization") == f"Bearer {key}":
            return True
        self._json(401, {"error": {"message": "no key", "code": 401}})
        return False

    def _json(self, status: int, payload) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if not self._authorized():
            return
        if self.path == "/load":
            data = Path(self.options.load_file).read_bytes()
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        elif self.path == "/health":
            self._json(200, {})
        elif self.path == "/v1/models":
            self._json(200, {"object": "list", "data": [{"id": "fake"}]})
        else:
            self._json(404, {})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers.get("content-length", 0))) or b"{}")
        if not self._authorized():
            return
        if self.path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
            self._lora(body)
        elif self.path == "/tokenize":
            self._json(200, {"tokens": [1, 2, 3], "count": 3})
        elif self.path == "/detokenize":
            self._json(200, {"prompt": "fake text"})
        elif self.options.hang:
            time.sleep(3600)
        elif body.get("stream"):
            with contextlib.suppress(ConnectionError):  # the router hung up
                self._stream(int(body.get("max_tokens", 4)))
        else:
            self._json(200, {"choices": [{"text": "done", "index": 0}]})

    def _lora(self, body: dict) -> None:
        """Answers `--lora-status` (a line, or a 4xx naming `lora_path`); logs the call."""
        with open(f"{self.options.load_file}.lora.log", "a") as log:
            log.write(f"{self.path} {body.get('lora_name')}\n")
        status = self.options.lora_status
        if status >= 400:
            error = {"message": "no adapter there", "type": "invalid_request_error"}
            self._json(status, {"error": {**error, "param": "lora_path", "code": status}})
            return
        data = f"Success: LoRA adapter '{body.get('lora_name')}' added successfully.".encode()
        self.send_response(status)
        self.send_header("content-type", "text/plain; charset=utf-8")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _stream(self, events: int) -> None:
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("transfer-encoding", "chunked")
        self.end_headers()
        for i in range(events):
            event = f'data: {{"choices": [{{"text": "t{i}", "index": 0}}]}}\n\n'.encode()
            self.wfile.write(f"{len(event):x}\r\n".encode() + event + b"\r\n")
            self.wfile.flush()
            time.sleep(EVENT_INTERVAL_S)
        done = b"data: [DONE]\n\n"
        self.wfile.write(f"{len(done):x}\r\n".encode() + done + b"\r\n0\r\n\r\n")


class FakeReplica:
    """The process, its URL and its /load file (`set_load` rewrites it)."""

    def __init__(self, folder: Path, name: str, *extra: str, load: dict | None = None) -> None:
        self.load_file = folder / f"{name}-load.json"
        self.set_load(load or GOOD_LOAD)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        cmd = [sys.executable, __file__, str(port), str(self.load_file), *extra]
        self.proc = subprocess.Popen(cmd)
        deadline = time.monotonic() + 20
        while True:
            try:
                httpx.get(f"{self.url}/health", timeout=1)
                break
            except httpx.TransportError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the fake replica did not start") from None
                time.sleep(0.05)

    def set_load(self, load: dict | str) -> None:
        text = load if isinstance(load, str) else json.dumps(load)
        tmp = self.load_file.with_suffix(".tmp")
        tmp.write_text(text)
        os.replace(tmp, self.load_file)

    def freeze(self) -> None:
        self.proc.send_signal(signal.SIGSTOP)

    def close(self) -> None:
        self.proc.send_signal(signal.SIGCONT)
        self.proc.kill()
        self.proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("port", type=int)
    parser.add_argument("load_file")
    parser.add_argument("--hang", action="store_true")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--lora-status", type=int, default=200)
    Handler.options = parser.parse_args()
    server = ThreadingHTTPServer(("127.0.0.1", Handler.options.port), Handler)
    server.daemon_threads = True
    server.serve_forever()


if __name__ == "__main__":
    main()
