"""`pagedllm --help` and argument errors answer without importing torch (seconds of start-up
a user waits for before every usage message)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

# runs the command in a fresh interpreter, then reports its exit code and whether torch loaded
SCRIPT = """
import json, sys
from pagedllm.cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as exit:
    code = exit.code
print(json.dumps({"code": code, "torch": "torch" in sys.modules}))
"""


def run_without_torch(*args: str) -> dict:
    run = subprocess.run(
        [sys.executable, "-c", SCRIPT, *args], capture_output=True, text=True, timeout=120
    )
    return json.loads(run.stdout.splitlines()[-1])


@pytest.mark.parametrize(
    "command", [[], ["generate"], ["bench"], ["bench", "serve"], ["serve"], ["export-tiny"]]
)
def test_help_does_not_import_torch(command):
    assert run_without_torch(*command, "--help") == {"code": 0, "torch": False}


def test_argument_error_does_not_import_torch():
    assert run_without_torch("generate", "Hi", "--max-tokens", "0") == {"code": 2, "torch": False}
