"""The shared-memory names this package leaves in /dev/shm, and their clean-up.

Every segment is named `pagedllm-{kind}-{pid}-{n}-{16 hex digits}` by the process that created
it (`Segment::create`, `rust/src/dist/segment.rs`), and unlinked once every rank has mapped it. A
creator killed (SIGKILL) inside that window leaves the name until reboot. Two clean-ups:

- `remove_segments_of(pid)`: a supervisor's, once it has reaped its child `pid`;
- `remove_stale_segments()`: every start's, before it creates its own segments, for the
  engines that ran with no supervisor above them (a plain `serve`, a tensor-parallel engine):
  the names whose creator is no longer alive.
"""

from __future__ import annotations

import contextlib
import os
import re

SHM_FOLDER = "/dev/shm"
_NAME = re.compile(r"pagedllm-[a-z]+-(\d+)-\d+-[0-9a-f]{16}")


def _names() -> list[str]:
    with contextlib.suppress(OSError):  # no /dev/shm: no names either
        return [name for name in os.listdir(SHM_FOLDER) if _NAME.fullmatch(name)]
    return []


def _unlink(name: str) -> None:
    with contextlib.suppress(OSError):  # removed meanwhile, or not ours to remove
        os.unlink(os.path.join(SHM_FOLDER, name))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def remove_segments_of(pid: int) -> None:
    """Unlinks the names process `pid` (ended) created. A name it unlinked is long gone."""
    for name in _names():
        if int(_NAME.fullmatch(name).group(1)) == pid:
            _unlink(name)


def remove_stale_segments() -> None:
    """Unlinks the names whose creator is dead (killed between creating a segment and its ranks
    mapping it). A live creator's names are kept, whoever it is: a segment another engine is
    starting with stays."""
    for name in _names():
        if not _alive(int(_NAME.fullmatch(name).group(1))):
            _unlink(name)
