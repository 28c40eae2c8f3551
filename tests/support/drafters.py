"""The evaluate stage on the small demo's held-out shard, as the engine tests that train drafters
of their own call it (EAGLE-3 variants, windows, families): one definition of what they measure
before vLLM decodes the same prompts."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def run_files(results: Path) -> dict[str, Path]:
    """The finished run's target head and draft vocabulary, as train_drafter and
    evaluate_drafter take them."""
    return {
        "target_head": results / "hidden" / "target_head.safetensors",
        "draft_vocab": results / "vocab" / "draft_vocab.safetensors",
    }


def evaluate_on_heldout(
    drafter_dir: Path,
    results: Path,
    out: Path,
    *,
    ks: list[int],
    prompts: int,
    max_new_tokens: int,
    family: str = "eagle3",
) -> dict[str, Any]:
    """evaluate_drafter's metrics (simulated, and our own live loop over `prompts` held-out
    prompts) for the `family` drafter of `drafter_dir`, on shard 00001 of the run `results`."""
    from eaglenest.common.config import settings_from_sections
    from eaglenest.settings.evaluate import EvaluateSettings
    from eaglenest.stages.evaluate.evaluate import evaluate_drafter

    evaluate = {"ks": ks, "device": "cpu", "live_prompts": prompts,
                "live_max_new_tokens": max_new_tokens}  # fmt: skip
    target = {"path": str(results / "target")}
    return evaluate_drafter(
        drafter_dir=drafter_dir,
        heldout_hidden=[results / "hidden" / "00001.safetensors"],
        heldout_tokens=[results / "tokens" / "00001.parquet"],
        out=out,
        settings=settings_from_sections(EvaluateSettings, evaluate=evaluate, target=target),
        runtime=None,
        family=family,
        **run_files(results),
    )
