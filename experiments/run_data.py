"""What the studies of experiments/ share: the run's config as Snakemake merges it, the run's data
made by Snakemake in a copy of the workflow (tests/support/workflow.py), and its shards split into
training and held-out as the workflow splits them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from support.workflow import REPO, copy_workflow, snakemake_command

from eaglenest.common.config import validate_config


def deep_update(base: dict, change: dict) -> dict:
    for key, value in change.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            deep_update(base[key], value)
        else:
            base[key] = value
    return base


def run_config(configfiles: list[Path]) -> dict[str, Any]:
    """config/config.yaml with each file over it (as Snakemake merges --configfile), validated."""
    config: dict[str, Any] = {}
    for path in [REPO / "config" / "config.yaml", *configfiles]:
        deep_update(config, yaml.safe_load(Path(path).read_text()) or {})
    return validate_config(config)


def make_run(
    configfiles: list[Path], workdir: Path, run: str, cores: int, hidden: bool = False
) -> Path:
    """Snakemake in a copy of the workflow, up to what training reads: the target, the tokens
    shards, the draft vocabulary and the target head (and with `hidden` the hidden-state shards,
    as the pipeline extracts them). Returns results/{run}."""
    copy_workflow(workdir)
    # The default target cut after these rules: no shard ids needed, and only what training reads.
    until = [
        "build_draft_vocab",
        "save_target_head",
        *(["extract_hidden_states"] if hidden else []),
    ]
    # Variants of the demo, over it as run_config reads them.
    command = snakemake_command(
        "--until", *until, cores=cores, configfiles=[p.resolve() for p in configfiles]
    )
    print(f"making the run's data: {' '.join(command[2:])}", flush=True)
    # The copy's own src first: the jobs run the code this study was started with.
    env = {**os.environ, "PYTHONPATH": str(workdir / "src")}
    subprocess.run(command, cwd=workdir, env=env, check=True)
    return workdir / "results" / run


def split_shards(run_dir: Path, eval_shards: int | list[str]) -> tuple[list[str], list[str]]:
    """(training, held-out) shard ids of the run, as rules/common.smk splits them."""
    shards = sorted(p.stem for p in (run_dir / "tokens").glob("[0-9][0-9][0-9][0-9][0-9].parquet"))
    if isinstance(eval_shards, int):
        heldout = shards[len(shards) - eval_shards :] if eval_shards else []
    else:
        heldout = [s for s in shards if s in eval_shards]
    return [s for s in shards if s not in heldout], heldout
