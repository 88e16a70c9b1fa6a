"""What README.md's and docs/'s examples are, and how the tests run them.

- A ```python block is executed as written (as `__main__`, in a folder holding the checkpoints
  `pagedllm export-tiny` makes, `./tiny` with its adapter and `./tiny-draft`); one that talks to
  `http://127.0.0.1:8000` gets a live server of the built-in model on a free port instead.
- In a ```bash block every `pagedllm` command is checked by the command's own argument parser
  (so a renamed or removed flag fails), and the quick ones are run too: `generate` (unless its
  `--model` is a placeholder, `/path/to/...`), `run-batch` and `export-tiny`. `serve`, `router`
  and `bench` run until stopped or for minutes, so they are parsed only, as are other programs'
  lines (`pip`, `ray`, `vllm`): the repository paths those name must exist. A here-document
  (`cat > FILE <<'EOF'` ... `EOF`) writes its file into the examples' folder first.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PLACEHOLDER = ("/path/to/", "path/to/")
RUN = ("generate", "run-batch", "export-tiny")
HEREDOC = re.compile(r"^cat > (\S+) <<'?(\w+)'?\n(.*?)^\2$\n?", flags=re.S | re.M)
REPO_PATH = re.compile(r"^(?:benches|tests|python|rust|kernels|docs)/[\w./-]+$")


@dataclass(frozen=True)
class Block:
    page: str  # path relative to the repository
    line: int  # the fence's line
    lang: str
    code: str

    def __str__(self) -> str:
        return f"{self.page}:{self.line}"


def code_blocks(path: Path) -> list[Block]:
    text = path.read_text()
    return [
        Block(
            str(path.relative_to(ROOT)),
            text.count("\n", 0, m.start()) + 1,
            m[1],
            m[2],
        )
        for m in re.finditer(r"^```(\w*)[^\n]*\n(.*?)^```", text, flags=re.S | re.M)
    ]


def heredocs(code: str) -> dict[str, str]:
    """The files a shell block writes with `cat > FILE <<'EOF'` ... `EOF`: name -> text."""
    return {m[1]: m[3] for m in HEREDOC.finditer(code)}


def shell_commands(code: str) -> list[list[str]]:
    """The commands of a shell block: here-documents left out, continuations joined, `&&`
    lists split, comments and environment assignments (`OUT=dir cmd`) dropped."""
    commands = []
    for line in HEREDOC.sub("", code).replace("\\\n", " ").splitlines():
        for part in line.split("&&"):
            try:
                words = shlex.split(part, comments=True)
            except ValueError:  # prose in another program's line: `<A's address>`
                words = part.split("#", 1)[0].split()
                assert words[:1] != ["pagedllm"], f"unbalanced quotes: {part}"
            while words and re.match(r"^\w+=", words[0]):
                words = words[1:]
            if words:
                commands.append(words)
    return commands


def is_run(argv: list[str]) -> bool:
    """Whether the test runs `pagedllm argv` (else it only parses it): see the module doc."""
    if argv[0] not in RUN:
        return False
    model = argv[argv.index("--model") + 1] if "--model" in argv else ""
    return not model.startswith(PLACEHOLDER)


def missing_repo_paths(argv: list[str]) -> list[str]:
    return [w for w in argv if REPO_PATH.match(w) and not (ROOT / w).exists()]


def run_shell(block: Block, examples_dir: Path, fresh_dir: Path, chdir) -> None:
    """Checks or runs every command of a shell block (see the module doc); `chdir`: a
    monkeypatch's, so the test's working folder comes back."""
    from pagedllm.cli import build_parser, main

    for name, text in heredocs(block.code).items():
        (examples_dir / name).write_text(text)
    for argv in shell_commands(block.code):
        assert missing_repo_paths(argv) == [], f"{block}: {argv}"
        if argv[0] != "pagedllm":
            continue
        build_parser().parse_args(argv[1:])  # exits (fails the test) on an unknown flag
        if is_run(argv[1:]):
            # export-tiny writes new folders: a fresh one; the others read the examples'
            chdir(fresh_dir if argv[1] == "export-tiny" else examples_dir)
            assert main(argv[1:]) == 0, f"{block}: {shlex.join(argv)}"


def run_python(block: Block, server_url: str | None = None) -> None:
    code = block.code
    if server_url is not None:
        code = code.replace("http://127.0.0.1:8000", server_url)
    exec(compile(code, str(block), "exec"), {"__name__": "__main__"})


def needs_server(block: Block) -> bool:
    return "127.0.0.1:8000" in block.code
