"""Code versions: a hash of the code a rule runs, passed to the rule as a param.

Snakemake does not rerun jobs when imported library code changes, so each rule carries this hash,
derived from the rule's own script (scripts/<name>.py) alone: the script, the package modules it
imports (its entry modules), every module of the package those import, directly or through each
other, at the top of a module or lazily inside a function, plus the package's data files those
modules name (e.g. demo/target_tokenizer.py reads "chat_template.jinja"). Nothing lists a
stage's modules by hand: a new import counts where it is written. Python is hashed by its syntax tree without
docstrings, so a comment or docstring edit reruns nothing; other files by bytes.

What counts, read from the syntax tree (nothing is imported):
- `import pkg.x`, `from pkg import x`, `from pkg.x import y`, relative imports, wherever they are
  (inside functions and `if TYPE_CHECKING:` blocks too: counting too much only costs a rerun);
  a subpackage's `__init__.py` counts with its modules.
- The package's own `__init__.py` counts only where a module imports the package itself
  (`import pkg`, `from pkg import __version__`). Every import runs it, but it holds only the
  version string, which only what records it (hidden-state metadata) should rerun for.
- A data file counts where a module holds a string constant that is its path relative to the
  package or to the module's directory (not a name built at run time).
- A module counts where a module names it in a module-level constant `<NAME>_MODULE = "pkg.x"`:
  what runs a module by name (`python -m`, a vLLM connector or worker named by its module) names
  it that way. Not followed: other strings (a `-m pkg.cli` command would pull in every
  subcommand) and names built at run time.
- What a script calls that shapes no output (`SHAPES_NO_OUTPUT`: logging, GPU claims) is not one of
  its entry modules: changing how a job logs reruns nothing.
"""

from __future__ import annotations

import ast
import hashlib
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

PACKAGE_DIR = Path(__file__).resolve().parents[1]
SHAPES_NO_OUTPUT = ("common.logs", "common.gpus")


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


@dataclass(frozen=True)
class _PythonSource:
    """What code versions need of one module, read once per content."""

    fingerprint: bytes
    # (absolute module name, names imported from it): `import a.b` -> ("a.b", ()),
    # `from a import b, c` -> ("a", ("b", "c")); relative imports already made absolute.
    imports: tuple[tuple[str, tuple[str, ...]], ...]
    strings: frozenset[str]  # string constants outside docstrings: candidate data file names
    run_by_name: tuple[str, ...]  # modules named by `<NAME>_MODULE = "..."` constants


# (path, its name in the package, package, content) -> parsed module: a parse of the workflow
# reads each file once for all stages, and an edited file is parsed again (its content differs).
_PARSED: dict[tuple[str, str, str, bytes], _PythonSource] = {}


def _module_name(relative: PurePosixPath, package: str) -> tuple[str, str]:
    """(dotted name of a module file, package its relative imports start from)."""
    parts = [package, *relative.parts[:-1]]
    if relative.name == "__init__.py":
        return ".".join(parts), ".".join(parts)
    return ".".join([*parts, relative.stem]), ".".join(parts)


def _absolute(node: ast.ImportFrom, own_package: str) -> str | None:
    """The module a `from ... import` names, absolute; None past the top of the package."""
    if not node.level:
        return node.module
    parts = own_package.split(".")
    if node.level - 1 >= len(parts):
        return None
    base = ".".join(parts[: len(parts) - (node.level - 1)])
    return f"{base}.{node.module}" if node.module else base


def _modules_run_by_name(tree: ast.Module) -> tuple[str, ...]:
    names = []
    for node in tree.body:
        if (
            isinstance(node, ast.Assign)
            and len(node.targets) == 1
            and isinstance(node.targets[0], ast.Name)
            and node.targets[0].id.endswith("_MODULE")
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        ):
            names.append(node.value.value)
    return tuple(names)


def _parse(path: Path, relative: PurePosixPath, package: str) -> _PythonSource:
    content = path.read_bytes()
    key = (str(path), relative.as_posix(), package, content)
    if key not in _PARSED:
        tree = _strip_docstrings(ast.parse(content, filename=str(path)))
        _, own_package = _module_name(relative, package)
        imports: list[tuple[str, tuple[str, ...]]] = []
        strings: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                imports += [(alias.name, ()) for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                module = _absolute(node, own_package)
                if module:
                    imports.append((module, tuple(alias.name for alias in node.names)))
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                strings.add(node.value)
        fingerprint = ast.dump(tree, include_attributes=False).encode()
        _PARSED[key] = _PythonSource(
            fingerprint, tuple(imports), frozenset(strings), _modules_run_by_name(tree)
        )
    return _PARSED[key]


def source_fingerprint(path: Path, package_dir: Path | None = None) -> bytes:
    """What of a file matters for its behaviour: the AST for Python, the bytes otherwise."""
    if path.suffix != ".py":
        return path.read_bytes()
    package_dir = package_dir or path.parent
    relative = PurePosixPath(path.relative_to(package_dir).as_posix())
    return _parse(path, relative, package_dir.name).fingerprint


def code_version(modules: Iterable[str], package_dir: Path = PACKAGE_DIR) -> str:
    """Hash of the named files of the package (e.g. ["stages/probe.py"]), 16 hex chars."""
    digest = hashlib.sha256()
    for name in sorted(set(modules)):
        path = package_dir / name
        if not path.exists():
            raise FileNotFoundError(
                f"code_version: {path} does not exist (check the stage's module list)"
            )
        digest.update(name.encode() + b"\0" + source_fingerprint(path, package_dir) + b"\0")
    return digest.hexdigest()[:16]


class _Package:
    """The files of one package directory, to resolve module names and data file names."""

    def __init__(self, package_dir: Path):
        self.name = package_dir.name
        self.files: set[str] = set()
        for root, dirs, names in os.walk(package_dir):
            dirs[:] = [d for d in dirs if d != "__pycache__"]
            base = Path(root).relative_to(package_dir)
            self.files.update((base / n).as_posix() for n in names)

    def module_file(self, dotted: str) -> str | None:
        """The file of a module of this package, by dotted name; None when not one of its modules."""
        if dotted != self.name and not dotted.startswith(self.name + "."):
            return None
        relative = "/".join(dotted.split(".")[1:])
        if not relative:
            return "__init__.py"
        for candidate in (f"{relative}.py", f"{relative}/__init__.py"):
            if candidate in self.files:
                return candidate
        return None

    def imported_files(self, module: str, names: tuple[str, ...]) -> set[str]:
        """Files that `import module` / `from module import names` runs."""
        found = set()
        submodules = {n: self.module_file(f"{module}.{n}") for n in names if n != "*"}
        found.update(f for f in submodules.values() if f)
        # The module itself, except the package's own __init__ when only submodules are taken.
        if module != self.name or not names or None in submodules.values() or "*" in names:
            own = self.module_file(module)
            if own:
                found.add(own)
        parts = module.split(".")  # parent subpackages run first (the package's own: see above)
        for depth in range(2, len(parts)):
            parent = self.module_file(".".join(parts[:depth]))
            if parent:
                found.add(parent)
        return found

    def data_files(self, relative: str, strings: frozenset[str]) -> set[str]:
        """Non-Python files of the package named by the string constants of a module."""
        module_dir = PurePosixPath(relative).parent
        found = set()
        for text in strings:
            if not text or "\n" in text or text.endswith(".py") or text.startswith("/"):
                continue
            for base in {module_dir, PurePosixPath(".")}:
                candidate = os.path.normpath(base / text)
                if candidate in self.files:
                    found.add(candidate)
        return found


def module_closure(
    entries: Iterable[str], exclude: Iterable[str] = (), package_dir: Path = PACKAGE_DIR
) -> list[str]:
    """The package files a stage runs or reads, sorted, relative to the package directory.

    `entries`: module names relative to the package (e.g. ["generate", "prompts"]), what the
    stage's script calls. `exclude`: modules cut from the closure with everything reachable only
    through them (e.g. the embedded server where it is not the endpoint).
    """
    package = _Package(package_dir)

    def file_of(name: str) -> str:
        found = package.module_file(f"{package.name}.{name}")
        if found is None:
            raise FileNotFoundError(f"code_version: no module {name!r} in {package_dir}")
        return found

    excluded = {file_of(name) for name in exclude}
    pending = []
    for name in entries:
        file_of(name)  # an unknown entry is an error
        pending += package.imported_files(f"{package.name}.{name}", ())  # with its subpackages
    if excluded & {file_of(name) for name in entries}:
        raise ValueError(f"code_version: an entry module is also excluded: {sorted(excluded)}")
    closure: set[str] = set()
    while pending:
        relative = pending.pop()
        if relative in closure:
            continue  # import cycles end here
        closure.add(relative)
        parsed = _parse(package_dir / relative, PurePosixPath(relative), package.name)
        for module, names in parsed.imports:
            pending += package.imported_files(module, names) - excluded - closure
        closure |= package.data_files(relative, parsed.strings)
        for name in parsed.run_by_name:  # see the module docstring
            pending += package.imported_files(name, ()) - excluded - closure
    return sorted(closure)


def stage_code_version(
    entries: Iterable[str], exclude: Iterable[str] = (), package_dir: Path = PACKAGE_DIR
) -> str:
    """code_version of a stage's module closure (see module_closure)."""
    return code_version(module_closure(entries, exclude, package_dir), package_dir)


def script_entries(script: Path, package_dir: Path = PACKAGE_DIR) -> list[str]:
    """The package modules a script imports (relative to the package, e.g. "stages.probe"),
    anywhere in it, less what shapes no output (SHAPES_NO_OUTPUT)."""
    package = _Package(package_dir)
    parsed = _parse(script, PurePosixPath(script.name), "__script__")
    files = set()
    for module, names in parsed.imports:
        files |= package.imported_files(module, names)
    modules = {PurePosixPath(f).with_suffix("").as_posix().replace("/", ".") for f in files}
    modules = {m.removesuffix(".__init__") for m in modules if m != "__init__"}
    return sorted(modules - set(SHAPES_NO_OUTPUT))


def script_code_version(
    script: Path, exclude: Iterable[str] = (), package_dir: Path = PACKAGE_DIR
) -> str:
    """A rule's code version: its script's syntax tree and the module closure of the package
    modules the script imports (script_entries, module_closure)."""
    entries = script_entries(script, package_dir)
    digest = hashlib.sha256(source_fingerprint(script) + b"\0")
    digest.update(stage_code_version(entries, exclude, package_dir).encode())
    return digest.hexdigest()[:16]
