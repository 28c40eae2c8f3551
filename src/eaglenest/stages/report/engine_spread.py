"""The acceptance section's serving-engine tables beyond the counters: greedy and sampled side by
side with their spread over prompts, and acceptance by generated position from the engine's
per-step record (eval/metrics.json `engine`; stages/evaluate/spread.py computes them)."""

from __future__ import annotations

from typing import Any

from eaglenest.stages.report.data import positions, temperature_rows
from eaglenest.stages.report.page import fmt, table


def interval_text(interval: list[float] | None) -> str | None:
    return None if not interval else f"{fmt(interval[0])} – {fmt(interval[1])}"


def quartiles_text(spread: dict[str, Any]) -> str | None:
    values = [spread.get(key) for key in ("q1", "median", "q3")]
    return None if None in values else " / ".join(fmt(v) for v in values)


def range_text(spread: dict[str, Any]) -> str | None:
    low, high = spread.get("min"), spread.get("max")
    return None if low is None or high is None else f"{fmt(low)} – {fmt(high)}"


def spread_table(engine: dict[str, Any], ks: list[str]) -> str | None:
    """Per K, greedy and sampled side by side: the acceptance length, its 95 % bootstrap
    interval over prompts, the per-prompt quartiles and range, emitted tokens per round, rounds,
    and the sampled figure's paired difference from the greedy one. None without a spread."""
    rows = temperature_rows(engine, ks)
    if not any(figures.get("spread") for _, figures in rows):
        return None
    body = []
    for k, figures in rows:
        spread = figures.get("spread") or {}
        versus = figures.get("vs_greedy") or {}
        difference = versus.get("difference")
        body.append(
            [
                k,
                figures.get("temperature"),
                figures.get("acceptance_length"),
                interval_text(spread.get("ci95")),
                quartiles_text(spread),
                range_text(spread),
                figures.get("emitted_per_round"),
                figures.get("rounds"),
                None if difference is None else f"{difference:+.3f}",
                interval_text(versus.get("ci95")),
            ]
        )
    header = [
        "K",
        "temperature",
        "acceptance length",
        "95% interval",
        "per prompt: q1 / median / q3",
        "per prompt: min – max",
        "emitted tokens per round",
        "rounds",
        "sampled − greedy",
        "its 95% interval",
    ]
    sampled = engine.get("sampled") or {}
    note = (
        "<p>Acceptance length per prompt is 1 + accepted / steps from the engine's per-request "
        "record; the interval is a bootstrap over prompts of the figure itself (prompts drawn "
        "with replacement). The difference from greedy is paired: each draw takes the same "
        "prompts from both, so an interval that excludes 0 is a difference the prompts do not "
        "explain."
    )
    if sampled:
        note += (
            f" Sampled: temperature {fmt(sampled.get('temperature'))}, top_p "
            f"{fmt(sampled.get('top_p'))}, vLLM's rejection sampling, each prompt seeded from "
            f"{fmt(sampled.get('seed'))}."
        )
    return table(header, body) + note + "</p>"


def position_table(engine: dict[str, Any], ks: list[str]) -> str | None:
    """Per K and temperature, acceptance length in each bin of generated positions. None when
    the engine kept no per-step record."""
    rows = [
        (k, figures) for k, figures in temperature_rows(engine, ks) if figures.get("by_position")
    ]
    if not rows:
        return None
    bins = rows[0][1]["by_position"]["bins"]
    header = ["K", "temperature", *[f"{b['start']}–{b['end']}" for b in bins]]
    body = [
        [k, figures.get("temperature"), *[b["acceptance_length"] for b in positions(figures)]]
        for k, figures in rows
    ]
    note = (
        "<p>Positions inside the engine's own answers: each verification step counted at the "
        "position it starts drafting (1 + the tokens the steps before it emitted), so nothing "
        "is cut; the by-depth table above moves where the answer starts instead.</p>"
    )
    return table(header, body) + note
