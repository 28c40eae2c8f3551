"""DFlash's two head layouts on the same data and steps (train.dflash.head): `target`, the
target's LM head and embedding frozen over the whole vocabulary (z-lab's, SpecForge's and
speculators' layout, the default), against `draft`, a head of its own over the draft vocabulary
(started from the target's rows, train.lm_head_init target, and trained). Each is trained by the
train stage on a finished run's training shards and measured by the evaluate stage's simulated
acceptance on its held-out ones (no live loop, no engine). Prints one markdown table.

    python experiments/dflash_head.py --run-dir WORKDIR/results/demo-small \\
        [--configfile config/tests/demo-small.yaml] [--set '{"epochs": 30}'] [--ks 3 7]

WORKDIR is a workdir where the pipeline ran on the configfiles (over config/config.yaml): the
suite's `finished_run`, or `snakemake --configfile config/config.yaml
config/tests/demo-small.yaml`; their split says which shards train and which are held out
(`RunFiles`).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from run_data import RunFiles, deep_update, run_config

from eaglenest.common.config import settings_from_sections, validate_config
from eaglenest.settings.evaluate import EvaluateSettings
from eaglenest.settings.train import FamilySettings, TrainSettings

HEADS = ("target", "draft")
# The families study's budget (experiments/RESULTS.md#families), DFlash at its defaults.
TRAIN = {
    "families": ["dflash"],
    "epochs": 30,
    "lr": 3e-3,
    "warmup_steps": 10,
    "max_batch_tokens": 1024,
    "lm_head_init": "target",  # the draft head starts from the target's rows
    "export_dtype": "float32",
    "device": "cpu",
}


def train_and_simulate(
    files: RunFiles, train: dict[str, Any], ks: list[int], out: Path
) -> dict[str, Any]:
    """One head's drafter trained and simulated; its figures."""
    from eaglenest.stages.evaluate.evaluate import evaluate_drafter
    from eaglenest.stages.train.train import train_drafter

    target = {"path": files.target}
    sections = {"train": train, "target": target}
    started = time.perf_counter()
    report = train_drafter(
        train_shards=files.train_hidden,
        eval_shards=files.heldout_hidden,
        out_dir=out / "drafter",
        journal_dir=out / "journal",
        settings=settings_from_sections(TrainSettings, **sections),
        family=FamilySettings.of(validate_config(sections), "dflash"),
        **files.shared,
    )
    train_s = time.perf_counter() - started
    evaluate = {"ks": ks, "device": "cpu", "live": False}
    metrics = evaluate_drafter(
        drafter_dir=out / "drafter",
        heldout_hidden=files.heldout_hidden,
        heldout_tokens=files.heldout_tokens,
        out=out / "metrics.json",
        settings=settings_from_sections(EvaluateSettings, evaluate=evaluate, target=target),
        runtime=None,
        family="dflash",
        **files.shared,
    )
    return {
        "steps": report["steps"],
        "train_s": train_s,
        "heldout_loss": report.get("heldout_loss"),
        "heldout_acc": report.get("heldout_acc"),
        "simulated": {k: metrics["simulated"][str(k)]["acceptance_length"] for k in ks},
        "untrained": {
            k: metrics["baselines"]["untrained"][str(k)]["acceptance_length"] for k in ks
        },
    }


def table(found: dict[str, dict[str, Any]], ks: list[int]) -> str:
    head = "| head | steps | train s | held-out loss | held-out acc by slot | " + " | ".join(
        f"simulated K={k} (untrained)" for k in ks
    )
    lines = [head + " |", "|" + "---|" * (5 + len(ks))]
    for name, f in found.items():
        acc = " / ".join(f"{a:.2f}" for a in f["heldout_acc"] or [])
        sims = " | ".join(f"{f['simulated'][k]:.3f} ({f['untrained'][k]:.3f})" for k in ks)
        loss = f["heldout_loss"]
        loss = f"{loss:.3f}" if isinstance(loss, float) else str(loss)
        lines.append(f"| {name} | {f['steps']} | {f['train_s']:.1f} | {loss} | {acc} | {sims} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run-dir", type=Path, required=True, help="results/{run} of a workdir")
    parser.add_argument(
        "--configfile", type=Path, nargs="+", default=[Path("config/tests/demo-small.yaml")]
    )
    parser.add_argument("--set", default="{}", help="JSON over the train section (TRAIN)")
    parser.add_argument("--ks", type=int, nargs="+", default=[3, 7])
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    files = RunFiles.of(args.run_dir, run_config(args.configfile))
    train = deep_update(dict(TRAIN), json.loads(args.set))
    found = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in HEADS:
            own = deep_update({"dflash": {"head": name}}, {"dflash": train.get("dflash", {})})
            found[name] = train_and_simulate(files, {**train, **own}, args.ks, Path(tmp) / name)
            print(name, json.dumps(found[name]), flush=True)
    print(table(found, args.ks))
    if args.json:
        args.json.write_text(json.dumps(found, indent=2))


if __name__ == "__main__":
    main()
