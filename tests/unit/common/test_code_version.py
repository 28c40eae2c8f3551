"""Code versions change with behaviour, not with comments or docstrings, and cover every module of
the package a stage imports (and the data files those read), derived from its entry modules."""

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path, PurePosixPath

import pytest

from eaglenest.common.code_version import (
    code_version,
    module_closure,
    script_code_version,
    script_entries,
    stage_code_version,
)


def write(dir_: Path, name: str, text: str) -> None:
    (dir_ / name).write_text(text)


def test_comment_and_docstring_edits_keep_the_version(tmp_path):
    write(tmp_path, "stage.py", '"""Doc."""\n\ndef f(x):\n    return x + 1\n')
    before = code_version(["stage.py"], tmp_path)
    write(
        tmp_path,
        "stage.py",
        '"""Other doc."""\n# a comment\n\ndef f(x):\n    """Hi."""\n    return x + 1  # why\n',
    )
    assert code_version(["stage.py"], tmp_path) == before


def test_code_edits_change_the_version(tmp_path):
    write(tmp_path, "stage.py", "def f(x):\n    return x + 1\n")
    before = code_version(["stage.py"], tmp_path)
    write(tmp_path, "stage.py", "def f(x):\n    return x + 2\n")
    assert code_version(["stage.py"], tmp_path) != before


def test_non_python_files_hash_by_bytes_and_order_does_not_matter(tmp_path):
    write(tmp_path, "a.py", "x = 1\n")
    write(tmp_path, "t.jinja", "{{ x }}")
    v = code_version(["a.py", "t.jinja"], tmp_path)
    assert v == code_version(["t.jinja", "a.py"], tmp_path)
    write(tmp_path, "t.jinja", "{{ y }}")
    assert code_version(["a.py", "t.jinja"], tmp_path) != v


def test_missing_module_is_an_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.py"):
        code_version(["nope.py"], tmp_path)


# ---- Closures: a stage names its entry modules, the version covers what they import -----------


def package(tmp_path: Path, files: dict[str, str]) -> Path:
    """A package `pkg` in tmp_path with the given files (relative paths), for module_closure."""
    root = tmp_path / "pkg"
    for name, text in {"__init__.py": "", **files}.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_lazy_imports_inside_functions_count(tmp_path):
    pkg = package(
        tmp_path,
        {
            "entry.py": "def run():\n    from pkg.helper import f\n    return f()\n",
            "helper.py": "def f():\n    import pkg.deep\n    return 1\n",
            "deep.py": "X = 1\n",
            "unused.py": "Y = 2\n",
        },
    )
    assert module_closure(["entry"], package_dir=pkg) == ["deep.py", "entry.py", "helper.py"]


def test_every_import_form_counts(tmp_path):
    pkg = package(
        tmp_path,
        {
            "entry.py": (
                "import pkg.a\nimport pkg.a as alias\nfrom pkg import b\nfrom pkg.c import name\n"
                "from . import d\nfrom .e import other\nfrom .sub import f\n"
            ),
            **{f"{m}.py": "" for m in "abcde"},
            "sub/__init__.py": "from ..g import h\n",
            "sub/f.py": "from .. import i\nfrom ...outside import j\n",
            "g.py": "",
            "i.py": "",
        },
    )
    assert module_closure(["entry"], package_dir=pkg) == [
        "a.py",
        "b.py",
        "c.py",
        "d.py",
        "e.py",
        "entry.py",
        "g.py",
        "i.py",
        "sub/__init__.py",
        "sub/f.py",
    ]


def test_the_package_init_counts_only_where_the_package_itself_is_imported(tmp_path):
    pkg = package(tmp_path, {"a.py": "from pkg import b\n", "b.py": "", "c.py": "import pkg\n"})
    pkg.joinpath("d.py").write_text("from pkg import __version__\n")
    assert "__init__.py" not in module_closure(["a"], package_dir=pkg)
    assert "__init__.py" in module_closure(["c"], package_dir=pkg)
    assert "__init__.py" in module_closure(["d"], package_dir=pkg)


def test_an_import_cycle_ends(tmp_path):
    pkg = package(
        tmp_path,
        {"a.py": "from pkg import b\n", "b.py": "def f():\n    from .a import g\n", "c.py": ""},
    )
    assert module_closure(["a"], package_dir=pkg) == ["a.py", "b.py"]
    assert module_closure(["b"], package_dir=pkg) == ["a.py", "b.py"]


def test_an_edit_to_a_module_imported_through_another_changes_the_version(tmp_path):
    pkg = package(
        tmp_path,
        {
            "entry.py": "from pkg.middle import f\n",
            "middle.py": "def f():\n    from pkg import leaf\n    return leaf.g()\n",
            "leaf.py": '"""Leaf."""\n\ndef g():\n    return 1\n',
        },
    )
    before = stage_code_version(["entry"], package_dir=pkg)
    leaf = pkg / "leaf.py"
    leaf.write_text('"""Leaf, edited."""\n# why\n\ndef g():\n    """Doc."""\n    return 1  # one\n')
    assert stage_code_version(["entry"], package_dir=pkg) == before
    leaf.write_text('"""Leaf."""\n\ndef g():\n    return 2\n')
    assert stage_code_version(["entry"], package_dir=pkg) != before


def test_data_files_a_module_names_count(tmp_path):
    pkg = package(
        tmp_path,
        {
            "entry.py": '"""Mentions other.jinja only here."""\nTEMPLATE = "template.jinja"\n',
            "template.jinja": "{{ x }}",
            "other.jinja": "{{ y }}",
            "sub/__init__.py": 'NEAR = "near.json"\nFAR = "far/data.txt"\n',
            "sub/near.json": "{}",
            "far/data.txt": "x",
        },
    )
    assert module_closure(["entry", "sub"], package_dir=pkg) == [
        "entry.py",
        "far/data.txt",
        "sub/__init__.py",
        "sub/near.json",
        "template.jinja",
    ]
    before = stage_code_version(["entry"], package_dir=pkg)
    (pkg / "template.jinja").write_text("{{ x }}\n")
    assert stage_code_version(["entry"], package_dir=pkg) != before


def test_an_excluded_module_cuts_what_only_it_reaches(tmp_path):
    pkg = package(
        tmp_path,
        {
            "entry.py": "import pkg.shared\ndef serve():\n    from pkg.server import run\n",
            "server.py": "from pkg import engine, shared\n",
            "engine.py": "",
            "shared.py": "",
        },
    )
    assert module_closure(["entry"], package_dir=pkg) == [
        "engine.py",
        "entry.py",
        "server.py",
        "shared.py",
    ]
    assert module_closure(["entry"], ["server"], package_dir=pkg) == ["entry.py", "shared.py"]
    with pytest.raises(ValueError, match="excluded"):
        module_closure(["server"], ["server"], package_dir=pkg)


def test_an_unknown_entry_module_is_an_error(tmp_path):
    pkg = package(tmp_path, {"a.py": ""})
    with pytest.raises(FileNotFoundError, match="'nope'"):
        module_closure(["nope"], package_dir=pkg)


# ---- Completeness on the real package and workflow -------------------------------------------

REPO = Path(__file__).resolve().parents[3]
PACKAGE = REPO / "src" / "eaglenest"
SCRIPTS = sorted((REPO / "scripts").glob("*.py"))


def stage_entries() -> dict[str, list[str]]:
    """Per script (its stem), the entry modules its code version starts from."""
    return {script.stem: script_entries(script) for script in SCRIPTS}


def test_every_rule_with_a_script_hashes_its_own_script():
    """A rule's code version is derived from the script it runs: code_version("<its stem>")."""
    rules = 0
    for smk in sorted((REPO / "rules").glob("*.smk")):
        for block in re.split(r"^rule ", smk.read_text(), flags=re.MULTILINE)[1:]:
            name = block.split(":", 1)[0]
            script = re.search(r'script:\s*"\.\./scripts/(\w+)\.py"', block)
            if not script:
                continue
            rules += 1
            version = re.search(r'code_version=code_version\("(\w+)"\)', block)
            assert version, f"rule {name} ({smk.name}) has no code_version param"
            assert version.group(1) == script.group(1), (
                f"rule {name} ({smk.name}) runs scripts/{script.group(1)}.py but hashes "
                f"scripts/{version.group(1)}.py"
            )
    assert rules >= 10


def test_a_script_entries_are_its_package_imports_less_logging(tmp_path):
    script = tmp_path / "s.py"
    script.write_text(
        "import torch\nfrom eaglenest.common.logs import log_to\nimport eaglenest.formats.raw\n"
        "from eaglenest.stages.probe import probe_run\nif x:\n    from eaglenest.demo import target\n"
    )
    entries = script_entries(script)
    assert {"demo.target", "formats.raw", "stages.probe"} <= set(entries)  # lazy ones too
    assert "common.logs" not in entries


def test_a_script_edit_and_an_import_change_the_version(tmp_path):
    pkg = package(tmp_path, {"a.py": "X = 1\n", "b.py": "Y = 2\n"})
    script = tmp_path / "s.py"
    script.write_text("from pkg.a import X\nprint(X)\n")
    before = script_code_version(script, package_dir=pkg)
    script.write_text("from pkg.a import X\n# why\nprint(X)\n")
    assert script_code_version(script, package_dir=pkg) == before
    script.write_text("from pkg.a import X\nprint(X + 1)\n")
    assert script_code_version(script, package_dir=pkg) != before
    script.write_text("from pkg.a import X\nfrom pkg.b import Y\nprint(X + 1)\n")
    after_import = script_code_version(script, package_dir=pkg)
    (pkg / "b.py").write_text("Y = 3\n")
    assert script_code_version(script, package_dir=pkg) != after_import


def test_a_module_run_by_name_counts(tmp_path):
    pkg = package(
        tmp_path,
        {
            "entry.py": 'WORKER_MODULE = "pkg.worker"\nCOMMAND = ["-m", "pkg.cli"]\n',
            "worker.py": "import pkg.deep\n",
            "deep.py": "",
            "cli.py": "import pkg.everything\n",
            "everything.py": "",
        },
    )
    assert module_closure(["entry"], package_dir=pkg) == ["deep.py", "entry.py", "worker.py"]


def test_the_demo_server_module_is_the_one_serve_runs():
    from eaglenest.cli import SUBCOMMANDS
    from eaglenest.demo.server_process import SERVER_MODULE

    assert SUBCOMMANDS["serve"][0] == SERVER_MODULE


# Run in a fresh interpreter: imports every module of the package once (so the third-party
# libraries are loaded once), then per stage a forked child forgets the package, imports the
# stage's entry modules and, until nothing new appears, every package module that a loaded
# module imports on an indented line (inside a function), found by a regular expression.
# A module that needs the serving engine to import (vLLM's side, which runs in vLLM's own
# environment) is read instead: it counts as loaded, and the package modules it imports are.
# Prints {stage: [files of the loaded package modules]} as JSON.
OBSERVE_IMPORTS = r"""
import ast, importlib, importlib.util, json, os, pkgutil, re, sys
import eaglenest

entries = json.loads(sys.argv[1])
ENGINE_SIDE = {}

def import_or_read(name):
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as error:
        if not (error.name or "").startswith("vllm"):
            raise
        origin = importlib.util.find_spec(name).origin
        ENGINE_SIDE[name] = origin
        for node in ast.walk(ast.parse(open(origin).read())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("eaglenest"):
                import_or_read(node.module)

for info in pkgutil.walk_packages(eaglenest.__path__, "eaglenest."):
    import_or_read(info.name)
LAZY = re.compile(
    r"^[ \t]+from[ \t]+([.\w]+)[ \t]+import[ \t]+(\([^)]*\)|[^\n#]*)"
    r"|^[ \t]+import[ \t]+([^\n#]*)",
    re.M,
)

def lazy_imports(module):
    text = open(module.__file__).read()
    yield from re.findall(r"^\w+_MODULE = [\"'](eaglenest\.[\w.]+)[\"']", text, re.M)  # run by name
    for match in LAZY.finditer(text):
        if match.group(1):
            base = importlib.util.resolve_name(match.group(1), module.__package__)
            names = match.group(2).strip("()").replace("\n", " ").split(",")
            yield base
            yield from (base + "." + n.split(" as ")[0].strip() for n in names if n.strip())
        else:
            yield from (n.split(" as ")[0].strip() for n in match.group(3).split(","))

def observe(stage_entries):
    for name in [m for m in sys.modules if m == "eaglenest" or m.startswith("eaglenest.")]:
        del sys.modules[name]
    ENGINE_SIDE.clear()
    for entry in stage_entries:
        import_or_read("eaglenest." + entry)
    seen = set()
    while True:
        new = [m for m in sys.modules if m.startswith("eaglenest") and m not in seen]
        if not new:
            break
        for name in new:
            seen.add(name)
            for candidate in lazy_imports(sys.modules[name]):
                if candidate == "eaglenest" or candidate.startswith("eaglenest."):
                    try:
                        import_or_read(candidate)
                    except ModuleNotFoundError as error:
                        if not (error.name or "").startswith("eaglenest"):
                            raise
    root = os.path.dirname(eaglenest.__file__)
    files = [sys.modules[m].__file__ for m in seen] + list(ENGINE_SIDE.values())
    return sorted({os.path.relpath(f, root) for f in files})

result = {}
for stage, names in entries.items():
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        with os.fdopen(write, "w") as out:
            json.dump(observe(names), out)
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as stream:
        result[stage] = json.loads(stream.read() or "null")
    _, status = os.waitpid(pid, 0)
    assert status == 0 and result[stage] is not None, f"stage {stage}: child failed"
print(json.dumps(result))
"""


@pytest.fixture(scope="module")
def observed_imports() -> dict[str, set[str]]:
    """Per stage, the package files its entry modules import when run (see OBSERVE_IMPORTS)."""
    result = subprocess.run(
        [sys.executable, "-c", OBSERVE_IMPORTS, json.dumps(stage_entries())],
        env={**os.environ, "PYTHONPATH": str(REPO / "src")},
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return {stage: set(files) for stage, files in json.loads(result.stdout).items()}


@pytest.mark.parametrize("stage", [script.stem for script in SCRIPTS])
def test_a_stage_hashes_every_module_it_imports(observed_imports, stage):
    closure = set(module_closure(stage_entries()[stage], package_dir=PACKAGE))
    # Every import runs the package's __init__; it counts only where imported by name.
    observed = observed_imports[stage] - {"__init__.py"}
    assert observed <= closure, f"imported but not hashed: {sorted(observed - closure)}"
    python = {f for f in closure if f.endswith(".py")} - {"__init__.py"}
    assert python <= observed, f"hashed but never imported: {sorted(python - observed)}"
    # Non-Python package files: hashed wherever a hashed module's source names them.
    for data in [f for f in _package_files() if not f.endswith(".py")]:
        readers = [m for m in python if PurePosixPath(data).name in (PACKAGE / m).read_text()]
        if readers:
            assert data in closure, f"{data} (named in {readers}) is not hashed"


def _package_files() -> list[str]:
    return [
        p.relative_to(PACKAGE).as_posix()
        for p in PACKAGE.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    ]


def test_the_package_init_holds_only_constants():
    """The package's __init__ runs with every import but is hashed only where imported by name:
    that holds while it only sets constants (a version string)."""
    tree = ast.parse((PACKAGE / "__init__.py").read_text())
    for node in tree.body[1:] if ast.get_docstring(tree) else tree.body:
        assert isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant), (
            "src/eaglenest/__init__.py now does more than set constants: make module_closure "
            "count it for every stage"
        )


def test_the_demo_server_is_cut_where_excluded():
    server = {"demo/server_process.py", "demo/server.py", "demo/batcher.py", "demo/faults.py"}
    for entries in (["stages.generate.generate"], ["stages.probe"]):
        assert server <= set(module_closure(entries))
        assert not server & set(module_closure(entries, ["demo.server_process"]))


def test_the_demo_target_hashes_its_chat_template():
    assert "demo/chat_template.jinja" in module_closure(["demo.target"])


# ---- The disk cache: what one process parsed, the next reads --------------------------------

VERSION_IN_A_PROCESS = """
import ast, sys
from pathlib import Path
from eaglenest.common.code_version import script_code_version
if sys.argv[3] == "without-parsing":
    def refuse(*args, **kwargs):
        raise AssertionError("parsed although cached")
    ast.parse = refuse
print(script_code_version(Path(sys.argv[1]), package_dir=Path(sys.argv[2])))
"""


def test_a_version_from_the_disk_cache_equals_one_computed_without_it(tmp_path):
    """As separate `snakemake` commands: the first parses and keeps what it found, the next
    parses nothing and gives the same version; an edit is parsed again (the cache keys are the
    files' bytes), and a cache file that cannot be read is computed past and written anew."""
    pkg = package(
        tmp_path,
        {"a.py": 'import pkg.b\nTEMPLATE = "t.jinja"\n', "b.py": "Y = 2\n", "t.jinja": "{{ x }}"},
    )
    script = tmp_path / "s.py"
    script.write_text("from pkg.a import TEMPLATE\nprint(TEMPLATE)\n")
    cache = tmp_path / "cache"

    def version(cache_dir: str, mode: str = "parse") -> str:
        env = {**os.environ, "EAGLENEST_CACHE_DIR": cache_dir}
        done = subprocess.run([sys.executable, "-c", VERSION_IN_A_PROCESS, str(script), str(pkg),
                               mode], env=env, capture_output=True, text=True, check=False)  # fmt: skip
        assert done.returncode == 0, done.stderr[-2000:]
        return done.stdout.strip()

    cold = version("off")
    assert version(str(cache)) == cold
    [kept] = cache.glob("code-versions-*.json")
    assert len(json.loads(kept.read_text())["modules"]) == 3  # s.py, a.py, b.py
    assert version(str(cache), "without-parsing") == cold

    for name, text in (("b.py", "Y = 3\n"), ("t.jinja", "{{ y }}")):
        (pkg / name).write_text(text)
        edited = version(str(cache))
        assert edited != cold and edited == version("off")
        cold = edited
    (pkg / "b.py").write_text("# why\nY = 3\n")  # a comment: parsed again, the same version
    assert version(str(cache)) == cold

    kept.write_text('{"modules": [')
    assert version(str(cache)) == cold
    assert version(str(cache), "without-parsing") == cold


def test_the_disk_cache_keeps_its_newest_entries_within_its_bound(tmp_path, monkeypatch):
    """Every edit adds entries: past the bound the oldest half goes, and what stays still gives
    the versions."""
    import eaglenest.common.code_version as versions

    monkeypatch.setenv("EAGLENEST_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(versions, "CACHE_ENTRIES", 6)
    pkg = package(tmp_path, {"a.py": "X = 0\n"})
    script = tmp_path / "s.py"
    script.write_text("from pkg.a import X\n")
    for value in range(9):  # each edit: a new a.py entry and a new version, 10 of each
        (pkg / "a.py").write_text(f"X = {value}\n")
        last = script_code_version(script, package_dir=pkg)
    [kept] = (tmp_path / "cache").glob("code-versions-*.json")
    held = json.loads(kept.read_text())
    assert len(held["modules"]) <= 6 and len(held["versions"]) <= 6
    assert script_code_version(script, package_dir=pkg) == last


def cached_versions(tmp_path) -> tuple[Path, Path, object]:
    """A small package and script, their version computed without a cache, and a function
    giving the version in a new process with the cache at tmp_path/cache."""
    pkg = package(
        tmp_path,
        {"a.py": 'import pkg.b\nTEMPLATE = "t.jinja"\n', "b.py": "Y = 2\n", "t.jinja": "{{ x }}"},
    )
    script = tmp_path / "s.py"
    script.write_text("from pkg.a import TEMPLATE\nprint(TEMPLATE)\n")

    def version(cache_dir: str) -> str:
        env = {**os.environ, "EAGLENEST_CACHE_DIR": cache_dir}
        done = subprocess.run([sys.executable, "-c", VERSION_IN_A_PROCESS, str(script), str(pkg),
                               "parse"], env=env, capture_output=True, text=True, check=False)  # fmt: skip
        assert done.returncode == 0, done.stderr[-2000:]
        return done.stdout.strip()

    return pkg, script, version


@pytest.mark.parametrize(
    "wrong",
    [{"imports": 5}, {"imports": [["pkg.b"]], "strings": [], "run_by_name": []}, [], "x", None,
     {"imports": [[1, []]], "strings": [], "run_by_name": []}],
)  # fmt: skip
def test_a_wrong_shaped_cache_entry_is_computed_past(tmp_path, wrong):
    """Entries of another shape failed every command (a TypeError in every snakemake parse)
    until the file was deleted."""
    _, _, version = cached_versions(tmp_path)
    cold = version("off")
    assert version(str(tmp_path / "cache")) == cold
    [kept] = (tmp_path / "cache").glob("code-versions-*.json")
    held = json.loads(kept.read_text())
    kept.write_text(json.dumps({
        "modules": {key: wrong for key in held["modules"]},
        "versions": {key: wrong for key in held["versions"]},
    }))  # fmt: skip
    assert version(str(tmp_path / "cache")) == cold
    assert version(str(tmp_path / "cache")) == cold  # and written anew


def test_a_cache_entry_that_does_not_match_the_files_is_computed_past(tmp_path):
    """A poisoned cache changed every rule's code version: entries that no longer match their
    check (bound to the files' bytes), or name what the file does not hold, are parsed again."""
    _, _, version = cached_versions(tmp_path)
    cold = version("off")
    version(str(tmp_path / "cache"))
    [kept] = (tmp_path / "cache").glob("code-versions-*.json")
    held = json.loads(kept.read_text())
    poisoned = {
        # An import dropped (b.py leaves the closure) and a data file added that is not there.
        "modules": {
            key: {**entry, "imports": [], "strings": [*entry["strings"], "other.jinja"]}
            for key, entry in held["modules"].items()
        },
        # A version of the right form, its check left as it was.
        "versions": {
            key: ["0123456789abcdef", check] for key, (_, check) in held["versions"].items()
        },
    }
    kept.write_text(json.dumps(poisoned))
    assert version(str(tmp_path / "cache")) == cold


@pytest.mark.parametrize("word", ["off", "OFF", "Off", "0", "false", "FALSE", "none", "None",
                                  "no", " off "])  # fmt: skip
def test_cache_off_words_in_any_case_mean_no_cache_and_no_folder(tmp_path, monkeypatch, word):
    """`EAGLENEST_CACHE_DIR=0|false|none|OFF` created a folder of that name in the working
    directory; only the exact `off` meant no cache."""
    from eaglenest.common.code_version import CACHE_OFF, cache_dir

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("EAGLENEST_CACHE_DIR", word)
    assert cache_dir() is None and word.strip().lower() in CACHE_OFF
    _, _, version = cached_versions(tmp_path / "work")
    version(word)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["work"]
    monkeypatch.setenv("EAGLENEST_CACHE_DIR", "offline")  # a folder, not a word of CACHE_OFF
    assert cache_dir() == Path("offline")
