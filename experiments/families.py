"""The drafter families side by side by depth: EAGLE-3, P-EAGLE and DFlash trained by one run of
the pipeline on the same shards and budget (train.families: the same epochs, batches and
schedule, so the same tokens and steps), each evaluated at every `evaluate.depths` by vLLM and
by our own live loop. Prints one markdown table: per family and depth, vLLM's acceptance length
and emitted tokens per round, its acceptance rate (accepted / drafted), its rounds and the live
loop's, the simulated acceptance, the drafter's own time per round and the tokens per target
step in the live loop (this machine's figures: stages/report/choice.py), and the training
budget (steps, tokens) and held-out accuracy per draft step; then the family fastest on this
machine (the report's `this_machine`: the report's choice is the serving device's, with
report.device, docs/report.md) and the report's device curve under its stated assumption (each
family's tokens per target step against the drafter/target ratio, and the crossovers). The
drafter's time needs `evaluate.live: true`.

    python experiments/families.py --configfile config/tests/long-reasoning.yaml \\
        [--set '{"prompts": {"max_samples": 16}}'] [--workdir DIR] [--cores 2] [--json out.json]
    python experiments/families.py --run-dir results/long-reasoning   # a finished run's table

Without `--run-dir` it runs Snakemake (`--until evaluate_drafter`: every family's drafter and
evaluation, no report) in a copy of the workflow (`--workdir`, else a temporary one) with the
configfiles over the demo's config and `--set` over them; the engine is .venv-vllm. `--target DIR`
copies in a demo target the same config built before (its build is not rerun).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import polars as pl
import yaml
from run_data import REPO, copy_workflow, deep_update, run_config, snakemake_command

from eaglenest.settings.families import FAMILIES
from eaglenest.stages.report.choice import choose_family, depth_figures
from eaglenest.stages.report.device_choice import ASSUMED_RATIO, choose_on_device
from eaglenest.stages.report.inputs import read_token_lengths

VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"


def suffix(family: str) -> str:
    return "" if family == "eagle3" else f"_{family}"


def run_pipeline(
    configfiles: list[Path], change: dict, workdir: Path, cores: int, target: Path | None
) -> Path:
    """Snakemake up to every family's evaluation in a copy of the workflow; returns results/{run}.
    `target`: a demo target built before by the same config, copied in (Snakemake plans every
    job after it, never its build)."""
    if not (
        workdir / "Snakefile"
    ).exists():  # else a copy made before: Snakemake reruns what changed
        copy_workflow(workdir)
    override = workdir / "families-study.yaml"
    change = deep_update({"vllm": {"python": str(VLLM_PYTHON)}}, change)
    override.write_text(yaml.safe_dump(change))
    files = [p.resolve() for p in configfiles] + [override]
    run = run_config(files)["run"]
    if target:
        shutil.copytree(target, workdir / "results" / run / "target", dirs_exist_ok=True)
    # --rerun-incomplete: a study stopped mid-job resumes (training from its journal)
    until = ("--until", "evaluate_drafter", "--rerun-incomplete")
    command = snakemake_command(*until, cores=cores, configfiles=files)
    print(f"families study: {' '.join(command[2:])} (in {workdir})", flush=True)
    env = {**os.environ, "PYTHONPATH": str(workdir / "src")}  # the copy's code
    subprocess.run(command, cwd=workdir, env=env, check=True)
    return workdir / "results" / run


def family_figures(run_dir: Path, family: str) -> dict[str, Any] | None:
    """A family's training report and by-depth evaluation, or None where the run has none."""
    report = run_dir / f"drafter{suffix(family)}" / "train_report.json"
    metrics = run_dir / f"eval{suffix(family)}" / "metrics.json"
    if not (report.exists() and metrics.exists()):
        return None
    return {"train": json.loads(report.read_text()), "eval": json.loads(metrics.read_text())}


def _f(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def table(figures: dict[str, dict[str, Any]]) -> list[str]:
    """The markdown table: one row per family, K and depth."""
    header = (
        "| family | K | depth | prompts | vLLM acceptance length | vLLM emitted/round "
        "| vLLM accepted/drafted | vLLM rounds | live rounds | simulated "
        "| drafter ms/round (live) | tokens / target step (live) | steps | train tokens "
        "| held-out acc by step |"
    )
    lines = [header, "|" + "---|" * 15]
    for family, found in figures.items():
        train = found["train"]
        accuracy = " / ".join(f"{a:.2f}" for a in train.get("heldout_acc") or [])
        timed = {k: {f.depth: f for f in rows} for k, rows in depth_figures(found["eval"]).items()}
        for k, rows in found["eval"]["by_depth"]["per_k"].items():
            for row in rows:
                per_step = timed[k][row["depth"]].tokens_per_target_step
                engine, live, sim = row["engine"] or {}, row["live"] or {}, row["simulated"] or {}
                length = engine.get("acceptance_length")
                rate = None if length is None else (length - 1) / int(k)
                drafter_s = live.get("drafter_s_per_round")
                lines.append(
                    f"| {family} | {k} | {row['depth']} | {row['prompts']} | {_f(length)} "
                    f"| {_f(engine.get('emitted_per_round'))} "
                    f"| {_f(rate)} | {engine.get('rounds', '-')} | {live.get('rounds', '-')} "
                    f"| {_f(sim.get('acceptance_length'))} "
                    f"| {_f(None if drafter_s is None else 1000 * drafter_s, 1)} "
                    f"| {_f(per_step)} "
                    f"| {train['steps']} | {train['train_tokens']} | {accuracy} |"
                )
    return lines


def run_tokens(run_dir: Path) -> pl.DataFrame | None:
    """The run's token lengths, which weigh the depths (as the report weighs them)."""
    shards = sorted((run_dir / "tokens").glob("?????.parquet"))
    return pl.concat([read_token_lengths(p) for p in shards]) if shards else None


def choice_line(tokens: pl.DataFrame | None, figures: dict[str, dict[str, Any]]) -> str:
    """The family fastest on this machine (the report's `this_machine`, not its choice: that
    needs the serving device's timings), its depths weighted by the run's answers."""
    summary = choose_family({f: found["eval"] for f, found in figures.items()}, tokens)
    choice = summary["choice"]
    if choice is None:
        return f"fastest here: none ({summary['why_none']})"
    return (
        f"fastest here (this machine's timings): {choice['family']} at K={choice['k']}, "
        f"{choice['tokens_per_target_step']:.3f} tokens per target step "
        f"(depth weights {choice['depth_weights']})"
    )


def device_lines(tokens: pl.DataFrame | None, figures: dict[str, dict[str, Any]]) -> list[str]:
    """The report's device curve without device timings (report/summary.json's `curve` and
    `crossovers` under its stated assumption): each family's tokens per target step at the
    curve's first ratio, the one nearest ASSUMED_RATIO (the table's) and its last, and where the leader changes."""
    summary = choose_on_device({f: found["eval"] for f, found in figures.items()}, None, tokens)
    curve = summary.get("curve")
    if not curve:
        return [f"device curve: none ({summary.get('why_none')})"]
    ratios = curve["ratios"]
    nearest = min(range(len(ratios)), key=lambda i: abs(ratios[i] - ASSUMED_RATIO))
    picks = [0, nearest, len(ratios) - 1]
    at = " / ".join(f"{ratios[i]:.3g}" for i in picks)
    lines = [f"device curve ({curve['assumed']}); tokens per target step at r = {at}:"]
    for family, found in curve["families"].items():
        rates = " / ".join(f"{found['tokens_per_target_step'][i]:.2f}" for i in picks)
        lines.append(f"  {family} (K {found['k']} at r = {ASSUMED_RATIO:g}): {rates}")
    for cross in summary.get("crossovers") or []:
        lines.append(
            f"  crossover at r = {cross['ratio']:.3f}: {cross['below']} K={cross['k_below']} "
            f"below, {cross['above']} K={cross['k_above']} above"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--run-dir", type=Path, help="a finished run's results/{run}")
    parser.add_argument("--configfile", type=Path, nargs="+", default=[])
    parser.add_argument("--set", default="{}", help="JSON over the config (as --configfile)")
    parser.add_argument("--workdir", type=Path, help="where the workflow copy runs (else a temp)")
    parser.add_argument("--cores", type=int, default=2)
    parser.add_argument("--target", type=Path, help="a demo target built by the same config")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = args.run_dir or run_pipeline(
            args.configfile,
            json.loads(args.set),
            args.workdir or Path(tmp) / "workflow",
            args.cores,
            args.target,
        )
        figures = {f: found for f in FAMILIES if (found := family_figures(run_dir, f))}
        if not figures:
            raise SystemExit(f"families study: no drafter*/ with eval*/ in {run_dir}")
        print("\n".join(table(figures)), flush=True)
        tokens = run_tokens(run_dir)
        print(choice_line(tokens, figures), flush=True)
        print("\n".join(device_lines(tokens, figures)), flush=True)
        if args.json:
            args.json.write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
