"""The drafter families live in one table (src/eaglenest/settings/families.py) and a room each
(src/eaglenest/drafter/<family>/): no other library module asks a family's name what to do (it
looks its family up in a table of its stage), and every stage's table holds every family of the
table, so a family added and forgotten somewhere fails here, naming the stage
(docs/adding-a-family.md)."""

import ast
import importlib
from pathlib import Path

import pytest

from eaglenest.settings.families import FAMILIES

LIBRARY = Path(__file__).resolve().parents[2] / "src" / "eaglenest"
# Where a family's name may decide: the table, and the families' own rooms.
MAY_NAME_FAMILIES = ("settings/families.py", "drafter/")

# stage -> the tables keyed by family it keeps ("module:NAME")
STAGE_TABLES = {
    "train": ("eaglenest.stages.train.families:RECIPES",),
    "evaluate": (
        "eaglenest.stages.evaluate.families:LOADERS",
        "eaglenest.stages.evaluate.families:PROPOSERS",
        "eaglenest.stages.evaluate.simulated:UNTRAINED",
        "eaglenest.stages.evaluate.simulated:PREDICTIONS",
    ),
    "report": (
        "eaglenest.stages.report.training:DRAFTED_SLOTS",
        "eaglenest.stages.report.training:DRAFTING",
    ),
}


def family_literals(node: ast.AST) -> list[str]:
    """The family names a Compare operand spells: a string constant, or one in a literal tuple,
    list or set (`family in ("p_eagle", "dflash")`)."""
    items = node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else [node]
    return [
        item.value
        for item in items
        if isinstance(item, ast.Constant) and isinstance(item.value, str) and item.value in FAMILIES
    ]


def family_comparisons(path: Path) -> list[str]:
    """`file:line: source` of each comparison against a family's name in one module."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            if any(family_literals(operand) for operand in operands):
                where = f"{path.relative_to(LIBRARY)}:{node.lineno}"
                found.append(f"{where}: {ast.unparse(node)}")
    return found


def test_no_module_outside_the_table_and_the_rooms_compares_a_family_name():
    """A stage asks its table (keyed by family), not `family == "dflash"`: a comparison with a
    family's name is a dispatch that a new family silently falls through."""
    modules = [
        path
        for path in sorted(LIBRARY.rglob("*.py"))
        if not str(path.relative_to(LIBRARY)).startswith(MAY_NAME_FAMILIES)
    ]
    found = [hit for path in modules for hit in family_comparisons(path)]
    assert not found, (
        "compared with a family's name outside settings/families.py and drafter/ (look the "
        "family up in its stage's table instead):\n" + "\n".join(found)
    )


def test_the_check_sees_a_comparison_and_a_tuple():
    """The check above is not vacuous: both ways of spelling a dispatch are caught."""
    source = 'a = family == "dflash"\nb = family in ("eagle3", "x")\nc = family == "other"\n'
    hits = [n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Compare)]
    assert [bool(family_literals(h.comparators[0])) for h in hits] == [True, True, False]


@pytest.mark.parametrize("stage", STAGE_TABLES)
def test_every_stage_table_holds_every_family(stage):
    """Each table a stage keeps by family has an entry for every family of settings/families.py."""
    missing = []
    for ref in STAGE_TABLES[stage]:
        module, name = ref.split(":")
        table = getattr(importlib.import_module(module), name)
        missing += [f"{ref} lacks {family!r}" for family in FAMILIES if family not in table]
    assert not missing, f"stage {stage}: " + "; ".join(missing)


def test_every_family_has_its_room_in_drafter():
    """drafter/<family>/ holds its model, and its export (docs/adding-a-family.md)."""
    missing = [
        f"drafter/{family}/{module}.py"
        for family in FAMILIES
        for module in ("model", "export")
        if not (LIBRARY / "drafter" / family / f"{module}.py").is_file()
    ]
    assert not missing, f"missing: {missing}"
