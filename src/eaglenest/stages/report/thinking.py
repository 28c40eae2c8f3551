"""The report's thinking-mode section: the mode each drafter was trained in, its acceptance in
each mode the held-out prompts were decoded in (our live loop, vLLM greedy and sampled), and
what the other mode costs (eval{suffix}/metrics.json `thinking`, stages/evaluate/thinking.py;
common/thinking.py: why it matters). Shown only when an evaluation holds it; tables only."""

from __future__ import annotations

from typing import Any

from eaglenest.stages.report.data import RunData
from eaglenest.stages.report.family_files import FAMILY_TITLES
from eaglenest.stages.report.page import Section, fmt, key_values, pct, table

# The ways a mode's figures were measured, as metrics.json `thinking.modes.<mode>` keys them.
WAYS = {"live": "live", "engine": "vLLM, greedy", "sampled": "vLLM, sampled"}
MODE_TEXT = {"on": "thinking on", "off": "thinking off", "mixed": "both modes"}


def trained_text(trained: dict[str, Any]) -> str:
    """The drafter's training mode and its samples per mode ("thinking on (all 40 samples)",
    "mixed (on 30, off 10)")."""
    mode, samples = trained.get("mode"), trained.get("samples") or {}
    if mode in ("on", "off"):
        return f"{MODE_TEXT[mode]} (all {fmt(samples.get(mode))} samples)"
    counts = ", ".join(f"{name} {fmt(n)}" for name, n in samples.items())
    return f"{mode} ({counts or 'no samples'})"


def _ks(thinking: dict[str, Any]) -> list[str]:
    found = {
        k for figures in thinking["modes"].values() for way in WAYS for k in figures.get(way) or {}
    }
    return sorted(found, key=int)


def cost_sentence(label: str, thinking: dict[str, Any]) -> str | None:
    """What serving in the other mode costs, at the largest K (vLLM's figure where it has one)."""
    ratios = thinking.get("other_vs_generated") or {}
    for way in ("engine", "live"):
        at_k = {k: r for k, r in (ratios.get(way) or {}).items() if r is not None}
        if at_k:
            k = max(at_k, key=int)
            generated, other = (MODE_TEXT[thinking[key]] for key in ("heldout_mode", "other_mode"))
            return (
                f"{label}: with {other}, its acceptance length is {pct(at_k[k])} of that with "
                f"{generated} (K={k}, {WAYS[way]})."
            )
    return None


def figures_rows(label: str, thinking: dict[str, Any], ks: list[str]) -> list[list[Any]]:
    """A row per mode (the generated one first) and way: the prompts and tokens decoded, and
    acceptance length and emitted tokens per round at each K."""
    trained = (thinking.get("trained") or {}).get("mode")
    order = [thinking.get("heldout_mode"), thinking.get("other_mode")]
    rows = []
    for mode in sorted(thinking["modes"], key=lambda m: order.index(m) if m in order else 2):
        figures = thinking["modes"][mode]
        name = f"{mode} (trained in)" if mode == trained else mode
        for way, way_name in WAYS.items():
            per_k = figures.get(way)
            if not per_k:
                continue
            cells: list[Any] = []
            for k in ks:
                each = per_k.get(k) or {}
                cells += [each.get("acceptance_length"), each.get("emitted_per_round")]
            first = next(iter(per_k.values()))
            rows.append([label, name, way_name, first.get("prompts"), first.get("tokens"), *cells])
    return rows


def summary_rows(label: str, thinking: dict[str, Any]) -> list[tuple[str, Any]]:
    other = thinking.get("other_mode")
    rendered = (
        f"{other}: {fmt(thinking.get('other_prompts'))} held-out prompts rendered with "
        f"{thinking.get('switch')}: {str(other == 'on').lower()}"
        if other
        else f"none ({thinking.get('skipped')})"
    )
    return [
        (f"{label}: trained in (its training samples)", trained_text(thinking["trained"])),
        (f"{label}: held-out prompts generated in", thinking.get("heldout_mode") or "–"),
        (f"{label}: the other mode", rendered),
    ]


def section_thinking(data: RunData) -> Section | None:
    """The thinking modes of every evaluated family; None when no metrics.json holds them."""
    by_label = {
        FAMILY_TITLES[family]: data.families[family].eval["thinking"]
        for family in data.evaluated_families()
        if data.families[family].eval.get("thinking")
    }
    if not by_label:
        return None
    section = Section("thinking", "Thinking mode: trained in, and served in the other")
    ks = sorted({k for thinking in by_label.values() for k in _ks(thinking)}, key=int)
    sentences = [cost_sentence(label, t) for label, t in by_label.items()]
    section.blocks += [f"<p><strong>{s}</strong></p>" for s in sentences if s]
    section.blocks.append(
        key_values([row for label, t in by_label.items() for row in summary_rows(label, t)])
    )
    header = ["drafter", "mode", "measured", "prompts", "tokens"]
    for k in ks:
        header += [f"K={k} acceptance length", f"K={k} tokens / round"]
    rows = [row for label, t in by_label.items() for row in figures_rows(label, t, ks)]
    if rows:
        section.blocks.append(table(header, rows))
    section.blocks.append(
        "<p>The other mode's prompts are the held-out prompts with the chat template's "
        "generation-prompt tail swapped (its thinking switch the other way), decoded by the "
        "same live loop and vLLM engines. A drafter trained in one mode and served in the "
        "other accepts less (z-lab's DFlash on Qwen3-8B: 25% against 60%).</p>"
    )
    for label, thinking in by_label.items():
        if thinking.get("not_flipped"):
            section.notes.append(
                f"{label}: {thinking['not_flipped']} held-out prompts end as the template "
                "renders neither mode: left out of the other mode."
            )
        if (thinking.get("trained") or {}).get("mode") == "unknown":
            section.notes.append(
                f"{label}: some training tokens were written before the mode was recorded: "
                "the mode it was trained in is unknown."
            )
    return section
