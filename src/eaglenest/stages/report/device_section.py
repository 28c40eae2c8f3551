"""The report's section on the drafter family for the serving device (device_choice.py,
report/summary.json): the device and where its timings came from, each family's figures at each
K, the curve against the drafter/target ratio with its crossovers, and the margin's interval.
Without report.device it says why no family is chosen."""

from __future__ import annotations

from typing import Any

from eaglenest.stages.report.family_files import FAMILY_TITLES
from eaglenest.stages.report.figures import device_curve_figure
from eaglenest.stages.report.page import Section, fmt, table


def margin_text(margin: dict[str, Any] | None) -> str:
    if margin is None:
        return "One family evaluated: no margin."
    interval = margin["ci95"]
    spread = (
        f"95% interval [{fmt(interval[0])}, {fmt(interval[1])}] over prompts "
        f"({margin['resamples']} bootstrap resamples, seed {margin['seed']}, "
        f"{'paired' if margin['paired'] else 'unpaired'} draws; ahead in "
        f"{100 * margin['share_ahead']:.0f}% of them)"
        if interval
        else f"no interval: {margin['why_no_interval']}"
    )
    return (
        f"Ahead of {FAMILY_TITLES[margin['over']]} by {fmt(margin['tokens_per_target_step'])} "
        f"tokens per target step ({100 * margin['relative']:+.1f}%), {spread}."
    )


def device_choice_text(summary: dict[str, Any]) -> str:
    choice = summary["choice"]
    if choice is None:
        return f"No family chosen: {summary['why_none']}."
    device = summary["device"]
    return (
        f"Chosen for {device['name']} (timings: {device['source']}): "
        f"{FAMILY_TITLES[choice['family']]} at K={choice['k']}, "
        f"{fmt(choice['tokens_per_target_step'])} tokens per target step "
        f"(acceptance: {choice['acceptance_source']}). {margin_text(choice['margin'])}"
    )


def figures_table(by_family: dict[str, Any]) -> str:
    rows = []
    for family, figures in by_family.items():
        for k, at in figures["per_k"].items():
            rows.append(
                [
                    FAMILY_TITLES[family],
                    k,
                    at["emitted_per_round"],
                    at["acceptance_source"],
                    at["prompts"],
                    at["verify_cost"],
                    at["drafter_forwards"],
                    at["drafter_ratio"],
                    at["tokens_per_target_step"],
                    "its best K" if str(figures["best_k"]) == k else "",
                ]
            )
    header = [
        "family",
        "K",
        "emitted tokens / round (tau)",
        "acceptance from",
        "prompts",
        "verify K+1 / step (v)",
        "drafter forwards / round (d)",
        "drafter / target (r)",
        "tokens per target step",
        "",
    ]
    return table(header, rows)


def crossovers_text(crossovers: list[dict[str, Any]]) -> str:
    if not crossovers:
        return "The best family is the same at every ratio in (0, 1]."
    changes = "; ".join(
        f"at r = {fmt(c['ratio'])} from {FAMILY_TITLES[c['below']]} (K={c['k_below']}) to "
        f"{FAMILY_TITLES[c['above']]} (K={c['k_above']})"
        for c in crossovers
    )
    return f"The best family changes {changes}."


def section_device_choice(summary: dict[str, Any]) -> Section:
    """The choice on the serving device: figure, text and tables (a note without a device)."""
    section = Section("choice", "Drafter family for the serving device")
    section.blocks.append(f"<p><strong>{device_choice_text(summary)}</strong></p>")
    if summary.get("by_family"):
        section.blocks.append(figures_table(summary["by_family"]))
    if "curve" not in summary:
        section.notes.append(summary["why_none"])
        return section
    curve = summary["curve"]
    if curve.get("assumed"):
        section.notes.append(
            f"{summary['why_none']}. The figure and the table: {curve['assumed']}."
        )
    titled = {FAMILY_TITLES[f]: line for f, line in curve["families"].items()}
    section.figure = device_curve_figure({**curve, "families": titled}, summary["crossovers"])
    section.blocks.append(f"<p>{crossovers_text(summary['crossovers'])}</p>")
    section.blocks.append(
        "<p>Tokens per target step = tau / (v + d r): tau the emitted tokens per round in vLLM "
        "(greedy, over the depths the run's answers reach, weighted as above), v the device's time of verifying K + 1 tokens over one "
        "plain decode step, d the drafter's forwards per round (EAGLE-3 K, P-EAGLE and DFlash "
        "one), r its forward over the target's decode step (report.device; docs/report.md). "
        "The figure: each family at its best K at each r against r, the device's r dashed (with "
        "report.device), the crossovers dotted.</p>"
    )
    return section
