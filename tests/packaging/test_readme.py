"""README.md is true: its two commands exist, CI runs the test command word for word, and its
scheduler example runs as written."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
MAIN_JOB = 'pip install . && pagedllm generate "Hello, my name is"'
TEST_COMMAND = 'pip install ".[test]" && cargo test --release && python -m pytest -q tests'


def test_readme_gives_the_main_job_command():
    assert MAIN_JOB in README


def test_readme_gives_the_test_command():
    assert TEST_COMMAND in README


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert TEST_COMMAND in ci


def test_readme_scheduler_example_runs_as_written(capsys):
    blocks = re.findall(r"```python\n(.*?)```", README, flags=re.S)
    example = next(b for b in blocks if "update_from_output(" in b and "while" in b)
    exec(compile(example, str(ROOT / "README.md"), "exec"), {"__name__": "__doc_example__"})
    assert "300 requests in" in capsys.readouterr().out
