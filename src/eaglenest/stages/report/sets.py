"""The report's standard sets and compared drafters: a table per set (evaluate.sets) with every
drafter's acceptance length and emitted tokens per round in vLLM, per K, over the whole set and
per category (eval{suffix}/metrics.json `sets`, eval_compare/{name}.json `sets`); and the
drafters trained elsewhere (evaluate.compare) beside the run's own on the held-out prompts and
their depth cuts. Tables only: the figures are few, and a table carries their exact values."""

from __future__ import annotations

import html
from typing import Any

from eaglenest.stages.report.data import RunData
from eaglenest.stages.report.family_files import FAMILY_TITLES
from eaglenest.stages.report.page import Section, fmt, table


def drafters(data: RunData) -> dict[str, dict[str, Any]]:
    """Every evaluated drafter's metrics by its label: the run's families, then those compared."""
    labelled = {
        FAMILY_TITLES[family]: data.families[family].eval for family in data.evaluated_families()
    }
    labelled.update({f"{name} (compared)": metrics for name, metrics in data.compare.items()})
    return labelled


def _ks(per_k_maps: list[dict[str, Any]]) -> list[str]:
    return sorted({k for per_k in per_k_maps for k in per_k}, key=int)


def _cells(per_k: dict[str, Any], ks: list[str]) -> list[Any]:
    cells: list[Any] = []
    for k in ks:
        figures = per_k.get(k) or {}
        cells += [fmt(figures.get("acceptance_length")), fmt(figures.get("emitted_per_round"))]
    return cells


def set_table(name: str, by_drafter: dict[str, dict[str, Any]]) -> str:
    """One set: a row per drafter over the whole set, then one per category; greedy, then
    sampled at each temperature the engines sampled at."""
    tables = {}  # (drafter, temperature) -> its figures by K and by category
    for label, figures in by_drafter.items():
        tables[label, "greedy"] = figures["engine"]
        for temperature, sampled in (figures.get("sampled") or {}).items():
            tables[label, f"sampled at {fmt(float(temperature))}"] = sampled
    ks = _ks([each["per_k"] for each in tables.values()])
    header = ["drafter", "decoding", "category"]
    for k in ks:
        header += [f"K={k} acceptance length", f"K={k} tokens / round"]
    rows = []
    for (label, decoding), each in tables.items():
        rows.append([label, decoding, "all", *_cells(each["per_k"], ks)])
        for category, per_k in each["by_category"].items():
            rows.append([label, decoding, category, *_cells(per_k, ks)])
    return f"<h3>{html.escape(name)}</h3>" + table(header, rows)


def section_sets(data: RunData) -> Section | None:
    """The standard sets' tables; None when no drafter was decoded on a set."""
    by_set: dict[str, dict[str, dict[str, Any]]] = {}
    for label, metrics in drafters(data).items():
        for name, figures in (metrics.get("sets") or {}).items():
            by_set.setdefault(name, {})[label] = figures
    if not by_set:
        return None
    section = Section("sets", "Standard sets: acceptance in vLLM per set and category")
    for name, by_drafter in by_set.items():
        first = next(iter(by_drafter.values()))
        section.blocks.append(set_table(name, by_drafter))
        section.notes.append(
            f"{name}: {first['prompts']} prompts, {first['turns']} turns "
            f"({first['multi_turn_prompts']} prompts of several turns, each later turn after "
            f"the target's own answers), temperature {fmt(first['temperature'])}."
        )
        for label, figures in by_drafter.items():
            for k, per_k in figures["engine"]["per_k"].items():
                if per_k.get("identical_to_plain") is False:
                    section.notes.append(
                        f"{name}, {label}, K={k}: the speculative answers differ from the plain "
                        "ones (identical_to_plain false)."
                    )
    sampled = any(f.get("sampled") for each in by_set.values() for f in each.values())
    section.notes.append(
        f"Decoded in vLLM only, greedy{' and sampled (seeded per prompt)' if sampled else ''}: "
        + next(iter(next(iter(by_set.values())).values()))["live"]
    )
    return section


def section_compare(data: RunData) -> Section | None:
    """The drafters of evaluate.compare beside the run's own on the held-out prompts (and by
    depth); None when the run compares none."""
    if not data.compare:
        return None
    section = Section("compare", "Drafters compared: held-out prompts in vLLM")
    labelled = {
        label: metrics.get("engine") or {}
        for label, metrics in drafters(data).items()
        if metrics.get("engine")
    }
    ks = _ks([engine.get("per_k") or {} for engine in labelled.values()])
    header = ["drafter", "method"]
    for k in ks:
        header += [f"K={k} acceptance length", f"K={k} tokens / round"]
    rows = []
    for label, engine in labelled.items():
        described = (data.compare.get(label.removesuffix(" (compared)")) or {}).get("described")
        rows.append([label, described or "this run's", *_cells(engine.get("per_k") or {}, ks)])
        for k, reason in (engine.get("not_served") or {}).items():
            section.notes.append(f"{label}, K={k}: not served here: {reason}")
    section.blocks.append(table(header, rows))
    depth_rows = []
    for name, metrics in data.compare.items():
        for depth, per_k in ((metrics.get("engine") or {}).get("by_depth") or {}).items():
            depth_rows.append([f"{name} (compared)", depth, *_cells(per_k, ks)])
    if depth_rows:
        section.blocks.append("<h3>Compared drafters by generated depth</h3>")
        section.blocks.append(table(["drafter", "depth", *header[2:]], depth_rows))
    return section


def sections_sets_and_compare(data: RunData) -> list[Section]:
    """The sections this module adds to the page (none when the run has neither)."""
    return [s for s in (section_sets(data), section_compare(data)) if s is not None]
