"""The report's acceptance section: acceptance length by K and by position, simulated from the
stored features, live, in the serving engine (greedy and sampled, with the spread over prompts
and by generated position: engine_spread.py) and for the baselines (eval/metrics.json)."""

from __future__ import annotations

from typing import Any

from eaglenest.formats.metrics import emitted_of
from eaglenest.settings.families import family_suffix
from eaglenest.stages.report.data import BASELINE_NAMES, RunData
from eaglenest.stages.report.engine_spread import position_table, spread_table
from eaglenest.stages.report.figures import acceptance_figure
from eaglenest.stages.report.page import Section, fmt, table


def section_acceptance(data: RunData) -> Section:
    section = Section("acceptance", "Acceptance: by position, live vs simulated, baselines")
    metrics = data.eval
    if metrics is None:
        folder = f"eval{family_suffix(data.family)}"
        section.notes.append(f"Not evaluated yet: no {folder}/metrics.json.")
        return section
    ks = [str(k) for k in metrics["ks"]]
    live = metrics.get("live")
    section.figure = acceptance_figure(metrics, ks)
    section.blocks.append(acceptance_table(metrics, ks))
    if metrics.get("by_depth"):
        section.blocks.append("<h3>Acceptance by generated depth</h3>")
        section.blocks.append(depth_table_html(metrics["by_depth"]))
    if metrics.get("engine"):
        section.blocks.append(f"<h3>In the serving engine ({metrics['engine']['engine']})</h3>")
        section.blocks.append(engine_table(metrics, ks))
        engine = metrics["engine"]
        for title, block in (
            ("Greedy and sampled, with the spread over prompts", spread_table(engine, ks)),
            ("Acceptance by generated position", position_table(engine, ks)),
        ):
            if block:
                section.blocks += [f"<h3>{title} ({engine['engine']})</h3>", block]
        # A configuration the engine cannot serve here (vLLM's CPU build: no llama or Qwen3
        # drafter beside an MLA target) is a reason, not an error: the live figures measure it.
        for k, reason in (engine.get("not_served") or {}).items():
            section.notes.append(f"K={k}: not served by {engine['engine']} here: {reason}")
    live_baselines = metrics.get("live_baselines") or {}
    if live_baselines:
        section.blocks.append("<h3>Live baselines</h3>")
        section.blocks.append(live_table(live_baselines, ks))
    conditional = [[k, *metrics["simulated"][k]["conditional_acceptance"]] for k in ks]
    width = max(len(r) for r in conditional) - 1
    section.blocks.append("<h3>Simulated conditional acceptance by position</h3>")
    section.blocks.append(table(["K", *[f"pos {i + 1}" for i in range(width)]], conditional))
    if live is None:
        reason = metrics.get("live_skipped_reason") or "no reason given"
        section.notes.append(f"Live acceptance not measured: {reason}.")
    else:
        for k in ks:
            if (live.get(k) or {}).get("identical_to_greedy") is False:
                section.notes.append(
                    f"K={k}: speculative output differs from greedy decoding (identical_to_greedy "
                    "false): the live figures measure a different sequence."
                )
    if metrics.get("heldout_shards"):
        section.notes.append(f"Held-out shards: {', '.join(metrics['heldout_shards'])}.")
    return section


def acceptance_table(metrics: dict, ks: list[str]) -> str:
    """Per K: simulated and live acceptance length, live speed-up and baselines."""
    live = metrics.get("live")
    baselines = metrics.get("baselines") or {}
    rows = []
    for k in ks:
        live_k = (live or {}).get(k) or {}
        rows.append(
            [
                k,
                metrics["simulated"][k]["acceptance_length"],
                live_k.get("acceptance_length"),
                live_k.get("speedup"),
                live_k.get("target_forwards_per_token"),
                live_k.get("identical_to_greedy"),
                *[
                    ((baselines.get(name) or {}).get(k) or {}).get("acceptance_length")
                    for name in BASELINE_NAMES
                ],
            ]
        )
    header = [
        "K",
        "simulated acceptance length",
        "live acceptance length",
        "live speedup",
        "target forwards / token",
        "identical to greedy",
        *[f"{name} acceptance length" for name in BASELINE_NAMES],
    ]
    return table(header, rows)


def engine_table(metrics: dict, ks: list[str]) -> str:
    """Per K: emitted tokens per round, one definition for the engine and our live decoding,
    with the rounds of each; then each one's own acceptance length (vLLM's counters, ours) and
    the simulated one, labelled, and per-position acceptance of both."""
    engine = metrics["engine"]
    name = engine["engine"]
    rows = []
    for k in ks:
        served = (engine.get("per_k") or {}).get(k) or {}
        live_k = (metrics.get("live") or {}).get(k) or {}
        rounding = [round(x, 3) for x in served.get("per_position_acceptance") or []]
        live_rounding = [round(x, 3) for x in live_k.get("per_position_acceptance") or []]
        rows.append(
            [
                k,
                emitted_of(served),
                emitted_of(live_k),
                served.get("rounds"),
                live_k.get("rounds"),
                served.get("acceptance_length"),
                live_k.get("acceptance_length"),
                metrics["simulated"][k]["acceptance_length"],
                served.get("identical_to_plain"),
                ", ".join(map(str, rounding)),
                ", ".join(map(str, live_rounding)),
            ]
        )
    header = [
        "K",
        f"emitted tokens per round, {name}",
        "emitted tokens per round, live",
        f"{name} rounds",
        "live rounds",
        f"{name}'s own acceptance length (1 + accepted / drafts)",
        "live acceptance length (1 + accepted per round)",
        "simulated acceptance length",
        "identical to plain decoding",
        f"{name} acceptance by position",
        "live acceptance by position",
    ]
    note = (
        "<p>Emitted tokens per round: the tokens each answer kept, less the one the prefill "
        f"emits, over the verification rounds; the same definition for {name} and for the live "
        f"decoding, so these two compare. {name}'s own acceptance length comes from its "
        "spec_decode counters, which also count drafts accepted past the end of an answer "
        "(tokens it then discards): it reads higher than the kept tokens give.</p>"
    )
    return table(header, rows) + note


def live_table(live_by_name: dict[str, dict], ks: list[str]) -> str:
    keys = ("acceptance_length", "speedup", "target_forwards_per_token", "identical_to_greedy")
    rows = [
        [name, k, *[(per_k.get(k) or {}).get(key) for key in keys]]
        for name, per_k in live_by_name.items()
        for k in ks
    ]
    return table(["proposer", "K", *[key.replace("_", " ") for key in keys]], rows)


def depth_table_html(by_depth: dict[str, Any]) -> str:
    """One row per K and depth: prompts decoded there, then acceptance length and rounds of the
    live and the engine decoding, and the simulated acceptance length."""
    rows = []
    every_row = [row for per_depth in by_depth["per_k"].values() for row in per_depth]
    temperatures = [
        row["engine_sampled"]["temperature"] for row in every_row if row.get("engine_sampled")
    ]
    sampled = bool(temperatures)
    for k, per_depth in by_depth["per_k"].items():
        for row in per_depth:
            live, engine, simulated = (row.get(m) or {} for m in ("live", "engine", "simulated"))
            at_temperature = row.get("engine_sampled") or {}
            rows.append(
                [
                    k,
                    row["depth"],
                    row["prompts"],
                    live.get("acceptance_length"),
                    live.get("rounds"),
                    engine.get("acceptance_length"),
                    engine.get("rounds"),
                    *([at_temperature.get("acceptance_length")] if sampled else []),
                    simulated.get("acceptance_length"),
                    simulated.get("positions"),
                ]
            )
    header = [
        "K",
        "depth",
        "prompts",
        "live acceptance length",
        "live rounds",
        "engine acceptance length",
        "engine rounds",
        *([f"engine acceptance length at T={fmt(temperatures[0])}"] if sampled else []),
        "simulated acceptance length",
        "simulated positions",
    ]
    skipped = ", ".join(
        f"{depth}: {counts['too_short']} too short"
        for depth, counts in by_depth.get("samples", {}).items()
    )
    note = (
        f"<p>Held-out samples cut after their prompt and `depth` generated tokens, the next"
        f" {by_depth['continuation_tokens']}"
        f" decoded from there (depth 0: from the prompt). Samples skipped per depth: {skipped}."
        "</p>"
    )
    return table(header, rows) + note
