"""Code versions: a hash of the code a rule runs, passed to the rule as a param.

Snakemake does not rerun jobs when imported library code changes, so each rule carries this hash,
derived from the rule's own script (scripts/<name>.py) alone: the script, the package modules it
imports (its entry modules), every module of the package those import, directly or through each
other, at the top of a module or lazily inside a function, plus the package's data files those
modules name (e.g. the chat template demo/target_tokenizer.py reads). Nothing lists a
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

Every `snakemake` command computes these when it reads the workflow (so does every job of a
cluster run), and parsing the package's modules took 0.75 s of a 2.1 s dry run here. What a parse
gives is kept on disk (`CACHE_ENV`, else $XDG_CACHE_HOME/eaglenest or ~/.cache/eaglenest), keyed
by the bytes of the files, never by their times: a module's imports by its content, a script's
version by the content of every file of its closure. A changed file is parsed again; the values
are the ones computed without the cache, and a cache that cannot be read or written is skipped.
An entry is used only where it has the shape this module writes and agrees with the files: a
module's recorded names must be in its bytes, a version must carry the check that binds it to its
key (the files' bytes); anything else is computed again, never failing a command. The check
catches stray edits and corruption, not a forger (who could edit the code itself).
`EAGLENEST_CACHE_DIR` set to one of CACHE_OFF's words, in any case, means no cache; any other
value is a folder.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

PACKAGE_DIR = Path(__file__).resolve().parents[1]
SHAPES_NO_OUTPUT = ("common.logs", "common.gpus")
CACHE_ENV = "EAGLENEST_CACHE_DIR"
CACHE_ENTRIES = 2_000  # past this, the oldest half goes (edits add entries; ~1 KB a module)
# What EAGLENEST_CACHE_DIR says to mean "no cache", in any case: never taken as a folder's name.
CACHE_OFF = ("off", "0", "false", "no", "none")


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
    """What a module's closure needs of it, read once per content."""

    # (absolute module name, names imported from it): `import a.b` -> ("a.b", ()),
    # `from a import b, c` -> ("a", ("b", "c")); relative imports already made absolute.
    imports: tuple[tuple[str, tuple[str, ...]], ...]
    strings: frozenset[str]  # one-line string constants outside docstrings: data file names?
    run_by_name: tuple[str, ...]  # modules named by `<NAME>_MODULE = "..."` constants


class _DiskCache:
    """Parsed modules and scripts' versions of earlier processes, in one JSON file per version of
    this module's own code (a change to how versions are computed starts a new file)."""

    def __init__(self, directory: Path | None):
        own = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16]
        self.path = directory / f"code-versions-{own}.json" if directory else None
        self.modules: dict[str, dict] = {}
        self.versions: dict[str, list[str]] = {}  # key -> [version, its check]
        self.added = False
        self._merge()

    def _merge(self) -> None:
        """What the file holds (other processes' entries too) joined to this process's."""
        try:
            if self.path is None or not self.path.exists():
                return
            held = json.loads(self.path.read_text())
            self.modules = {**held["modules"], **self.modules}
            self.versions = {**held["versions"], **self.versions}
        except (OSError, ValueError, KeyError, TypeError):
            pass  # unreadable or half of another version: computed again, written anew

    def save(self) -> None:
        if not self.added or self.path is None:
            return
        self._merge()
        for entries in (self.modules, self.versions):
            if len(entries) > CACHE_ENTRIES:
                for key in list(entries)[: len(entries) // 2]:
                    del entries[key]
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            part = self.path.with_name(f".{self.path.name}.{os.getpid()}")
            part.write_text(json.dumps({"modules": self.modules, "versions": self.versions}))
            os.replace(part, self.path)  # whole or not at all, for readers at the same time
        except OSError:
            pass
        self.added = False


def cache_dir() -> Path | None:
    """Where parses are kept: $EAGLENEST_CACHE_DIR (a CACHE_OFF word: nowhere), else the
    user's cache."""
    chosen = os.environ.get(CACHE_ENV, "").strip()
    if chosen.lower() in CACHE_OFF:
        return None
    if chosen:
        return Path(chosen)
    try:
        base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    except RuntimeError:  # no home directory (a bare job environment): no cache
        return None
    return Path(base) / "eaglenest"


_CACHES: dict[Path | None, _DiskCache] = {}


def _disk_cache() -> _DiskCache:
    directory = cache_dir()
    if directory not in _CACHES:
        _CACHES[directory] = _DiskCache(directory)
    return _CACHES[directory]


# Within a process: content key -> parsed module, and content -> fingerprint. A parse of the
# workflow reads each file once for all stages, and an edited file is parsed again.
_PARSED: dict[str, _PythonSource] = {}
_FINGERPRINTS: dict[bytes, bytes] = {}


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


def _tree(content: bytes, path: Path) -> ast.Module:
    return _strip_docstrings(ast.parse(content, filename=str(path)))  # type: ignore[return-value]


def _content_key(content: bytes, *names: str) -> str:
    return hashlib.sha256("\0".join(names).encode() + b"\0" + content).hexdigest()


def _read_module(content: bytes, path: Path, relative: PurePosixPath, package: str) -> dict:
    """A module's imports, strings and modules run by name, as the disk cache keeps them."""
    tree = _tree(content, path)
    _FINGERPRINTS[content] = ast.dump(tree, include_attributes=False).encode()
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
    return {
        "imports": imports,
        "strings": sorted(t for t in strings if "\n" not in t),  # only these name files
        "run_by_name": list(_modules_run_by_name(tree)),
    }


def _parse(path: Path, relative: PurePosixPath, package: str) -> _PythonSource:
    content = path.read_bytes()
    # The name in the package counts: relative imports resolve from it.
    key = _content_key(content, package, relative.as_posix())
    if key not in _PARSED:
        disk = _disk_cache()
        if not _module_entry_holds(disk.modules.get(key), key, content):
            # As the file will hold it (lists, not tuples), so the check reads back the same.
            entry = json.loads(json.dumps(_read_module(content, path, relative, package)))
            disk.modules[key] = {**entry, "check": _entry_check(key, entry)}
            disk.added = True
        held = disk.modules[key]
        _PARSED[key] = _PythonSource(
            tuple((module, tuple(names)) for module, names in held["imports"]),
            frozenset(held["strings"]),
            tuple(held["run_by_name"]),
        )
    return _PARSED[key]


def _entry_check(key: str, value: object) -> str:
    """What binds a cached value to its key, the hash of the files' bytes."""
    text = json.dumps(value, sort_keys=True)
    return hashlib.sha256(f"{key}\0{text}".encode()).hexdigest()[:16]


def _module_entry_holds(held: object, key: str, content: bytes) -> bool:
    """Whether a cached parse has _read_module's shape, carries its check, and its names are in
    the file's bytes (an import's names, a module imported whole by its dotted name, a plain
    word as written): a wrong-shaped entry failed every command, a wrong one changed what the
    closure holds."""
    if not isinstance(held, dict):
        return False
    entry = {name: value for name, value in held.items() if name != "check"}
    if held.get("check") != _entry_check(key, entry):
        return False
    imports, strings, run = held.get("imports"), held.get("strings"), held.get("run_by_name")
    if not all(isinstance(v, list) for v in (imports, strings, run)):
        return False
    names: list[object] = [*run]
    for item in imports:
        if not (isinstance(item, list) and len(item) == 2 and isinstance(item[1], list)):
            return False
        names += item[1] or [item[0]]  # `from .a import b` names b; `import a.b`, a.b
    if not all(isinstance(name, str) for name in [*names, *strings]):
        return False
    text = content.decode("utf-8", "replace")
    # What names a file or module is one plain word; a sentence may be split over lines and a
    # string with escapes is not in the bytes as it reads, so only plain words are held to them.
    plain = [t for t in strings if t.isprintable() and not set(t) & set(" \\'\"")]
    return all(name in text for name in [*names, *plain])


def _cached_version(held: object, key: str) -> str | None:
    """A cached version: [16 hex digits, its check]; anything else is none."""
    if not (isinstance(held, list) and len(held) == 2 and all(isinstance(v, str) for v in held)):
        return None
    version, check = held
    hex_digits = len(version) == 16 and all(c in "0123456789abcdef" for c in version)
    return version if hex_digits and check == _entry_check(key, version) else None


def source_fingerprint(path: Path) -> bytes:
    """What of a file matters for its behaviour: the AST for Python, the bytes otherwise."""
    content = path.read_bytes()
    if path.suffix != ".py":
        return content
    if content not in _FINGERPRINTS:
        tree = _tree(content, path)
        _FINGERPRINTS[content] = ast.dump(tree, include_attributes=False).encode()
    return _FINGERPRINTS[content]


def code_version(modules: Iterable[str], package_dir: Path = PACKAGE_DIR) -> str:
    """Hash of the named files of the package (e.g. ["stages/probe.py"]), 16 hex chars."""
    digest = hashlib.sha256()
    for name in sorted(set(modules)):
        path = package_dir / name
        if not path.exists():
            raise FileNotFoundError(
                f"code_version: {path} does not exist (check the stage's module list)"
            )
        digest.update(name.encode() + b"\0" + source_fingerprint(path) + b"\0")
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
        module_dir = os.path.dirname(relative)  # strings, not paths: a module holds hundreds
        found = set()
        for text in strings:
            if not text or "\n" in text or text.endswith(".py") or text.startswith("/"):
                continue
            found |= {os.path.normpath(os.path.join(module_dir, text)), os.path.normpath(text)}
        return found & self.files


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
    closure = module_closure(script_entries(script, package_dir), exclude, package_dir)
    # The version follows from the files' contents alone: the same contents, the same version.
    key = hashlib.sha256(script.read_bytes())
    for name in closure:
        key.update(
            name.encode() + b"\0" + hashlib.sha256((package_dir / name).read_bytes()).digest()
        )
    disk = _disk_cache()
    found = _cached_version(disk.versions.get(key.hexdigest()), key.hexdigest())
    if found is None:
        digest = hashlib.sha256(source_fingerprint(script) + b"\0")
        digest.update(code_version(closure, package_dir).encode())
        found = digest.hexdigest()[:16]
        disk.versions[key.hexdigest()] = [found, _entry_check(key.hexdigest(), found)]
        disk.added = True
    disk.save()
    return found
