"""How many threads torch's CPU operators (GEMMs, elementwise ops) and the Rust kernels use, and
how torch's OpenMP threads wait between operators.

Thread count: `cpu_threads` when given, else `OMP_NUM_THREADS` when set (torch already honours
it), else the physical cores this process may run on (hyperthread siblings share one core's FMA
units, so a second GEMM thread on them mostly waits; the spare hyperthreads are left to the
rest). The engine's Python runs on the calling thread, which is one of the model's threads, and
a server's front end needs a few percent of a core: on 2 cores, every core computing gave 1.3x
the offline output of one thread and a server's TPOT 0.6-0.8x (benches/RESULTS.md, "Serving
speed on CPU", round 4). Under tensor parallelism the ranks share the cores (each rank
`cores // ranks`). At least one thread. The Rust kernels' threads claim their work in small runs
(`rust/src/cpu/pool.rs`), so a thread whose core another process takes does less rather than
stalling the call (with a CPU hog on one of 2 cores, 0.67x the quiet output).

Wait policy: libgomp's OpenMP workers (torch's CPU wheels) spin for up to milliseconds after
each parallel region before they sleep, on cores that the Rust kernels' threads, the front end
and other processes want in between. `import pagedllm` asks for `OMP_WAIT_POLICY=PASSIVE` (sleep
at once) unless the user chose a wait policy (`pagedllm/__init__.py`); libgomp reads it once,
when torch loads it, so the package's root sets it before anything imports torch.
"""

from __future__ import annotations

import os
from pathlib import Path

_TOPOLOGY = Path("/sys/devices/system/cpu")


def _allowed_cpus() -> list[int]:
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []


def physical_cores() -> int:
    """Physical cores among the CPUs this process may run on (at least 1)."""
    cpus = _allowed_cpus()
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


def default_cpu_threads(ranks: int = 1) -> int | None:
    """The thread count each of `ranks` engines sharing this machine's cores (tensor-parallel
    ranks, data-parallel replicas) sets when none is given (None: leave OMP_NUM_THREADS's)."""
    if os.environ.get("OMP_NUM_THREADS"):
        return None
    return max(1, physical_cores() // max(1, ranks))


def configure_cpu_threads(cpu_threads: int | None, ranks: int = 1) -> int:
    """Set torch's intra-op threads (process-wide, like vLLM's CPU worker); returns the count.
    `ranks`: the tensor-parallel ranks sharing this machine's cores (the default's divisor)."""
    import torch

    threads = cpu_threads if cpu_threads is not None else default_cpu_threads(ranks)
    if threads is not None and threads != torch.get_num_threads():
        torch.set_num_threads(threads)
    return torch.get_num_threads()
