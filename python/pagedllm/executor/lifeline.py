"""A spawned worker's tie to its engine: the worker dies with the engine, at any moment of its life.

`run_tied` is the worker process' entry. Its module imports nothing heavy, so the tie is made a
fraction of a second after the spawn, before the worker's own target is even unpickled (which
imports torch and takes seconds): from then on a thread watches the engine (the parent's
sentinel, a pipe multiprocessing closes when the parent dies, and `os.getppid()` as a backstop)
and ends the worker as soon as it is gone. Before the worker has opened the shared-memory names
the engine made for it, a parent that died cannot remove them any more: the watch removes them.

Once the worker holds what it needs (`Tie.hold`: the names are its to open no more),
`PR_SET_PDEATHSIG` makes the kernel kill it with its parent as well, even while a C call holds the
interpreter (SIGKILL; a data-parallel replica asks for SIGTERM, so that a server shuts down as it
would and removes its folder). Folders the engine made for its workers (`orphan_folders`: the
replicas' socket folder) are removed by whichever orphan sees the engine gone first.

The death signal is armed only when the parent spawned the worker from its main thread: the
signal follows the *thread* that spawned the child, and a worker spawned from a thread that ends
before the engine would be killed with that thread (the watch alone ties such a worker).
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing
import os
import pickle
import shutil
import signal
import sys
import threading
import time
from dataclasses import dataclass
from multiprocessing import connection

# how often the watch also checks the parent's pid (the sentinel wakes it at once otherwise)
PARENT_POLL_S = 0.5
# the exit status of a worker whose engine died
ORPHAN_EXIT_CODE = 1
# seconds a held worker whose death signal it handles itself (not SIGKILL: a replica's server)
# is given to shut down on it once orphaned, before the watch ends it
ORPHAN_GRACE_S = 30.0
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


@dataclass
class Tie:
    """What a worker needs to die with its engine: the engine's pid, whether the kernel's death
    signal may be armed (the engine spawned it from its main thread) and which (`kill_with`),
    the shared-memory names the engine made for it (under /dev/shm) that it removes if the engine
    dies first, and the folders any orphan removes."""

    parent_pid: int
    death_signal: bool
    orphan_names: tuple[str, ...] = ()
    orphan_folders: tuple[str, ...] = ()
    kill_with: int = signal.SIGKILL
    held: bool = False  # set in the worker by `hold`

    @classmethod
    def to_this_process(
        cls,
        orphan_names: tuple[str, ...] = (),
        orphan_folders: tuple[str, ...] = (),
        kill_with: int = signal.SIGKILL,
    ) -> Tie:
        """The tie to the calling process, for a child spawned by the calling thread."""
        main = threading.current_thread() is threading.main_thread()
        linux = main and sys.platform == "linux"
        return cls(os.getpid(), linux, orphan_names, orphan_folders, kill_with)

    @property
    def orphaned(self) -> bool:
        """The engine is gone (this worker's parent is another process now)."""
        return os.getppid() != self.parent_pid

    def bind(self) -> None:
        """In the worker, first thing: exit now if the engine is already gone, else watch it."""
        if self.orphaned:
            self._orphaned()
        watch = threading.Thread(target=self._watch, name="pagedllm-engine-watch", daemon=True)
        watch.start()

    def hold(self) -> None:
        """The worker has opened its names (they are gone from /dev/shm, or another worker still
        to open them watches them): from here the kernel may kill it with its parent."""
        self.orphan_names = ()
        self.held = True
        if self.death_signal:
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.prctl(PR_SET_PDEATHSIG, self.kill_with, 0, 0, 0) != 0:
                raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
            if self.orphaned:  # died before the signal was armed
                self._orphaned()

    def _watch(self) -> None:
        parent = multiprocessing.parent_process()  # None: not started by multiprocessing
        sentinels = [] if parent is None else [parent.sentinel]
        while not connection.wait(sentinels, timeout=PARENT_POLL_S):
            if self.orphaned:
                break
        if self.held and self.kill_with != signal.SIGKILL:
            # it shuts down on its signal as it would on the kernel's (a server closes its
            # sockets, removes its folders); the watch ends it only if that does not
            os.kill(os.getpid(), self.kill_with)
            time.sleep(ORPHAN_GRACE_S)
        self._orphaned()

    def _orphaned(self) -> None:
        """The engine is gone: remove its names this worker had still to open and its folders,
        and exit at once (nothing the worker holds needs finishing: the kernel unmaps its
        memory)."""
        self.remove_orphaned()
        os._exit(ORPHAN_EXIT_CODE)

    def remove_orphaned(self) -> None:
        """Remove what the engine, now gone, left for this worker to remove."""
        for name in self.orphan_names:
            with contextlib.suppress(OSError):
                os.unlink(f"/dev/shm/{name.lstrip('/')}")
        for folder in self.orphan_folders:
            shutil.rmtree(folder, ignore_errors=True)


def run_tied(tie: Tie, payload: bytes, *handles) -> None:
    """A spawned worker's entry: tie it to its engine, then run the target `payload` pickles
    (`(function, args)`, unpickled only now: that is what imports torch) with `args`, `tie` and
    `handles` (what multiprocessing must hand over itself: pipes)."""
    tie.bind()
    target, args = pickle.loads(payload)
    target(*args, tie, *handles)
