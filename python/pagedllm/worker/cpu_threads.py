"""How many threads torch's CPU operators (GEMMs, elementwise ops) and the Rust attention kernels
use: `cpu_threads` when given, else `OMP_NUM_THREADS` when set (torch already honours it), else
one per physical core this process may run on (hyperthread siblings share one core's FMA units,
so a second GEMM thread on them mostly waits).

The engine's own Python and the Rust scheduler run between the model's operators, never
alongside them, so they need no core of their own.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

_TOPOLOGY = Path("/sys/devices/system/cpu")


def physical_cores() -> int:
    """Physical cores among the CPUs this process may run on (at least 1)."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if not cpus:
        return max(1, os.cpu_count() or 1)
    cores = set()
    for cpu in cpus:
        topology = _TOPOLOGY / f"cpu{cpu}" / "topology"
        try:
            package = (topology / "physical_package_id").read_text().strip()
            core = (topology / "core_id").read_text().strip()
        except OSError:
            return len(cpus)  # no topology (containers, other OSes): count logical CPUs
        cores.add((package, core))
    return max(1, len(cores))


def default_cpu_threads() -> int | None:
    """The thread count the engine sets when none is given (None: leave OMP_NUM_THREADS's)."""
    if os.environ.get("OMP_NUM_THREADS"):
        return None
    return physical_cores()


def configure_cpu_threads(cpu_threads: int | None) -> int:
    """Set torch's intra-op threads (process-wide, like vLLM's CPU worker); returns the count."""
    threads = cpu_threads if cpu_threads is not None else default_cpu_threads()
    if threads is not None and threads != torch.get_num_threads():
        torch.set_num_threads(threads)
    return torch.get_num_threads()
