"""Each rule tracks exactly what its code reads. Every field of the settings a rule passes as a
tracked param (`settings_json(Cls)`, not inside `untracked(...)`) must be read by the code that
rule runs: its script and the library modules the script imports, transitively (the files its
code version hashes, eaglenest.common.code_version). A field tracked but never read would rerun
the rule for nothing: e.g. the target head once tracked all of HiddenSettings and re-read the
checkpoint when `hidden.max_batch_tokens` changed. (The other direction, a field read but not
tracked, fails where it is read: see eaglenest.settings.NotTracked.)

What counts as a read, from the syntax tree: `x.field` where `x` holds that settings class:
a parameter or a dataclass field annotated with it, a name assigned from `Cls.from_json(...)`,
`Cls.from_config(...)` or `Cls(...)`, or a settings field of that type (`settings.target.path`);
`asdict(x)`, `x.to_json()`, `x.as_kwargs()` and `getattr(x, name)` read every field."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import pkgutil
import re
import typing
from collections import defaultdict
from pathlib import Path

import pytest
import yaml

import eaglenest.settings
from eaglenest.common.code_version import PACKAGE_DIR, module_closure, script_entries
from eaglenest.common.config import validate_config
from eaglenest.settings import NotTracked, Settings

REPO = Path(__file__).resolve().parents[2]
# The default demo and the variant that runs vLLM for the hidden states and the evaluation, so
# that the settings only those use (hidden.engine, evaluate.vllm) are checked too.
CONFIGS = [("config/config.yaml",), ("config/config.yaml", "config/tests/deepseek-v3.yaml")]
# Calls that read every field of a settings object (overrides: DrafterSettings, the drafter's
# config over the target's).
WHOLE_READS = {"asdict", "to_json", "as_kwargs", "getattr", "vars", "overrides"}


def settings_classes() -> dict[str, type[Settings]]:
    for info in pkgutil.iter_modules(eaglenest.settings.__path__, "eaglenest.settings."):
        importlib.import_module(info.name)
    found, todo = {}, list(Settings.__subclasses__())
    while todo:
        cls = todo.pop()
        found[cls.__name__] = cls
        todo += cls.__subclasses__()
    return found


def tracked_settings() -> dict[str, tuple[str, list[str]]]:
    """rule -> (its script's stem, the settings classes its params track)."""
    rules = {}
    for smk in sorted((REPO / "rules").glob("*.smk")):
        for block in re.split(r"^rule ", smk.read_text(), flags=re.MULTILINE)[1:]:
            script = re.search(r'script:\s*"\.\./scripts/(\w+)\.py"', block)
            if script:
                lines = [line for line in block.splitlines() if "untracked(" not in line]
                classes = re.findall(r"settings_json\((\w+)\)", "\n".join(lines))
                rules[block.split(":", 1)[0]] = (script.group(1), classes)
    return rules


def rule_files(script: str) -> list[Path]:
    path = REPO / "scripts" / f"{script}.py"
    closure = module_closure(script_entries(path))
    return [path, *(PACKAGE_DIR / f for f in closure if f.endswith(".py"))]


def terminal(node: ast.AST) -> str | None:
    """The last name of `a.b.c` (c), or of `a` (a)."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def annotation_classes(annotation: ast.AST | None, classes: dict) -> set[str]:
    if annotation is None:
        return set()
    text = annotation.value if isinstance(annotation, ast.Constant) else ast.unparse(annotation)
    return {name for name in re.findall(r"\w+", str(text)) if name in classes}


def bound_names(trees: list[ast.AST], classes: dict) -> dict[str, set[str]]:
    """Settings class -> names that hold it somewhere in these modules."""
    bound: dict[str, set[str]] = defaultdict(set)
    for cls in classes.values():  # settings fields of a settings type: settings.target
        for name, hint in typing.get_type_hints(cls).items():
            for option in typing.get_args(hint) or (hint,):
                if isinstance(option, type) and issubclass(option, Settings):
                    bound[option.__name__].add(name)
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.arg):
                for cls in annotation_classes(node.annotation, classes):
                    bound[cls].add(node.arg)
            elif isinstance(node, ast.AnnAssign) and terminal(node.target):
                for cls in annotation_classes(node.annotation, classes):
                    bound[cls].add(terminal(node.target))
            elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
                func = node.value.func
                made = terminal(func.value) if isinstance(func, ast.Attribute) else terminal(func)
                if made in classes:
                    for target in node.targets:
                        if terminal(target):
                            bound[made].add(terminal(target))
    return bound


def reads(trees: list[ast.AST], classes: dict) -> set[tuple[str, str]]:
    """(class, field) pairs read in these modules."""
    bound = bound_names(trees, classes)
    holders = defaultdict(set)  # name -> classes it may hold
    for cls, names in bound.items():
        for name in names:
            holders[name].add(cls)
    fields = {name: {f.name for f in dataclasses.fields(c)} for name, c in classes.items()}
    found = set()
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute):
                for cls in holders.get(terminal(node.value), ()):
                    if node.attr in fields[cls]:
                        found.add((cls, node.attr))
                    if node.attr in WHOLE_READS:  # x.to_json(), x.as_kwargs()
                        found |= {(cls, f) for f in fields[cls]}
            if isinstance(node, ast.Call) and terminal(node.func) in WHOLE_READS and node.args:
                for cls in holders.get(terminal(node.args[0]), ()):
                    found |= {(cls, f) for f in fields[cls]}
    return found


def tracked_fields(settings: Settings, cls: type[Settings]) -> list[tuple[str, str]]:
    """(class, field) pairs a settings object tracks: NotTracked fields left out, nested settings
    (or a None that another config fills with one) followed."""
    pairs = []
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        value = getattr(settings, field.name) if settings is not None else None
        if isinstance(value, NotTracked):
            continue
        pairs.append((cls.__name__, field.name))
        nested = [o for o in typing.get_args(hints[field.name]) or (hints[field.name],)]
        for option in nested:
            if isinstance(option, type) and issubclass(option, Settings):
                pairs += tracked_fields(value, option)
    return pairs


def merged_config(files: tuple[str, ...]) -> dict:
    """The config files layered as `--configfile a b` does (sections merged), validated, with the
    demo target's path set as rules/common.smk sets it."""
    config: dict = {}
    for name in files:
        for section, values in yaml.safe_load((REPO / name).read_text()).items():
            if isinstance(values, dict) and isinstance(config.get(section), dict):
                config[section] = {**config[section], **values}
            else:
                config[section] = values
    config = validate_config(config)
    config["target"]["path"] = config["target"]["path"] or "results/demo/target"
    return config


def rule_cases():
    return [pytest.param(rule, *case, id=rule) for rule, case in tracked_settings().items()]


@pytest.mark.parametrize(("rule", "script", "classes"), rule_cases())
def test_a_rule_tracks_no_settings_field_its_code_never_reads(rule, script, classes):
    known = settings_classes()
    trees = [ast.parse(path.read_text()) for path in rule_files(script)]
    read = reads(trees, known)
    unread = set()
    for files in CONFIGS:
        config = merged_config(files)
        for name in classes:
            settings = known[name].from_config(config)
            unread |= set(tracked_fields(settings, known[name])) - read
    assert not unread, (
        f"rule {rule} tracks settings its code (scripts/{script}.py and what it imports) never "
        f"reads: {sorted(f'{c}.{f}' for c, f in unread)}; leave them out of the rule's settings "
        "(a class of its own, or a narrower TargetSettings.view)"
    )


def test_the_check_sees_a_tracked_field_that_is_not_read():
    source = """
def save(settings: HeadLike):
    return settings.aux_layer_ids
"""
    known = {"HiddenSettings": settings_classes()["HiddenSettings"]}
    read = reads([ast.parse(source.replace("HeadLike", "HiddenSettings"))], known)
    assert ("HiddenSettings", "aux_layer_ids") in read
    assert ("HiddenSettings", "max_batch_tokens") not in read
    nested = reads([ast.parse("def f(settings: HiddenSettings):\n    settings.target.path\n")],
                   {**known, "TargetSettings": settings_classes()["TargetSettings"]})  # fmt: skip
    assert ("TargetSettings", "path") in nested


def test_every_rule_with_settings_is_checked():
    cases = tracked_settings()
    assert len(cases) >= 10 and all(classes for _, classes in cases.values() if classes)
    assert {"save_target_head", "extract_hidden_states", "train_drafter"} <= set(cases)
