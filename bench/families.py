"""Drafter families side by side (train.families: eagle3, p_eagle, dflash): training tokens/s of
each through the train stage itself, and each drafter's own time per speculative round in our
live loop's proposer, at the same K.

One synthetic run (random features in the stages' formats: tests/support/synthetic_run.py, the
demo's sizes), the same batches and steps for every family; each trained drafter exported and
loaded back as the evaluate stage loads it (stages/evaluate/families.py), then timed over
`--rounds` rounds after a prompt of `--prompt-tokens`: a round is `propose(K)` and `accept` of two
verified tokens (their aux states random). EAGLE-3 drafts K tokens in K forwards, P-EAGLE in one
forward of the verified tokens and K-1 masks, DFlash one block of K+1 at once: the drafter time
per round is what separates them when acceptance does not.

Usage: python bench/families.py [--quick] [--steps N] [--rounds N] [--k 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from support.synthetic_run import DEMO_SIZE, write_synthetic_run

from eaglenest.settings.families import FAMILIES

SIZE = DEMO_SIZE


def train_family(family: str, run: dict, root: Path, steps: int, k: int) -> dict:
    """train_drafter of `family` for `steps` steps on the run; its report."""
    from eaglenest.common.config import settings_from_sections, validate_config
    from eaglenest.settings.train import FamilySettings, TrainSettings
    from eaglenest.stages.train.train import train_drafter

    sections = {
        "train": {
            "max_steps": steps,
            "epochs": 1000,
            "max_batch_tokens": SIZE["max_batch_tokens"],
            "warmup_steps": 0,
            "ttt_steps": k,  # EAGLE-3's steps and P-EAGLE's depths: K drafted tokens each
            "checkpoint_every": 10**9,
            "log_every": 10**9,
            "export_dtype": "float32",
            "mask_token_id": SIZE["vocab_size"] - 1,  # the synthetic target has no tokenizer
            "dflash": {"block_size": k + 1},
        },
        "target": {"path": run["target_path"]},
    }
    arguments = {key: value for key, value in run.items() if key != "target_path"}
    return train_drafter(
        **arguments,
        out_dir=root / family,
        journal_dir=root / f"journal-{family}",
        settings=settings_from_sections(TrainSettings, **sections),
        family=FamilySettings.of(validate_config(sections), family),
    )


def seconds_per_round(family: str, drafter_dir: Path, run: dict, k: int, args) -> float:
    """The drafter's own time per round (propose K, accept two tokens) in our live loop."""
    from eaglenest.formats.target_head import TargetHead
    from eaglenest.stages.evaluate.families import load_family

    head = TargetHead.load(run["target_head"])
    loaded = load_family(family, drafter_dir, head.embed, head.aux_layer_ids, (k,))
    proposer = loaded.to("cpu").proposer()
    width = len(head.aux_layer_ids) * SIZE["hidden_size"]
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, SIZE["vocab_size"], (args.prompt_tokens,), generator=generator)
    aux = torch.randn(args.prompt_tokens, width, generator=generator)
    verified = torch.randn(args.rounds + 5, 2, width, generator=generator)
    with torch.inference_mode():
        proposer.start(prompt.tolist(), aux, 1)
        for warm in range(3):
            proposer.accept([*proposer.propose(k)[:1], 2], verified[warm])
        started = time.perf_counter()
        for round_ in range(args.rounds):
            proposer.accept([*proposer.propose(k)[:1], 2], verified[3 + round_ % 2])
        return (time.perf_counter() - started) / args.rounds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    steps = args.steps or (6 if args.quick else 40)
    args.rounds = args.rounds or (20 if args.quick else 200)
    results: dict = {"k": args.k, "steps": steps, "rounds": args.rounds, "families": {}}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        run = write_synthetic_run(root / "run", SIZE, samples=160, shards=2)
        for family in FAMILIES:
            report = train_family(family, run, root, steps, args.k)
            per_round = seconds_per_round(family, root / family, run, args.k, args)
            results["families"][family] = {
                "train_tokens_per_s": report["tokens_per_s"],
                "train_wall_s": report["wall_s"],
                "drafter_ms_per_round": 1000 * per_round,
            }
    eagle3 = results["families"]["eagle3"]
    print(f"drafter families ({steps} training steps, K={args.k}, {args.rounds} rounds, CPU):")
    for family, figures in results["families"].items():
        figures["train_ratio_to_eagle3"] = (
            figures["train_tokens_per_s"] / eagle3["train_tokens_per_s"]
        )
        figures["round_ratio_to_eagle3"] = (
            figures["drafter_ms_per_round"] / eagle3["drafter_ms_per_round"]
        )
        print(
            f"  {family:8s} train {figures['train_tokens_per_s']:9.0f} tokens/s "
            f"({figures['train_ratio_to_eagle3']:.2f}x eagle3)   drafter "
            f"{figures['drafter_ms_per_round']:6.2f} ms/round "
            f"({figures['round_ratio_to_eagle3']:.2f}x eagle3)"
        )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
