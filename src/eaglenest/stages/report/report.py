"""The run report: one self-contained HTML page, and one PNG per plot, from a run's files.

It reads what the stages wrote under results/{run}/ (prompt and drop counts, samples, tokens,
hidden-state summaries, generation latencies, training metrics, acceptance) and shows where rows
were lost and why, which reasoning field and token source the data came from, how the rebuilt
tokens agree with the server's, what generation and hidden states cost, how training went and
what the drafter accepts. Plots are embedded in the page as base64 PNG, so the page is one file.

A section whose files are absent (a run not trained yet, live acceptance not measured) renders as
a note; a file that is present but malformed is a `ReportInputError` naming the file.

Every drafter family the run has (drafter{suffix}/, eval{suffix}/) gets its training and
acceptance sections; with more than one evaluated, a families section shows them side by side by
depth. report/summary.json names the family chosen for the serving device (device_choice.py:
vLLM's acceptance, report.device's timings; none without them), for one family too, beside this
machine's own live-loop figures (choice.py, `this_machine`).

This module is the entry (scripts/build_report.py calls `build_report`); the parts live beside it:
inputs.py (which files, reading and checking them; family_files.py which families), data.py
(the loaded run and its numbers), figures.py (the plots), sections.py (each part of the page;
acceptance.py the acceptance one, families.py the families one, sets.py the standard sets and
the drafters compared, thinking.py the thinking modes, device_section.py the choice on the
device), device_choice.py (the family chosen), choice.py (this machine's figures) and page.py
(the HTML).
By hand: `python -m eaglenest.stages.report RUN_DIR` (see __main__.py).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

from eaglenest.common.io import atomic_path, write_json
from eaglenest.settings.families import family_suffix
from eaglenest.settings.report import COLLAPSE_RATIO, DeviceTimings
from eaglenest.stages.report.acceptance import section_acceptance
from eaglenest.stages.report.choice import choose_family
from eaglenest.stages.report.data import RunData
from eaglenest.stages.report.depth_health import depth_health, health_html
from eaglenest.stages.report.device_choice import choose_on_device
from eaglenest.stages.report.device_section import section_device_choice
from eaglenest.stages.report.families import section_families
from eaglenest.stages.report.family_files import FAMILY_TITLES
from eaglenest.stages.report.figures import note_figure, png_bytes
from eaglenest.stages.report.inputs import RunFiles, load_run
from eaglenest.stages.report.page import Section, fmt, key_figures, render_html
from eaglenest.stages.report.sections import SECTIONS, section_training
from eaglenest.stages.report.sets import sections_sets_and_compare
from eaglenest.stages.report.thinking import section_thinking

log = logging.getLogger(__name__)

# One PNG per plot, named after its section: the report rule declares each as an output. The
# first family's training and acceptance; the families side by side (a card for one family).
PLOT_NAMES = (
    "funnel",
    "lengths",
    "generation",
    "hidden_states",
    "training",
    "acceptance",
    "families",
    "choice",
)
FAMILY_SECTIONS = (section_training, section_acceptance)


def page_sections(data: RunData, summary: dict[str, Any]) -> list[Section]:
    """The page's sections: every section of the first family, each family's own training and
    acceptance after the first's (titled with the family, unless the run is EAGLE-3's alone),
    then the families side by side."""
    others = [family for family in data.families if family != data.family]
    # EAGLE-3's sections alone (its paths the unsuffixed ones) keep their plain titles
    named = bool(others) or family_suffix(data.family) != ""
    sections = []
    health = summary.get("depth_health") or {}
    for make in SECTIONS:
        section = make(data)
        sections.append(section)
        if make not in FAMILY_SECTIONS:
            continue
        if named:
            section.title += f" ({FAMILY_TITLES[data.family]})"
        if make is section_acceptance:
            section.blocks.append(health_html(health.get(data.family), data.family))
        for family in others:
            # The draft vocabulary is every family's: shown once.
            own = make(dataclasses.replace(data.of_family(family), draft_vocab=None))
            own.name += family_suffix(family)
            own.title += f" ({FAMILY_TITLES[family]})"
            if make is section_acceptance:
                own.blocks.append(health_html(health.get(family), family))
            sections.append(own)
    families = section_families(data, summary)
    if families is not None:
        sections.append(families)
    sections.append(section_device_choice(summary))
    thinking = section_thinking(data)  # only when metrics.json records the thinking mode
    return sections + ([thinking] if thinking else []) + sections_sets_and_compare(data)


def run_summary(
    data: RunData,
    run: str,
    device: DeviceTimings | None = None,
    collapse_ratio: float = COLLAPSE_RATIO,
) -> dict[str, Any]:
    """report/summary.json: the families evaluated and the one chosen for the serving `device`
    (device_choice.py; null without it), this machine's own live-loop figures
    (`this_machine`, choice.py: what its fastest family is here, never the choice), and each
    family's depth health (`depth_health`, depth_health.py: collapse by depth, kind, fix)."""
    evaluated = {family: data.families[family].eval for family in data.evaluated_families()}
    here = choose_family(evaluated, data.tokens)
    here["fastest_here"] = here.pop("choice")
    return {
        "run": run,
        **choose_on_device(evaluated, device, data.tokens),
        "this_machine": here,
        "depth_health": depth_health(data, collapse_ratio),
    }


def _write_bytes(path: Path, content: bytes) -> None:
    with atomic_path(path) as tmp:
        tmp.write_bytes(content)


def build_report(
    files: RunFiles,
    out_html: str | Path,
    plots: dict[str, str | Path] | None = None,
    run: str = "",
    summary: str | Path | None = None,
    device: DeviceTimings | None = None,
    collapse_ratio: float = COLLAPSE_RATIO,
) -> dict[str, Any]:
    """Write the report page, one PNG per name in PLOT_NAMES and the run's summary (`summary`,
    default summary.json beside the page: the family chosen for `device`, report.device's
    timings; none without them; `collapse_ratio`: report.collapse_ratio, depth_health.py);
    return the key figures.

    `plots` maps plot names to PNG paths (default: beside the page, `<name>.png`). A section with
    nothing to plot still gets its PNG (a card saying why), so every declared output exists; the
    page shows the note instead of that card. The page embeds its images and links no file.
    """
    out_html = Path(out_html)
    run = run or out_html.parent.parent.name
    plots = {name: Path(p) for name, p in (plots or {}).items()}
    unknown = set(plots) - set(PLOT_NAMES)
    if unknown:
        raise ValueError(f"unknown plot names {sorted(unknown)}; known: {list(PLOT_NAMES)}")
    data = load_run(files)
    run_figures = run_summary(data, run, device, collapse_ratio)
    sections = page_sections(data, run_figures)
    images = {}
    for section in sections:
        if section.figure is not None:
            images[section.name] = png_bytes(section.figure)
    for name in PLOT_NAMES:
        image = images.get(name) or png_bytes(note_card(name, sections, data))
        _write_bytes(plots.get(name, out_html.parent / f"{name}.png"), image)
    write_json(Path(summary) if summary else out_html.parent / "summary.json", run_figures)
    figures = key_figures(data)
    if len(data.evaluated_families()) > 1:
        figures["drafter family chosen"] = chosen_text(run_figures)
    notes = [f"{s.name}: {' '.join(s.notes)}" for s in sections if s.figure is None]
    log.info("report of run %s: %s", run, json.dumps(figures, default=str))
    for note in notes:
        log.info("no plot for %s", note)
    page = render_html(run, figures, sections, images)
    _write_bytes(out_html, page.encode())
    return figures


def note_card(name: str, sections: list[Section], data: RunData) -> Any:
    """The PNG of a plot the run has nothing for: its section's title and notes."""
    section = next((s for s in sections if s.name == name), None)
    if section is None:  # the families section, absent from the page for one family
        families = ", ".join(FAMILY_TITLES[f] for f in data.evaluated_families()) or "none"
        text = f"Fewer than two drafter families evaluated ({families}): nothing side by side."
        return note_figure("Drafter families by depth", text)
    return note_figure(section.title, " ".join(section.notes))


def chosen_text(summary: dict[str, Any]) -> str:
    choice = summary["choice"]
    if choice is None:
        return f"none ({summary['why_none']})"
    rate = fmt(choice["tokens_per_target_step"])
    return (
        f"{FAMILY_TITLES[choice['family']]} K={choice['k']} ({rate} tokens per target step on "
        f"{choice['device']})"
    )
