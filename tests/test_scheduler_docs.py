"""The README's scheduler example runs as written."""
import re
from pathlib import Path

DOC = Path(__file__).resolve().parents[1] / "README.md"


def test_scheduler_doc_example_runs(capsys):
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    example = next(b for b in blocks if "update_from_output(" in b and "while" in b)
    exec(compile(example, str(DOC), "exec"), {"__name__": "__doc_example__"})
    assert "300 requests in" in capsys.readouterr().out
