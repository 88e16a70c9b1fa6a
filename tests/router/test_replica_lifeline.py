"""Data-parallel replicas run on the shared process supervisor (`launcher.ReplicaProcesses`):
a replica is tied to its launcher from its first instruction, so one whose launcher is killed
while the replica still imports exits (and removes the socket folder); an offline replica that
never says ready is killed after the deadline, failing the start with the shared
`WorkerStartupError`."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import slow_replica
from router_util import MODEL, wait_for

from pagedllm.config import EngineArgs
from pagedllm.executor.errors import WorkerStartupError
from pagedllm.router import offline

HERE = Path(__file__).parent

LAUNCHER = """
import os, sys
from pagedllm.router.launcher import ReplicaProcesses, _replica_main
import slow_replica
replicas = ReplicaProcesses(sys.argv[1])
replicas.start(_replica_main, (slow_replica.serve_forever, None))
print(replicas.pids()[0], flush=True)
os._exit(0)  # killed outright: no stop, no cleanup
"""


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def test_a_replica_whose_launcher_dies_while_it_imports_exits_and_removes_the_folder(tmp_path):
    folder = tmp_path / "pagedllm-dp-sockets"
    folder.mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), *sys.path])}
    done = subprocess.run(
        [sys.executable, "-c", LAUNCHER, str(folder)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    pid = int(done.stdout.split()[0])
    try:
        # its imports take 3 s more: a tie made only once they are done would come too late
        wait_for(lambda: not _running(pid), 10, what="the orphaned replica to exit")
    finally:
        if _running(pid):
            os.kill(pid, 9)
    assert not folder.exists()


def test_an_offline_replica_that_never_becomes_ready_is_killed_after_the_deadline(monkeypatch):
    monkeypatch.setattr(offline, "_serve_replica", slow_replica.never_ready)
    monkeypatch.setattr(offline, "START_TIMEOUT_S", 1.0)
    monkeypatch.setattr(offline, "STOP_GRACE_S", 0.1)
    monkeypatch.setattr(offline, "TERMINATE_GRACE_S", 0.1)
    before = set(multiprocessing.active_children())
    args = EngineArgs.from_kwargs(model=MODEL, data_parallel_size=2, cpu_threads=1)
    start = time.monotonic()
    with pytest.raises(WorkerStartupError, match="replica 0 did not answer within START_TIMEOUT_S"):
        offline.DataParallelEngines(args)
    assert time.monotonic() - start < 30
    assert set(multiprocessing.active_children()) <= before  # SIGTERM ignored: killed
