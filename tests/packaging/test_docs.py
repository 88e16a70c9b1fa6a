"""docs/ is true and navigable: every page's examples run (doc_examples.py says how), every page
is in mkdocs.yml's nav, and `mkdocs build --strict` (CI's step, .ci/run) fails on a page left
out of the nav or a broken link."""

from __future__ import annotations

import ast
import dataclasses
import os
import re
import shutil
import subprocess
import sys

import pytest
import yaml
from doc_examples import ROOT, code_blocks, needs_server, run_python, run_shell

PAGES = sorted((ROOT / "docs").glob("*.md"))
BLOCKS = [block for page in PAGES for block in code_blocks(page)]
PYTHON = [b for b in BLOCKS if b.lang == "python"]
SHELL = [b for b in BLOCKS if b.lang in ("bash", "sh", "console")]


def test_docs_blocks_say_their_language():
    assert PYTHON and SHELL
    assert [str(b) for b in BLOCKS if b.lang not in ("python", "bash", "text")] == []


@pytest.mark.parametrize("block", PYTHON, ids=str)
def test_docs_python_example_runs(block, examples_dir, monkeypatch, request):
    monkeypatch.chdir(examples_dir)
    run_python(block, request.getfixturevalue("server_url") if needs_server(block) else None)


@pytest.mark.parametrize("block", SHELL, ids=str)
def test_docs_shell_example_runs_or_parses(block, examples_dir, tmp_path, monkeypatch):
    run_shell(block, examples_dir, tmp_path, monkeypatch.chdir)


def test_offline_page_gives_llm_keywords_with_the_engine_args_defaults():
    from pagedllm import EngineArgs

    text = (ROOT / "docs" / "offline.md").read_text()
    signature = " ".join(text.split("- `LLM(", 1)[1].split(", ...)`", 1)[0].split())
    func = ast.parse(f"def LLM({signature}): pass").body[0]
    args = func.args
    shown = {a.arg: ast.literal_eval(d) for a, d in zip(args.kwonlyargs, args.kw_defaults)}
    defaults = {f.name: f.default for f in dataclasses.fields(EngineArgs)}
    assert shown and {name: defaults.get(name, "missing") for name in shown} == shown


def test_development_layout_names_every_package_and_test_folder():
    layout = next(
        b.code for b in code_blocks(ROOT / "docs" / "development.md") if "rust/src/" in b.code
    )
    named = set(re.findall(r"([a-z_]+)/", layout))
    packages = {p.parent.name for p in (ROOT / "python" / "pagedllm").glob("*/__init__.py")}
    crate = {p.name for p in (ROOT / "rust" / "src").iterdir() if p.is_dir()}
    tests = {p.name for p in (ROOT / "tests").iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert sorted((packages | crate | tests) - named) == []


def _nav_pages(nav) -> list[str]:
    if isinstance(nav, str):
        return [nav]
    if isinstance(nav, dict):
        return [p for v in nav.values() for p in _nav_pages(v)]
    return [p for item in nav for p in _nav_pages(item)]


def _mkdocs_config() -> dict:
    # the config's `!!python/name:` tags, if any, are not needed to read the nav
    return yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=yaml.BaseLoader)


def test_every_docs_page_is_in_the_nav_once():
    nav = _nav_pages(_mkdocs_config()["nav"])
    assert len(nav) == len(set(nav))
    assert {p.name for p in PAGES} == set(nav) - {"results.md"}


def _mkdocs_build(root, site) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=root,
        capture_output=True,
        text=True,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        timeout=120,
    )


def _copy_of_the_site_sources(to):
    shutil.copytree(ROOT / "docs", to / "docs", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "mkdocs.yml", to)
    (to / "benches").mkdir()
    shutil.copy(ROOT / "benches" / "RESULTS.md", to / "benches")


def test_mkdocs_strict_build_fails_on_a_page_left_out_of_the_nav(tmp_path):
    _copy_of_the_site_sources(tmp_path)
    (tmp_path / "docs" / "orphan.md").write_text("# Not in the nav\n")
    done = _mkdocs_build(tmp_path, tmp_path / "site")
    assert done.returncode != 0 and "orphan.md" in done.stderr


def test_mkdocs_strict_build_fails_on_a_broken_link(tmp_path):
    _copy_of_the_site_sources(tmp_path)
    with open(tmp_path / "docs" / "cpu.md", "a") as page:
        page.write("\nSee [the missing page](missing.md).\n")
    done = _mkdocs_build(tmp_path, tmp_path / "site")
    assert done.returncode != 0 and "missing.md" in done.stderr
