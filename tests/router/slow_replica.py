"""Stand-in replicas for the lifeline tests: one whose imports take seconds in the replica
process (as a real one's do: torch, the engine), one that never says ready."""

from __future__ import annotations

import multiprocessing
import signal
import threading
import time

if multiprocessing.parent_process() is not None:
    time.sleep(3)  # the launcher is killed meanwhile


def serve_forever(ns) -> int:
    threading.Event().wait()
    return 0


def never_ready(args, tie, conn) -> None:
    """An offline replica whose engine never comes up, and that ignores SIGTERM."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    threading.Event().wait()
