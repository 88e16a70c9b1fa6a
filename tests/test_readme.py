"""README.md's two commands exist, and CI runs the test command word for word."""
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
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
