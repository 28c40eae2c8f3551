"""The report's drafter families section: the families the run evaluated side by side by depth
(live acceptance, emitted tokens per round, the drafter's and the target's time per round,
tokens per target step), and the run's choice among them (choice.py, report/summary.json).
A run of one family has no such section: its own acceptance section says it all."""

from __future__ import annotations

from typing import Any

from eaglenest.stages.report.choice import DepthFigures, depth_figures
from eaglenest.stages.report.data import RunData
from eaglenest.stages.report.family_files import FAMILY_TITLES
from eaglenest.stages.report.figures import families_figure
from eaglenest.stages.report.page import Section, fmt, table


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else 1000 * seconds


def choice_text(summary: dict[str, Any]) -> str:
    """This machine's fastest family in one sentence (or why none was timed): `summary` is
    summary.json's `this_machine`. Never the choice: that is the serving device's."""
    choice = summary["fastest_here"]
    if choice is None:
        return f"No family timed on this machine: {summary['why_none']}."
    shares = ", ".join(
        f"{depth}: {100 * share:.0f}%" for depth, share in choice["depth_weights"].items()
    )
    return (
        f"Fastest on this machine: {FAMILY_TITLES[choice['family']]} at K={choice['k']}, "
        f"{fmt(choice['tokens_per_target_step'])} tokens per target step "
        f"({fmt(choice['tokens_per_s'])} tokens/s here) at the depths the answers reach "
        f"(depth: share of the run's generated tokens: {shares}). This machine's live loop, "
        "not the serving device's: the choice is below (Drafter family for the serving "
        "device)."
    )


def choice_table(summary: dict[str, Any]) -> str:
    """Per family and K: this machine's mixed figures (`this_machine`), its fastest marked."""
    chosen = summary["fastest_here"] or {}
    rows = []
    for family, figures in summary["families"].items():
        for k, at_k in figures["per_k"].items():
            mark = (
                "fastest here"
                if (family, int(k)) == (chosen.get("family"), chosen.get("k"))
                else ""
            )
            if not mark and k == figures["best_k"]:
                mark = "its best K"
            rows.append(
                [
                    FAMILY_TITLES[family],
                    k,
                    at_k["tokens_per_target_step"],
                    at_k["tokens_per_s"],
                    ", ".join(at_k["depth_weights"]) or "–",
                    mark,
                ]
            )
    header = ["family", "K", "tokens per target step", "tokens / s", "depths timed", ""]
    return table(header, rows)


def depth_rows(family: str, k: str, rows: list[DepthFigures]) -> list[list[Any]]:
    return [
        [
            FAMILY_TITLES[family],
            k,
            row.depth,
            row.prompts,
            row.acceptance_length,
            row.emitted_per_round,
            row.engine_emitted_per_round,
            _ms(row.drafter_s_per_round),
            _ms(row.target_s_per_round),
            _ms(row.greedy_s_per_token),
            row.tokens_per_target_step,
        ]
        for row in rows
    ]


DEPTH_HEADER = [
    "family",
    "K",
    "depth",
    "prompts",
    "live acceptance length",
    "emitted tokens / round, live",
    "emitted tokens / round, engine",
    "drafter ms / round",
    "target ms / round",
    "target's greedy ms / token",
    "tokens per target step",
]


def shard_notes(data: RunData, families: list[str]) -> list[str]:
    """A family trained on other shards than the first (a family taken out of train.families
    keeps the files of its last run): its figures compare less."""
    shards = {
        family: tuple((data.families[family].train_report or {}).get("train_shards") or ())
        for family in families
    }
    first = families[0]
    return [
        f"{FAMILY_TITLES[family]} was trained on other shards than {FAMILY_TITLES[first]} "
        f"({len(shards[family])} against {len(shards[first])}): a family taken out of "
        "train.families keeps the files of its last run."
        for family in families[1:]
        if shards[family] != shards[first]
    ]


def section_families(data: RunData, summary: dict[str, Any]) -> Section | None:
    """The families side by side by depth and the choice; None for a run of one family."""
    families = data.evaluated_families()
    if len(families) < 2:
        return None
    section = Section("families", "Drafter families by depth, on this machine")
    by_family = {f: depth_figures(data.families[f].eval) for f in families}
    plotted = {}
    for family, per_k in by_family.items():
        plotted[FAMILY_TITLES[family]] = {
            k: [row.as_dict() for row in rows] for k, rows in per_k.items()
        }
    section.figure = families_figure(plotted)
    here = summary["this_machine"]
    section.blocks.append(f"<p><strong>{choice_text(here)}</strong></p>")
    section.blocks.append(choice_table(here))
    section.blocks.append("<h3>By depth</h3>")
    rows = []
    for family, per_k in by_family.items():
        for k, figures in per_k.items():
            rows += depth_rows(family, k, figures)
    section.blocks.append(table(DEPTH_HEADER, rows))
    section.blocks.append(
        "<p>Our own live loop per family, K and depth (depth 0: from the prompt). Drafter ms: "
        "its propose and accept calls a round (EAGLE-3 drafts in K forwards, P-EAGLE and DFlash "
        "in one); target ms: the rest of the round, its verification forward; tokens per target "
        "step: emitted tokens per round over the round's time in the target's own greedy steps "
        "(the decoding speed-up over plain greedy) on this machine. Its figure weights each depth "
        "by the share of the run's generated tokens that lie from it to the next depth timed, "
        "and takes total tokens over total time (report/summary.json `this_machine`, "
        "docs/report.md).</p>"
    )
    section.notes += shard_notes(data, families)
    return section
