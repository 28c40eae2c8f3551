"""The report page: HTML pieces (numbers as the page prints them, tables), the `Section` each part
of the page is made of, the key figures at the top, and the page itself, one self-contained file
with the plots embedded as base64 PNG.
"""

from __future__ import annotations

import base64
import html
import math
from dataclasses import dataclass, field
from typing import Any

from matplotlib.figure import Figure

from eaglenest.stages.report.data import RunData, funnel_counts, hidden_totals, value_counts


def fmt(value: Any) -> str:
    """Numbers as the report prints them: integers with separators, floats to 3 significant
    digits (4 above 1000 would add noise, so they are rounded to integers)."""
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.3g}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(fmt(v) for v in value) + "]"
    if isinstance(value, dict):
        return ", ".join(f"{k}: {fmt(v)}" for k, v in value.items()) or "none"
    return str(value)


def pct(share: float | None, digits: int = 1) -> str:
    return "–" if share is None else f"{100 * share:.{digits}f}%"


def table(header: list[str] | None, rows: list[list[Any]]) -> str:
    head = ""
    if header:
        head = (
            "<thead><tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in header) + "</tr></thead>"
        )
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(fmt(c))}</td>" for c in row) + "</tr>" for row in rows
    )
    return f"<table>{head}<tbody>{body}</tbody></table>"


def key_values(pairs: list[tuple[str, Any]]) -> str:
    return table(None, [[k, v] for k, v in pairs])


def size_text(n_bytes: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n_bytes >= scale:
            return f"{n_bytes / scale:.2f} {unit}"
    return f"{n_bytes} bytes"


@dataclass
class Section:
    """One part of the report: a plot (None: the section is a note), tables and notes."""

    name: str
    title: str
    figure: Figure | None = None
    blocks: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def key_figures(data: RunData) -> dict[str, Any]:
    """The handful of numbers a reader wants first; also returned by build_report."""
    figures: dict[str, Any] = {}
    stages = dict(funnel_counts(data))
    for name in ("requested (in shards)", "validated", "tokenized"):
        if name in stages:
            figures[name] = stages[name]
    if data.probe:
        figures["reasoning field (probe)"] = data.probe.get("reasoning_field")
    if data.tokens is not None:
        figures["token source"] = value_counts(data.tokens["token_source"])
        figures["tokens (validated samples)"] = int(data.tokens["n_tokens"].sum())
    compared = sum(
        (r.get("agreement") or {}).get("compared", 0) for r in data.tokens_reports.values()
    )
    exact = sum((r.get("agreement") or {}).get("exact", 0) for r in data.tokens_reports.values())
    stripped = sum(r.get("parser_stripped_whitespace", 0) for r in data.tokens_reports.values())
    if compared:
        figures["server/rebuild agreement"] = pct(exact / compared)
    if stripped:
        # Said apart from the agreement, which puts the stripped whitespace back first.
        figures["whitespace stripped by the reasoning parser (samples)"] = stripped
    if data.draft_vocab:
        # Two decimals: a coverage of 0.9996 must not read as 100%.
        figures["draft vocabulary coverage"] = pct(data.draft_vocab["coverage"], 2)
    if data.hidden:
        figures["hidden bytes per token"] = hidden_totals(data.hidden.values())[2]
    if data.train_report:
        figures["training steps"] = data.train_report["steps"]
        figures["held-out accuracy per TTT step"] = data.train_report.get("heldout_acc")
    if data.eval:
        # The serving engine's figure first: the one users get in production (our live loop can
        # part from it, docs/vllm-cpu.md known issues).
        engine = data.eval.get("engine") or {}
        for k in (str(k) for k in data.eval["ks"]):
            served = (engine.get("per_k") or {}).get(k)
            if served:
                name = engine.get("engine", "engine")
                figures[f"acceptance length K={k} ({name})"] = served["acceptance_length"]
        for k in (str(k) for k in data.eval["ks"]):
            figures[f"acceptance length K={k} (simulated)"] = data.eval["simulated"][k][
                "acceptance_length"
            ]
            live = (data.eval.get("live") or {}).get(k)
            if live:
                figures[f"acceptance length K={k} (live)"] = live["acceptance_length"]
                figures[f"speedup K={k} (live)"] = live.get("speedup")
    return figures


STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1200px; color: #222; }
h1 { margin-bottom: 0.2em; } h2 { border-bottom: 1px solid #ccc; margin-top: 2em; }
table { border-collapse: collapse; margin: 0.8em 0; font-size: 0.9em; }
th, td { border: 1px solid #ddd; padding: 0.25em 0.6em; text-align: left; }
th { background: #f3f3f3; } img { max-width: 100%; }
.note { background: #fff6dd; border-left: 4px solid #e0b000; padding: 0.4em 0.8em; }
pre { background: #f6f6f6; padding: 0.6em; overflow-x: auto; font-size: 0.8em; }
"""


def render_html(
    run: str, figures: dict[str, Any], sections: list[Section], images: dict[str, bytes]
) -> str:
    """The page: key figures, then each section (notes, its plot from `images`, tables)."""
    parts = [
        "<!DOCTYPE html>",
        "<html lang='en'><head><meta charset='utf-8'>",
        f"<title>eaglenest report: {html.escape(run)}</title><style>{STYLE}</style></head><body>",
        f"<h1>eaglenest run <code>{html.escape(run)}</code></h1>",
        "<h2>Key figures</h2>",
        key_values(list(figures.items())) if figures else "<p class='note'>No figures yet.</p>",
    ]
    for section in sections:
        parts.append(f"<h2 id='{section.name}'>{html.escape(section.title)}</h2>")
        parts += [f"<p class='note'>{html.escape(note)}</p>" for note in section.notes]
        if section.figure is not None:
            data = base64.b64encode(images[section.name]).decode()
            parts.append(
                f"<img alt='{html.escape(section.title)}' src='data:image/png;base64,{data}'>"
            )
        parts += section.blocks
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"
