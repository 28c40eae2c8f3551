"""Layout properties of the library (src/eaglenest), checked on its source with ast: how long
its modules and functions may be, that its rooms stand on floors (a room imports only the rooms
below it), that stages stay isolated from one another, what the demo code may reach, what the code
that runs inside vLLM may import, and which levels of the package may import which."""

import ast
import sys
from pathlib import Path

import pytest

LIBRARY = Path(__file__).resolve().parents[2] / "src" / "eaglenest"
MAX_FUNCTION_LINES = 80
MAX_MODULE_LINES = 500


def library_modules() -> list[Path]:
    return sorted(LIBRARY.rglob("*.py"))


def test_no_module_is_longer_than_500_lines():
    """A module holds one concept: past 500 lines, split it where the code divides."""
    too_long = {
        str(path.relative_to(LIBRARY)): n
        for path in library_modules()
        if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert not too_long, f"modules over {MAX_MODULE_LINES} lines: {too_long}"


def test_no_formatter_escape_hatch_in_the_library():
    """`# fmt: skip` is how a function gets squeezed under its cap: the library has none."""
    skipped = [
        f"{path.relative_to(LIBRARY)}:{i}"
        for path in library_modules()
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if "# fmt: skip" in line or "# fmt: off" in line
    ]
    assert not skipped, skipped


def test_no_function_is_longer_than_80_lines():
    """A function reads without scrolling: at most 80 lines, signature and docstring included."""
    too_long = []
    for path in library_modules():
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    where = f"{path.relative_to(LIBRARY)}:{node.lineno}"
                    too_long.append(f"{where} {node.name}: {lines} lines")
    assert not too_long, f"functions over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(too_long)


# ---- imports: read from the source with ast, lazy imports inside functions included ----------

PACKAGE = LIBRARY
# 7: a stage module over its parts (evaluate.py over simulated.py) over the capture reader,
# its signal, the shard layout and io.
MAX_IMPORT_LEVELS = 7
# The only modules outside demo/ that may import it: the endpoints start the embedded server, and
# the prompt source `demo` draws the demo's held-out tasks.
DEMO_REACH = {"eaglenest.client.endpoints", "eaglenest.stages.prompts.sources"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def runtime_nodes(tree: ast.AST):
    """Every node of the tree but those under `if TYPE_CHECKING:` (imports for annotations only,
    which never run)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test) in (
            "TYPE_CHECKING",
            "typing.TYPE_CHECKING",
        ):
            yield from (n for child in node.orelse for n in [child, *runtime_nodes(child)])
            continue
        yield node
        yield from runtime_nodes(node)


def library_imports() -> dict[str, set[str]]:
    """Every library module -> the library modules it imports when it runs (anywhere in its
    source, lazy imports included; `if TYPE_CHECKING:` blocks aside)."""
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        imported = set()
        for node in runtime_nodes(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("eaglenest"):
                for alias in node.names:
                    sub = f"{node.module}.{alias.name}"
                    imported.add(sub if sub in modules else node.module)
            elif isinstance(node, ast.Import):
                imported |= {a.name for a in node.names if a.name.split(".")[0] == "eaglenest"}
        graph[name] = {m for m in imported if m in modules and m != name}
    return graph


def stage_of(module: str) -> str | None:
    """`eaglenest.stages.<stage>[...]` -> <stage>; None outside stages/."""
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[1] == "stages" else None


def test_no_stage_imports_another_stage():
    crossings = [
        f"{module} imports {target}"
        for module, targets in library_imports().items()
        for target in targets
        if stage_of(module) and stage_of(target) and stage_of(module) != stage_of(target)
    ]
    assert not crossings, (
        "stages share through formats/, target_model/, common/ or client/:\n" + "\n".join(crossings)
    )


def test_only_the_endpoints_and_the_demo_prompt_source_reach_into_demo():
    reaching = {
        module
        for module, targets in library_imports().items()
        if not module.startswith("eaglenest.demo")
        and any(t.startswith("eaglenest.demo") for t in targets)
    }
    assert reaching == DEMO_REACH


# ---- rooms and floors: src/eaglenest/<room>/ (or <room>.py), the ground floor first -----------

FLOORS = [
    "settings",
    "vllm_engine",
    "common",
    "target_model",
    "demo",
    "formats",
    "client",
    "capture",
    "drafter",
    "run",
    "stages",
    "cli",
]
# Imports allowed to run back up a floor: none.
BACK_UP: set[tuple[str, str]] = set()


def room_of(module: str) -> str | None:
    """`eaglenest.<room>[...]` -> <room>; None for the package itself."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def test_every_room_has_a_floor_and_the_readme_names_it():
    rooms = {room_of(m) for m in library_imports()} - {None}
    assert rooms == set(FLOORS), f"rooms without a floor: {rooms - set(FLOORS)}"
    readme = (LIBRARY.parents[1] / "README.md").read_text()
    layout = readme[readme.index("## Layout") :]
    unnamed = [r for r in FLOORS if f"  {r}/ " not in layout and f"  {r}.py " not in layout]
    assert not unnamed, f"README's layout does not name {unnamed}"


def test_rooms_import_only_the_rooms_below_them():
    """The house has floors: a room imports its own modules and the rooms under it, so a
    newcomer reads it from the ground up and no change below reaches back into a room above."""
    floor = {room: i for i, room in enumerate(FLOORS)}
    upward = sorted(
        f"{module} imports {target}"
        for module, targets in library_imports().items()
        for target in targets
        if room_of(module)
        and room_of(target)
        and floor[room_of(target)] > floor[room_of(module)]
        and (room_of(module), room_of(target)) not in BACK_UP
    )
    assert not upward, "imports running back up a floor:\n" + "\n".join(upward)


# ---- the vLLM room (eaglenest.vllm_engine): what runs under vLLM's interpreter ----------------

ROOM = "eaglenest.vllm_engine"
# Third-party packages vLLM's environment has: vLLM and what it depends on.
ENGINE_PACKAGES = {"vllm", "torch", "numpy", "safetensors", "huggingface_hub"}


def in_room(module: str) -> bool:
    return module == ROOM or module.startswith(ROOM + ".")


def modules_run_by_name() -> set[str]:
    """The library modules named by `<NAME>_MODULE = "eaglenest.x"` constants: what a stage
    starts under another interpreter (`python -m`) or vLLM loads by name."""
    named = set()
    for path in library_modules():
        for node in ast.parse(path.read_text()).body:
            if (
                isinstance(node, ast.Assign)
                and any(isinstance(t, ast.Name) and t.id.endswith("_MODULE") for t in node.targets)
                and isinstance(node.value, ast.Constant)
                and str(node.value.value).startswith("eaglenest.")
            ):
                named.add(node.value.value)
    return named


def third_party_imports(module: str) -> set[str]:
    """Top-level names of what a module imports when it runs, outside eaglenest."""
    path = PACKAGE.parent.joinpath(*module.split("."))
    path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
    names = set()
    for node in runtime_nodes(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and not node.level:
            names.add((node.module or "").split(".")[0])
        elif isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
    return names - {"eaglenest", "__future__"}


def test_the_vllm_room_imports_nothing_of_ours_outside_it():
    graph = library_imports()
    room = {m for m in graph if in_room(m)}
    assert {f"{ROOM}.capture", f"{ROOM}.decode", f"{ROOM}.serve", f"{ROOM}.connector"} <= room
    outside = [
        f"{module} imports {target}"
        for module in sorted(room)
        for target in sorted(graph[module])
        if not in_room(target)
    ]
    assert not outside, "the vLLM room reaches out (see its docstring):\n" + "\n".join(outside)


def test_what_runs_under_vllms_interpreter_stays_in_the_room_on_vllms_packages():
    """Every module started under vLLM's interpreter (or loaded by vLLM) by name lives in the
    room, and so does everything of ours it imports, through any number of modules; none of
    them imports a package vLLM's environment lacks (polars, pandera, transformers of ours...)."""
    graph = library_imports()
    # Run by name under our own interpreter: the demo server, and training's torchrun entry.
    ours = ("eaglenest.demo.", "eaglenest.stages.train.")
    entries = {m for m in modules_run_by_name() if not m.startswith(ours)}
    assert {f"{ROOM}.capture", f"{ROOM}.decode", f"{ROOM}.serve", f"{ROOM}.connector"} <= entries
    reached, pending = set(), list(entries)
    while pending:
        module = pending.pop()
        if module not in reached:
            reached.add(module)
            pending += graph[module]
    assert all(in_room(m) for m in reached), sorted(m for m in reached if not in_room(m))
    stdlib = set(sys.stdlib_module_names)
    foreign = {
        module: sorted(third_party_imports(module) - stdlib - ENGINE_PACKAGES)
        for module in sorted(reached)
    }
    assert not any(foreign.values()), {m: f for m, f in foreign.items() if f}


def import_levels(graph: dict[str, set[str]]) -> dict[str, int]:
    """Levels of each module (1 = imports no library module); raises on a cycle, naming it."""
    levels: dict[str, int] = {}

    def level(module: str, path: tuple[str, ...]) -> int:
        if module in path:
            raise AssertionError("import cycle: " + " -> ".join((*path, module)))
        if module not in levels:
            levels[module] = 1 + max((level(t, (*path, module)) for t in graph[module]), default=0)
        return levels[module]

    for module in graph:
        level(module, ())
    return levels


def test_the_import_graph_is_shallow_and_has_no_cycles():
    levels = import_levels(library_imports())
    deepest = max(levels, key=levels.get)
    assert levels[deepest] <= MAX_IMPORT_LEVELS, f"{deepest}: {levels[deepest]} levels"


def test_the_level_count_sees_cycles_and_depth():
    with pytest.raises(AssertionError, match="a -> b -> a"):
        import_levels({"a": {"b"}, "b": {"a"}})
    assert import_levels({"a": {"b"}, "b": {"c"}, "c": set()})["a"] == 3
