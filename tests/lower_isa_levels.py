"""Runs the kernel tests once more at every CPU ISA level below this machine's, forced with
`PAGEDLLM_CPU_ISA`, after the whole suite ran at the machine's own level: the Rust `cpu::` tests
and the Python kernel tests. An AVX-512 machine thereby checks its AVX2 and portable kernels too,
and an AVX2 machine its portable ones. Part of README's test command; exits non-zero on the first
level that fails.

    python tests/lower_isa_levels.py
"""

from __future__ import annotations

import os
import subprocess
import sys

from pagedllm import _core

KERNEL_ISA_TEST = "tests/kernels/test_cpu_isa.py"
LEVELS = ("portable", "avx2", "avx512", "amx")  # lowest first, as rust/src/cpu/isa.rs orders them


def lower_levels(machine: str) -> list[str]:
    """The levels below `machine`'s, highest first (the nearest to what the suite ran at)."""
    return list(reversed(LEVELS[: LEVELS.index(machine)]))


def commands() -> list[list[str]]:
    return [
        ["cargo", "test", "--release", "--lib", "cpu::"],
        # test_cpu_isa forces levels itself, in subprocesses
        [sys.executable, "-m", "pytest", "-q", "tests/kernels", f"--ignore={KERNEL_ISA_TEST}"],
    ]


def main() -> int:
    if os.environ.get("PAGEDLLM_CPU_ISA"):
        print("lower_isa_levels: unset PAGEDLLM_CPU_ISA first", file=sys.stderr)
        return 2
    machine, flags = _core.cpu_isa()
    levels = lower_levels(machine)
    print(f"lower_isa_levels: machine level {machine} ({' '.join(flags)}); forcing {levels}")
    for level in levels:
        for command in commands():
            print(f"lower_isa_levels: PAGEDLLM_CPU_ISA={level} {' '.join(command)}", flush=True)
            done = subprocess.run(command, env={**os.environ, "PAGEDLLM_CPU_ISA": level})
            if done.returncode != 0:
                print(f"lower_isa_levels: failed at {level}", file=sys.stderr)
                return done.returncode
    return 0


if __name__ == "__main__":
    sys.exit(main())
