"""`_core.pyi` describes the compiled module exactly: every public name, class member and
`SchedulerOutput` field on one side exists on the other, and docs/scheduler.md's tables agree."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pagedllm
from pagedllm import _core

STUB = Path(pagedllm.__file__).with_name("_core.pyi")
# the scheduler's page: its signature, method table and SchedulerOutput field table
SCHEDULER_PAGE = Path(__file__).resolve().parents[2] / "docs" / "scheduler.md"


def stub_tree() -> ast.Module:
    return ast.parse(STUB.read_text())


def public(names) -> set[str]:
    return {n for n in names if not n.startswith("_")}


def stub_module_names() -> set[str]:
    names = set()
    for node in stub_tree().body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef)):
            names.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return public(names)


def stub_class_members(name: str) -> set[str]:
    cls = next(n for n in stub_tree().body if isinstance(n, ast.ClassDef) and n.name == name)
    members = set()
    for node in cls.body:
        if isinstance(node, ast.FunctionDef):
            members.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            members.add(node.target.id)
    return public(members)


def module_class_members(cls: type) -> set[str]:
    return public(n for n in vars(cls) if n != "__init__")


def test_stub_lists_exactly_the_module_names():
    module_names = public(n for n in vars(_core) if not n.startswith("__"))
    assert stub_module_names() == module_names


def test_stub_lists_exactly_each_class_members():
    classes = [
        obj
        for obj in vars(_core).values()
        if isinstance(obj, type)
        and obj.__module__ == "pagedllm._core"
        and not issubclass(obj, BaseException)
    ]
    assert classes
    for cls in classes:
        stub = stub_class_members(cls.__name__) - {"__init__"}
        assert stub == module_class_members(cls), cls.__name__


def test_scheduler_output_fields_are_declared_once_and_stubbed():
    fields = _core.SCHEDULER_OUTPUT_FIELDS
    assert len(fields) == len(set(fields))
    assert set(fields) == public(n for n in vars(_core.SchedulerOutput))
    assert set(fields) == stub_class_members("SchedulerOutput")


def test_readme_field_table_names_every_scheduler_output_field():
    table = SCHEDULER_PAGE.read_text().split("`SchedulerOutput` hands the runner", 1)[1]
    rows = [line for line in table.splitlines() if line.startswith("| `")]
    named = {name for row in rows for name in re.findall(r"`(\w+)`", row.split("|")[1])}
    assert named == set(_core.SCHEDULER_OUTPUT_FIELDS)


def keyword_parameters(func: ast.FunctionDef) -> dict[str, str]:
    """A function's keyword-only parameters: name -> its default's source ('' when required)."""
    args = func.args
    return {
        a.arg: "" if d is None else ast.unparse(d)
        for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True)
    }


def stub_init_parameters(name: str) -> dict[str, str]:
    cls = next(n for n in stub_tree().body if isinstance(n, ast.ClassDef) and n.name == name)
    init = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    return keyword_parameters(init)


def readme_signature(name: str) -> dict[str, str]:
    """The `Name(*, a, b=1, ...)` block docs/scheduler.md shows, read as a function's signature."""
    text = SCHEDULER_PAGE.read_text()
    start = text.index(f"\n{name}(*, ") + 1
    block = text[start : text.index(")\n", start) + 1]
    func = ast.parse("def " + block + ": pass").body[0]
    return keyword_parameters(func)


def test_readme_scheduler_signature_is_the_stubs():
    assert readme_signature("Scheduler") == stub_init_parameters("Scheduler")


def test_readme_method_table_names_every_scheduler_method():
    section = SCHEDULER_PAGE.read_text().split("# The scheduler without a model", 1)[1]
    table = section.split("| method | meaning |", 1)[1].split("\n\n", 1)[0]
    rows = table.splitlines()[2:]
    named = {m for row in rows for m in re.findall(r"`(\w+)\(", row.split("|")[1])}
    cls = next(n for n in stub_tree().body if isinstance(n, ast.ClassDef) and n.name == "Scheduler")
    methods = {
        n.name
        for n in cls.body
        if isinstance(n, ast.FunctionDef) and "property" not in map(ast.unparse, n.decorator_list)
    }
    assert named == public(methods) - {"__init__"}
