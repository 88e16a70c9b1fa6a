"""MkDocs hooks (mkdocs.yml `hooks:`): benches/RESULTS.md, the measured figures, lives beside the
benchmarks and is published as the site's `results.md`; the pages link it by its path in the
repository (`../benches/RESULTS.md`, which works when browsing the repository too) and the
links are pointed at the published copy here."""

from pathlib import Path

from mkdocs.structure.files import File

RESULTS = Path(__file__).resolve().parents[1] / "benches" / "RESULTS.md"
REPO_LINK = "](../benches/RESULTS.md"


def on_files(files, config):
    files.append(File.generated(config, "results.md", abs_src_path=str(RESULTS)))
    return files


def on_page_markdown(markdown, page, config, files):
    return markdown.replace(REPO_LINK, "](results.md")
