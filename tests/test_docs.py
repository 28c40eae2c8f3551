"""The documentation holds together: every relative link of README.md, docs/ and the RESULTS
files names a file (and heading) that exists, every rule of rules/*.smk has its docs page leading
with its name, and the README stays the short entry point (the detail goes to docs/)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
PAGES = [
    REPO / "README.md",
    *sorted(DOCS.glob("*.md")),
    REPO / "bench" / "RESULTS.md",
    REPO / "experiments" / "RESULTS.md",
]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
README_MAX_LINES = 220


def heading_anchors(path: Path) -> set[str]:
    """GitHub's anchors of a Markdown file's headings: lower case, punctuation dropped, spaces
    as hyphens."""
    anchors = set()
    for line in path.read_text().splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            anchors.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return anchors


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_names_a_file_and_heading_that_exist(page):
    for target in LINK.findall(page.read_text()):
        if "://" in target:
            continue
        file_part, _, anchor = target.partition("#")
        linked = (page.parent / file_part).resolve() if file_part else page
        assert linked.exists(), f"{page.relative_to(REPO)}: no file for link {target}"
        if anchor and linked.suffix == ".md":
            assert anchor in heading_anchors(linked), f"{page.relative_to(REPO)}: no #{anchor}"


def test_every_rule_has_a_docs_page_that_leads_with_it():
    rules = {
        name
        for smk in (REPO / "rules").glob("*.smk")
        for name in re.findall(r"^rule (\w+):", smk.read_text(), flags=re.MULTILINE)
    }
    index = (DOCS / "README.md").read_text()
    leads = "\n".join("\n".join(p.read_text().splitlines()[:12]) for p in DOCS.glob("*.md"))
    for rule in sorted(rules):
        assert f"`{rule}`" in index, f"docs/README.md does not list rule {rule}"
        assert f"`{rule}`" in leads, f"no docs page leads with rule {rule}"


def test_the_readme_stays_short_and_names_the_commands():
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= README_MAX_LINES, "move the detail to docs/"
    for command in ("make run", "make test", "make check", "eaglenest serve-capture"):
        assert command in readme, command
    for example in ("config/examples/qwen3-8b.yaml", "config/examples/kimi-k2.5.yaml"):
        assert example in readme and (REPO / example).exists(), example
