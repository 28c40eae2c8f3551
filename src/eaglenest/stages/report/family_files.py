"""Which drafter families a report shows, and which family a drafter or eval file is of.

The report shows the families train.families lists, and every other family whose evaluation is
already on disk (a family taken out of the list keeps its files). So its list of inputs does not
shrink when a family is taken out, and Snakemake, which reruns a job whose set of inputs changed,
reruns nothing; a family added is a new input, and the report is rebuilt once it is evaluated.
Kept free of the report's heavy imports: the report rule reads it while Snakemake plans.
"""

from __future__ import annotations

from pathlib import Path

from eaglenest.settings.families import FAMILIES, FAMILY_SPECS, family_of_suffix, family_suffix

# How the page names each family (its spec's title).
FAMILY_TITLES = {family: spec.title for family, spec in FAMILY_SPECS.items()}
# Each family's files under results/{run}/, by the report's name for them.
FAMILY_FILES = {
    "train_metrics": "drafter{suffix}/metrics.jsonl",
    "train_report": "drafter{suffix}/train_report.json",
    "eval_metrics": "eval{suffix}/metrics.json",
    # The drafter's positions, window and rope: where a fall by depth may be a configured cliff.
    "drafter_config": "drafter{suffix}/config.json",
}


def report_families(listed: list[str], run_dir: str | Path) -> list[str]:
    """The families listed, and those evaluated in `run_dir` already, in FAMILIES order."""
    run_dir = Path(run_dir)
    evaluated = {
        family
        for family in FAMILIES
        if (run_dir / FAMILY_FILES["eval_metrics"].format(suffix=family_suffix(family))).exists()
    }
    return [family for family in FAMILIES if family in listed or family in evaluated]


def family_files(kind: str, families: list[str], run_dir: str | Path, listed: list[str]) -> list:
    """The `kind` files (a key of FAMILY_FILES) of `families` under `run_dir`: a listed family's
    always (its jobs make them), another's where it exists (nothing makes it any more)."""
    paths = []
    for family in families:
        path = Path(run_dir) / FAMILY_FILES[kind].format(suffix=family_suffix(family))
        if family in listed or path.exists():
            paths.append(str(path))
    return paths


def report_family_files(listed: list[str], run_dir: str | Path) -> dict[str, list[str]]:
    """The report rule's family inputs: each kind of FAMILY_FILES, of the families it shows."""
    families = report_families(listed, run_dir)
    return {kind: family_files(kind, families, run_dir, listed) for kind in FAMILY_FILES}


def family_of_path(path: str | Path) -> str:
    """The family of a file in drafter{suffix}/ or eval{suffix}/ (ValueError for another)."""
    folder = Path(path).parent.name
    for stem in ("drafter", "eval"):
        if folder.startswith(stem):
            return family_of_suffix(folder.removeprefix(stem))
    raise ValueError(f"{path}: not in a drafter family's drafter*/ or eval*/ folder")
