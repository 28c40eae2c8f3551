"""The rates and file sizes `eaglenest plan` assumes by default (run/plan.py DEMO_RATES,
DEMO_BYTES_PER_TOKEN), measured on a finished run: `rates_from_run`."""

from __future__ import annotations

import csv
import json
from pathlib import Path


def rates_from_run(workdir: str | Path, run: str) -> tuple[dict[str, float], dict[str, float]]:
    """(rates, bytes per token) of a finished run: generation's tokens (prompts and answers, as
    the plan counts them) over its jobs' seconds (benchmarks/), capture's over the target's
    forward seconds (hidden/*.json), training's from its report; the raw, samples and tokens
    files' sizes over the tokens they hold."""
    root = Path(workdir)
    results = root / "results" / run
    shard_tokens: dict[str, int] = {}
    capture_s = 0.0
    for summary_path in sorted((results / "hidden").glob("[0-9]*.json")):
        summary = json.loads(summary_path.read_text())
        shard_tokens[summary_path.stem] = int(summary["tokens"])
        # The target's own time: its load is paid once a server, not once a token.
        capture_s += float(summary.get("forward_seconds") or summary["seconds"])
    tokens = sum(shard_tokens.values())
    generate_s = sum(
        benchmark_seconds(root / "benchmarks" / run / "generate" / f"{shard}.tsv")
        for shard in shard_tokens
    )
    report = json.loads((results / "drafter" / "train_report.json").read_text())
    rates = {
        "generate_tokens_per_s": tokens / generate_s,
        "capture_tokens_per_s": tokens / capture_s,
        "train_tokens_per_s": float(report["tokens_per_s"]),
    }
    sizes = {
        "raw": sum((results / "raw" / f"{s}.parquet").stat().st_size for s in shard_tokens),
        "samples": sum((results / "samples" / f"{s}.parquet").stat().st_size for s in shard_tokens),
        "tokens": sum((results / "tokens" / f"{s}.parquet").stat().st_size for s in shard_tokens),
    }
    return rates, {name: size / tokens for name, size in sizes.items()}


def benchmark_seconds(path: Path) -> float:
    with open(path) as stream:
        return float(next(csv.DictReader(stream, delimiter="\t"))["s"])
