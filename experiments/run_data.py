"""What the studies of experiments/ share: the run's config as Snakemake merges it, the run's data
made by Snakemake in a copy of the workflow (tests/support/workflow.py), its shards split into
training and held-out by the workflow's own split (eaglenest.run.split), and a drafter trained
and evaluated on them (RunFiles)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from support.workflow import REPO, copy_workflow, snakemake_command

from eaglenest.common.config import validate_config
from eaglenest.run.split import split_shards


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


@dataclass(frozen=True)
class RunFiles:
    """What a study reads of a finished run: its target, training and held-out shards, and the
    files every training and evaluation shares."""

    target: str
    train_hidden: list[Path]
    heldout_hidden: list[Path]
    heldout_tokens: list[Path]
    shared: dict[str, Path]

    @classmethod
    def of(cls, run_dir: Path, config: dict[str, Any]) -> RunFiles:
        demo_target = run_dir / "target"
        split = split_shards(config)
        train_ids, heldout_ids = split.training, split.heldout
        return cls(
            target=str(demo_target) if demo_target.is_dir() else config["target"]["path"],
            train_hidden=[run_dir / "hidden" / f"{s}.safetensors" for s in train_ids],
            heldout_hidden=[run_dir / "hidden" / f"{s}.safetensors" for s in heldout_ids],
            heldout_tokens=[run_dir / "tokens" / f"{s}.parquet" for s in heldout_ids],
            shared={
                "target_head": run_dir / "hidden" / "target_head.safetensors",
                "draft_vocab": run_dir / "vocab" / "draft_vocab.safetensors",
            },
        )

    def train_and_evaluate(self, out: Path, train: Any, evaluate: Any, runtime: Any = None,
                           train_hidden: list[Path] | None = None) -> tuple[dict, dict, float]:  # fmt: skip
        """Train a drafter into out/drafter with `train` (TrainSettings) on `train_hidden` (the
        run's training shards by default), evaluate it with `evaluate` (EvaluateSettings; the
        engine's when `runtime`), and return (training report, metrics, training seconds)."""
        from eaglenest.stages.evaluate.evaluate import evaluate_drafter
        from eaglenest.stages.train.train import train_drafter

        started = time.perf_counter()
        report = train_drafter(
            train_shards=train_hidden or self.train_hidden,
            eval_shards=self.heldout_hidden,
            out_dir=out / "drafter",
            journal_dir=out / "journal",
            settings=train,
            **self.shared,
        )
        train_s = time.perf_counter() - started
        metrics = evaluate_drafter(
            drafter_dir=out / "drafter",
            heldout_hidden=self.heldout_hidden,
            heldout_tokens=self.heldout_tokens,
            out=out / "metrics.json",
            settings=evaluate,
            runtime=runtime,
            **self.shared,
        )
        shutil.rmtree(out / "journal", ignore_errors=True)
        return report, metrics, train_s
