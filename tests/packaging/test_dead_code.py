"""No dead code at the package's top level: every public function and class a module of
`pagedllm` defines is named somewhere other than its own definition (another module, the same
module, a test, a bench, README or docs/). Checked on the source by identifier counts, so a name
that only a string mentions still counts as used (never a false alarm, sometimes a miss)."""

from __future__ import annotations

import ast
import re
from collections import Counter
from pathlib import Path

import pagedllm

PACKAGE_DIR = Path(pagedllm.__file__).parent
# the checkout these tests belong to (not the package's parent: CI installs the wheel into a venv)
REPO = Path(__file__).resolve().parents[2]
# where a use may live besides the package itself
USERS = ("tests", "benches", "docs", "README.md")
IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def identifier_counts(paths) -> Counter:
    counts: Counter = Counter()
    for path in paths:
        counts.update(IDENTIFIER.findall(path.read_text(errors="replace")))
    return counts


def public_definitions(path: Path) -> list[str]:
    """Names of the module-level public functions and classes in one file."""
    tree = ast.parse(path.read_text(), str(path))
    return [
        node.name
        for node in tree.body
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
        and not node.name.startswith("_")
    ]


def unused_definitions(package_files, user_files) -> list[str]:
    """`folder/file:name` of every public definition named nowhere but its own `def`/`class`
    line."""
    counts = identifier_counts([*package_files, *user_files])
    return [
        f"{path.parent.name}/{path.name}:{name}"
        for path in package_files
        for name in public_definitions(path)
        if counts[name] <= 1
    ]


def user_files() -> list[Path]:
    files = []
    for user in USERS:
        path = REPO / user
        if path.is_file():
            files.append(path)
        elif path.is_dir():
            files += [p for p in path.rglob("*") if p.suffix in (".py", ".md")]
    return files


def test_an_unused_function_is_reported(tmp_path):
    module = tmp_path / "pagedllm_mod.py"
    module.write_text("def used():\n    pass\n\n\ndef never_called():\n    return 0\n")
    user = tmp_path / "user.py"
    user.write_text("used()\n")
    assert [u.split(":")[1] for u in unused_definitions([module], [user])] == ["never_called"]


def test_every_public_definition_is_used():
    package_files = sorted(PACKAGE_DIR.rglob("*.py"))
    assert unused_definitions(package_files, user_files()) == []
