"""One definition of each name in the library (src/eaglenest): a top-level function, class or
UPPER_CASE constant is defined in one module and imported everywhere else. Two definitions under
one name drift apart (the capture key was read twice, and a blank key was sent by one reader and
refused by the other); two meanings under one name mislead whoever reads an import.

Checked on the source with ast, each module's top level (`if TYPE_CHECKING:` blocks aside, names
starting with `_` aside), against the short allow-list below, each entry with its reason."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

LIBRARY = Path(__file__).resolve().parents[2] / "src" / "eaglenest"

# Defined in more than one module on purpose.
ALLOWED = {
    # The CLI's subcommands: cli.py dispatches to each module's `add_arguments(parser)` and
    # `run(args)`, one interface by design.
    "add_arguments": "the CLI's subcommand interface (cli.py dispatches to each module's)",
    "run": "the CLI's subcommand interface (cli.py dispatches to each module's)",
    # Modules run as programs (`python -m`, torchrun, vLLM's interpreter) each have a main.
    "main": "the entry point of each module run as a program (cli.py, `python -m` modules)",
    # The vLLM room runs under vLLM's interpreter and imports nothing of ours outside it
    # (tests/house/test_layout.py): its stdlib-only copy of the think tag stays there.
    "THINK_END": "vllm_engine/conversations.py's copy: the vLLM room imports nothing outside it",
}


def top_level_nodes(tree: ast.Module):
    """The module's top-level statements, those under `if TYPE_CHECKING:` aside (imports and
    protocols for annotations only, which never run)."""
    for node in tree.body:
        if isinstance(node, ast.If) and ast.unparse(node.test) in (
            "TYPE_CHECKING",
            "typing.TYPE_CHECKING",
        ):
            continue
        yield node


def defined_names(node: ast.stmt) -> list[str]:
    """The functions, classes and UPPER_CASE constants a top-level statement defines."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return [node.name]
    if isinstance(node, ast.Assign):
        targets = node.targets
    elif isinstance(node, ast.AnnAssign):
        targets = [node.target]
    else:
        return []
    return [t.id for t in targets if isinstance(t, ast.Name) and t.id.isupper()]


def definitions(modules: list[Path], root: Path) -> dict[str, list[str]]:
    """Each public name -> the modules (relative to `root`) that define it at their top level."""
    found: dict[str, list[str]] = defaultdict(list)
    for path in modules:
        for node in top_level_nodes(ast.parse(path.read_text(), filename=str(path))):
            for name in defined_names(node):
                if not name.startswith("_"):
                    found[name].append(str(path.relative_to(root)))
    return found


def duplicated(found: dict[str, list[str]], allowed: set[str]) -> list[str]:
    return sorted(
        f"{name}: {', '.join(sorted(modules))}"
        for name, modules in found.items()
        if len(modules) > 1 and name not in allowed
    )


def test_each_name_is_defined_in_one_library_module():
    found = definitions(sorted(LIBRARY.rglob("*.py")), LIBRARY)
    twice = duplicated(found, set(ALLOWED))
    assert not twice, (
        "defined in more than one module (import it from one home, or rename where the "
        "meanings differ):\n" + "\n".join(twice)
    )


def test_the_allow_lists_are_short_and_still_needed():
    """Each allowed name is still defined more than once: an entry whose copies are gone goes."""
    assert len(ALLOWED) <= 8
    found = definitions(sorted(LIBRARY.rglob("*.py")), LIBRARY)
    stale = sorted(n for n in ALLOWED if len(found.get(n, [])) < 2)
    assert not stale, f"allowed but defined once or never: {stale}"


def test_the_check_sees_functions_classes_and_constants_but_not_type_checking_blocks(tmp_path):
    (tmp_path / "a.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "LIMIT_S = 1\n"
        "def read(): ...\n"
        "class Shape: ...\n"
        "if TYPE_CHECKING:\n"
        "    class Hint: ...\n"
        "_private = 1\n"
    )
    (tmp_path / "b.py").write_text(
        "LIMIT_S: float = 2\n"
        "def read(): ...\n"
        "Shape = dict\n"
        "class Hint: ...\n"
        "def _private(): ...\n"
        "lower = 3\n"
    )
    found = definitions(sorted(tmp_path.glob("*.py")), tmp_path)
    assert duplicated(found, set()) == ["LIMIT_S: a.py, b.py", "read: a.py, b.py"]
    assert duplicated(found, {"read"}) == ["LIMIT_S: a.py, b.py"]
