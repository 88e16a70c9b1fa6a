"""The house's size and safety limits, checked on the source: no Python module of the package
over `MAX_MODULE_LINES` lines (a longer one holds more than one idea: split it), and no `unsafe`
in the PyO3 bindings (they stay thin; unsafe code lives in `dist/` and `cpu/` behind safe
functions that state their invariants)."""

from __future__ import annotations

import re
from pathlib import Path

import pagedllm

PACKAGE_DIR = Path(pagedllm.__file__).parent
# the checkout these tests belong to (CI may install the package elsewhere)
REPO = Path(__file__).resolve().parents[2]
BINDINGS_DIR = REPO / "rust" / "src" / "bindings"
MAX_MODULE_LINES = 600
UNSAFE = re.compile(r"\bunsafe\b")


def long_modules(files, limit: int = MAX_MODULE_LINES) -> list[str]:
    """`path (N lines)` of every file over `limit` lines."""
    found = []
    for path in sorted(files):
        lines = len(path.read_text().splitlines())
        if lines > limit:
            found.append(f"{path.relative_to(PACKAGE_DIR.parent)} ({lines} lines)")
    return found


def unsafe_uses(files) -> list[str]:
    """`path:line` of every `unsafe` outside a `//` comment."""
    found = []
    for path in sorted(files):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if UNSAFE.search(line.split("//", 1)[0]):
                found.append(f"{path.relative_to(REPO)}:{number}")
    return found


def test_a_long_module_is_named_with_its_length(tmp_path, monkeypatch):
    monkeypatch.setattr(f"{__name__}.PACKAGE_DIR", tmp_path / "pagedllm")
    (tmp_path / "pagedllm").mkdir()
    (tmp_path / "pagedllm" / "big.py").write_text("x = 1\n" * 4)
    (tmp_path / "pagedllm" / "small.py").write_text("x = 1\n" * 3)
    files = (tmp_path / "pagedllm").glob("*.py")
    assert long_modules(files, limit=3) == ["pagedllm/big.py (4 lines)"]


def test_no_module_of_the_package_is_over_the_limit():
    assert long_modules(PACKAGE_DIR.rglob("*.py")) == []


def test_unsafe_code_is_found_and_comments_are_not(tmp_path, monkeypatch):
    monkeypatch.setattr(f"{__name__}.REPO", tmp_path)
    source = tmp_path / "lib.rs"
    source.write_text(
        "// SAFETY: an unsafe word in a comment\nfn f() {}\nlet x = unsafe { g() }; // ok\n"
    )
    assert unsafe_uses([source]) == ["lib.rs:3"]


def test_the_bindings_hold_no_unsafe_code():
    files = list(BINDINGS_DIR.rglob("*.rs"))
    assert files, f"no Rust sources under {BINDINGS_DIR}"
    assert unsafe_uses(files) == []
