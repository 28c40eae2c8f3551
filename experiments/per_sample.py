"""A trained drafter sample by sample: for each sample of the given hidden-state shards, how often
the target's greedy token (the captured states through the target's head) equals the answer's
next token, and the drafter's first-draft hit rate there (the evaluate stage's simulated chain,
K=1). The first says whether the data is sound (a state misaligned with its token shows as a
greedy/next agreement far below the rest); the second which samples the drafter did not learn.
Judged where the served drafter drafts (the answers' positions).

    python experiments/per_sample.py --run-dir results/long-reasoning --shards 00000 00001
        [--family eagle3]

Session 31 found with it that the long demo's drafters learn each chain's step rule from the
tokens: the two chains seen once in training are missed by every family (RESULTS.md).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import polars as pl
import torch

from eaglenest.common.threads import use_threads
from eaglenest.drafter.batches import BatchPlan, TargetSignal, build_batch, open_shards
from eaglenest.formats.draft_vocab import DraftVocab
from eaglenest.formats.target_head import TargetHead
from eaglenest.settings.families import FAMILIES
from eaglenest.stages.evaluate.families import load_family
from eaglenest.stages.evaluate.simulated import (
    PREDICTIONS,
    chain_positions,
    greedy_target_ids,
    shifted_stack,
)


def per_sample(run_dir: Path, shards: list[str], family: str) -> pl.DataFrame:
    head = TargetHead.load(run_dir / "hidden" / "target_head.safetensors")
    vocab = DraftVocab.load(run_dir / "vocab" / "draft_vocab.safetensors")
    hidden = [run_dir / "hidden" / f"{s}.safetensors" for s in shards]
    tokens = [run_dir / "tokens" / f"{s}.parquet" for s in shards]
    opened = open_shards(hidden, head, vocab, tokens=tokens)
    suffix = "" if family == "eagle3" else f"_{family}"
    drafter_dir = run_dir / f"drafter{suffix}"
    loaded = load_family(family, drafter_dir, head.embed, head.aux_layer_ids, (1,), head.lm_head)
    drafter = loaded.model.eval()
    signal = TargetSignal(head, vocab, "cpu")
    plan = BatchPlan(opened, 1, 0, aux_layer_ids=drafter.config.aux_layer_ids)  # a sample a batch
    rows = []
    with torch.no_grad():
        for refs in plan.epoch_order(0):
            batch = signal.fill(build_batch(refs, plan.shards, plan.aux_layer_ids))
            lengths = torch.tensor([r.length for r in refs])
            drafted = batch.loss_mask.bool()
            greedy = greedy_target_ids(batch, signal)
            agrees = greedy[:, :-1] == batch.input_ids[:, 1:]
            greedy_next = shifted_stack(greedy, 1, 1)
            start = chain_positions(batch.loss_mask, lengths, 1)
            data_next = shifted_stack(batch.input_ids, 2, 1)
            predicted = PREDICTIONS[family](drafter, batch, start, greedy_next, data_next, 1)
            hits = predicted[..., 0] == greedy_next[..., 0]
            ref = refs[0]
            rows.append(
                {
                    "shard": shards[ref.shard],
                    "row": ref.index,
                    "tokens": ref.length,
                    "greedy_is_next": agrees[drafted[:, 1:]].float().mean().item(),
                    "first_draft_hit": hits[start].float().mean().item(),
                }
            )
    return pl.DataFrame(rows).sort("shard", "row")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--run-dir", type=Path, required=True, help="a finished run's results/{run}"
    )
    parser.add_argument("--shards", nargs="+", required=True, help="hidden-state shard ids")
    parser.add_argument("--family", default="eagle3", choices=FAMILIES)
    args = parser.parse_args()
    use_threads(1)
    table = per_sample(args.run_dir, args.shards, args.family)
    with pl.Config(tbl_rows=-1, float_precision=3):
        print(table)


if __name__ == "__main__":
    main()
