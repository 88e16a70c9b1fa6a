"""How many threads torch's CPU operators (GEMMs, elementwise ops) and the Rust kernels use, and
how torch's OpenMP threads wait between operators.

Thread count: `cpu_threads` when given, else `OMP_NUM_THREADS` when set (torch already honours
it), else the physical cores this process may run on (hyperthread siblings share one core's FMA
units, so a second GEMM thread on them mostly waits). A server leaves one CPU of them for
everything that is not the model — the HTTP front end, the router, other processes — as vLLM's
CPU worker leaves one: a spare hyperthread where the cores have them, else a whole core.
Offline nothing else runs: the engine's Python runs on the calling thread, which is one of the
model's threads, so every core computes (1.3x the output of one thread on 2 cores). Under
tensor parallelism the ranks share those cores (each rank `usable // ranks`). At least one
thread. The Rust kernels' threads claim their work in small runs (`rust/src/cpu/pool.rs`), so
a thread whose core another process takes does less rather than stalling the call; torch's own
operators still wait at their barriers, which is why a server keeps a core free.

Wait policy: libgomp's OpenMP workers (torch's CPU wheels) spin for up to milliseconds after
each parallel region before they sleep, on cores that the Rust kernels' threads, the front end
and other processes want in between. `prefer_passive_openmp` asks for `OMP_WAIT_POLICY=PASSIVE`
(sleep at once) unless the user chose a wait policy; libgomp reads it once, when torch loads it,
so `import pagedllm` calls it before anything imports torch.
"""

from __future__ import annotations

import os
from pathlib import Path

_TOPOLOGY = Path("/sys/devices/system/cpu")
# variables by which a user chooses libgomp's wait policy themselves
_WAIT_POLICY_ENV = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def prefer_passive_openmp() -> None:
    """Sets OMP_WAIT_POLICY=PASSIVE unless a wait policy is already chosen. Effective only
    before torch is imported (libgomp reads it at load)."""
    if not any(os.environ.get(name) for name in _WAIT_POLICY_ENV):
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"


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


def default_cpu_threads(ranks: int = 1, *, serving: bool = False) -> int | None:
    """The thread count each of `ranks` tensor-parallel ranks sets when none is given (None:
    leave OMP_NUM_THREADS's); `serving`: the engine runs behind a server, which keeps a CPU."""
    if os.environ.get("OMP_NUM_THREADS"):
        return None
    cores = physical_cores()
    logical = len(_allowed_cpus()) or os.cpu_count() or 1
    # a server's CPU for the rest: a spare hyperthread when the cores have them, else a core
    usable = cores - 1 if serving and logical == cores else cores
    return max(1, usable // max(1, ranks))


def configure_cpu_threads(cpu_threads: int | None, ranks: int = 1, *, serving: bool = False) -> int:
    """Set torch's intra-op threads (process-wide, like vLLM's CPU worker); returns the count.
    `ranks`: the tensor-parallel ranks sharing this machine's cores (the default's divisor);
    `serving`: behind a server (`default_cpu_threads`)."""
    import torch

    threads = (
        cpu_threads if cpu_threads is not None else default_cpu_threads(ranks, serving=serving)
    )
    if threads is not None and threads != torch.get_num_threads():
        torch.set_num_threads(threads)
    return torch.get_num_threads()
