"""The report's acceptance by context depth (eval/metrics.json `by_depth`, evaluate.depths): a
panel of acceptance length against depth, one line per K and measurement, and its table."""

from __future__ import annotations

from typing import Any

from eaglenest.stages.report.page import table

# Line style per measurement; colour per K.
MEASUREMENT_STYLES = {"live": "-", "engine": ":", "simulated": "--"}


def depth_panel(axis, by_depth: dict[str, Any]) -> None:
    """Acceptance length against depth: per K, the live, engine and simulated figures."""
    for index, (k, rows) in enumerate(by_depth["per_k"].items()):
        for measurement, style in MEASUREMENT_STYLES.items():
            points = [
                (row["depth"], row[measurement]["acceptance_length"])
                for row in rows
                if row.get(measurement) and row[measurement].get("acceptance_length") is not None
            ]
            if points:
                axis.plot(*zip(*points), style, marker="o", markersize=3, color=f"C{index}",
                          label=f"K={k} {measurement}")  # fmt: skip
    axis.set_xlabel("context depth (tokens)")
    axis.set_ylabel("acceptance length")
    axis.set_title("acceptance by depth")
    axis.legend(fontsize=6)


def depth_table_html(by_depth: dict[str, Any]) -> str:
    """One row per K and depth: prompts decoded there, then acceptance length and rounds of the
    live and the engine decoding, and the simulated acceptance length."""
    rows = []
    for k, per_depth in by_depth["per_k"].items():
        for row in per_depth:
            live, engine, simulated = (row.get(m) or {} for m in ("live", "engine", "simulated"))
            rows.append([
                k, row["depth"], row["prompts"],
                live.get("acceptance_length"), live.get("rounds"),
                engine.get("acceptance_length"), engine.get("rounds"),
                simulated.get("acceptance_length"), simulated.get("positions"),
            ])  # fmt: skip
    header = [
        "K", "depth", "prompts", "live acceptance length", "live rounds",
        "engine acceptance length", "engine rounds", "simulated acceptance length",
        "simulated positions",
    ]  # fmt: skip
    skipped = ", ".join(
        f"{depth}: {counts['too_short']} too short, {counts['prompt_past_depth']} prompt past it"
        for depth, counts in by_depth.get("samples", {}).items()
    )
    note = (
        f"<p>Held-out samples cut after `depth` tokens, the next {by_depth['continuation_tokens']}"
        f" decoded from there (depth 0: from the prompt). Samples skipped per depth: {skipped}."
        "</p>"
    )
    return table(header, rows) + note
