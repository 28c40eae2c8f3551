"""The documentation holds together: every relative link of README.md, docs/, the RESULTS files,
experiments/README.md and config/README.md names a file (and heading) that exists, every file path
and `eaglenest.x.y` name they give exists in the tree, so does every name of the README's layout,
every rule of rules/*.smk has its docs page leading with its name, and the README stays the short
entry point (the detail goes to docs/)."""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
PAGES = [
    REPO / "README.md",
    *sorted(DOCS.glob("*.md")),
    REPO / "bench" / "RESULTS.md",
    REPO / "experiments" / "RESULTS.md",
    REPO / "experiments" / "README.md",
    REPO / "config" / "README.md",
]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
README_MAX_LINES = 220
FENCED = re.compile(r"```.*?```", flags=re.DOTALL)
INLINE_CODE = re.compile(r"`([^`]+)`")
# A path from the repository root, a path inside src/eaglenest/ (`stages/generate/generate.py`) and a bare
# file name (`vllm_engine/connector.py`); a path inside results/ is preceded by `/` and is no match.
REPO_PATH = re.compile(
    r"(?<![\w./-])(?:src|scripts|rules|tests|bench|experiments|config)/[\w./*-]*(?<![.:])"
)
PACKAGE_PATH = re.compile(
    r"(?<![\w./-])(?:common|formats|target_model|client|settings|stages|demo|drafter|vllm_engine)/[\w./-]*\.py\b"
)
FILE_NAME = re.compile(r"(?<![\w./-])\w+\.(?:py|smk)\b(?![\w/])")
MODULE_NAME = re.compile(r"(?<![\w/.-])eaglenest(?!\.ya?ml\b)(?:\.\w+)+")
# Files of other projects the pages name (vLLM's sources), not of this tree.
OTHER_PROJECTS_FILES = {"deepseek_eagle3.py", "mla.py"}


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


def tracked_files() -> list[str]:
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    )
    return listed.stdout.split()


def inline_code(page: Path) -> list[str]:
    """The page's `inline code` spans (fenced blocks hold commands and examples, not names)."""
    return INLINE_CODE.findall(FENCED.sub("", page.read_text()))


def missing_paths(page: Path, files: list[str]) -> list[str]:
    names = {Path(f).name for f in files}
    missing = []
    for span in inline_code(page):
        for path in REPO_PATH.findall(span):
            if not any(REPO.glob(path.rstrip("/"))):
                missing.append(path)
        for path in PACKAGE_PATH.findall(span):
            if not (REPO / "src" / "eaglenest" / path).exists():
                missing.append(path)
        for name in FILE_NAME.findall(span):
            if name not in names and name not in OTHER_PROJECTS_FILES:
                missing.append(name)
    return missing


def defined_names(body: list[ast.stmt]) -> set[str]:
    names = set()
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return names


def module_name_exists(dotted: str) -> bool:
    """`eaglenest.a.b` names a module or package; `eaglenest.a.b.name` (or `.Class.member`) a
    name defined in module a/b.py."""
    parts = dotted.split(".")[1:]
    source = REPO / "src" / "eaglenest"
    for depth in range(len(parts), -1, -1):
        base = source.joinpath(*parts[:depth])
        module = base / "__init__.py" if base.is_dir() else base.with_suffix(".py")
        if depth == 0 or module.exists():
            break
    rest = parts[depth:]
    if not rest:
        return True
    if depth == 0 or len(rest) > 2:
        return False
    body = ast.parse(module.read_text()).body
    if rest[0] not in defined_names(body):
        return False
    if len(rest) == 1:
        return True
    classes = [n for n in body if isinstance(n, ast.ClassDef) and n.name == rest[0]]
    return any(rest[1] in defined_names(c.body) for c in classes)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_path_and_module_name_exists_in_the_tree(page):
    missing = missing_paths(page, tracked_files())
    missing += [m for m in MODULE_NAME.findall(page.read_text()) if not module_name_exists(m)]
    assert not missing, f"{page.relative_to(REPO)} names what the tree lacks: {missing}"


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


def layout_entries(readme: str) -> list[str]:
    """The paths the README's Layout block names: one per line that starts a name (two spaces of
    indent a level down), continuation lines skipped."""
    block = readme.split("## Layout\n", 1)[1].split("\n## ", 1)[0]
    parents: list[str] = []
    paths = []
    for line in block.splitlines():
        entry = re.match(r"    ( *)(\S+)(?:  |$)", line)
        if not entry or len(entry.group(1)) >= 16:
            continue
        level = len(entry.group(1)) // 2
        parents[level:] = [entry.group(2)]
        paths.append("".join(parents))
    return paths


def test_every_name_of_the_readme_layout_exists():
    paths = layout_entries((REPO / "README.md").read_text())
    assert "tests/support/" in paths and "src/eaglenest/drafter/" in paths, paths
    missing = [path for path in paths if not (REPO / path).exists()]
    assert not missing, f"README.md's layout names what the tree lacks: {missing}"
