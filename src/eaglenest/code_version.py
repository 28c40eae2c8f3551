"""Code versions: a hash of the library source a stage runs, passed to its rule as a param.

Snakemake does not rerun jobs when imported library code changes, so each rule carries this hash.
Python modules are hashed by their syntax tree without docstrings, so a comment or docstring edit
reruns nothing; other files (templates) are hashed by bytes.
"""

from __future__ import annotations

import ast
import hashlib
from collections.abc import Iterable
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent


def _strip_docstrings(tree: ast.AST) -> ast.AST:
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (
            isinstance(body, list)
            and body
            and isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)
        ):
            node.body = body[1:] or [ast.Pass()]
    return tree


def source_fingerprint(path: Path) -> bytes:
    """What of a file matters for its behaviour: the AST for Python, the bytes otherwise."""
    if path.suffix == ".py":
        tree = _strip_docstrings(ast.parse(path.read_text(), filename=str(path)))
        return ast.dump(tree, include_attributes=False).encode()
    return path.read_bytes()


def code_version(modules: Iterable[str], package_dir: Path = PACKAGE_DIR) -> str:
    """Hash of the named files of the package (e.g. ["probe.py", "reasoning.py"]), 16 hex chars."""
    digest = hashlib.sha256()
    for name in sorted(set(modules)):
        path = package_dir / name
        if not path.exists():
            raise FileNotFoundError(
                f"code_version: {path} does not exist (check the stage's module list)"
            )
        digest.update(name.encode() + b"\0" + source_fingerprint(path) + b"\0")
    return digest.hexdigest()[:16]
