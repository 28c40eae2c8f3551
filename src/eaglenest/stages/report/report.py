"""The run report: one self-contained HTML page, and one PNG per plot, from a run's files.

It reads what the stages wrote under results/{run}/ (prompt and drop counts, samples, tokens,
hidden-state summaries, generation latencies, training metrics, acceptance) and shows where rows
were lost and why, which reasoning field and token source the data came from, how the rebuilt
tokens agree with the server's, what generation and hidden states cost, how training went and
what the drafter accepts. Plots are embedded in the page as base64 PNG, so the page is one file.

A section whose files are absent (a run not trained yet, live acceptance not measured) renders as
a note; a file that is present but malformed is a `ReportInputError` naming the file.

This module is the entry (scripts/build_report.py calls `build_report`); the parts live beside it:
inputs.py (which files, reading and checking them), data.py (the loaded run and its numbers),
figures.py (the plots), sections.py (each part of the page; acceptance.py the acceptance one)
and page.py (the HTML).
By hand: `python -m eaglenest.stages.report RUN_DIR` (see __main__.py).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from eaglenest.common.io import atomic_path
from eaglenest.stages.report.figures import note_figure, png_bytes
from eaglenest.stages.report.inputs import RunFiles, load_run
from eaglenest.stages.report.page import key_figures, render_html
from eaglenest.stages.report.sections import SECTIONS

log = logging.getLogger(__name__)

# One PNG per plot, named after its section: the report rule declares each as an output.
PLOT_NAMES = ("funnel", "lengths", "generation", "hidden_states", "training", "acceptance")


def _write_bytes(path: Path, content: bytes) -> None:
    with atomic_path(path) as tmp:
        tmp.write_bytes(content)


def build_report(
    files: RunFiles,
    out_html: str | Path,
    plots: dict[str, str | Path] | None = None,
    run: str = "",
) -> dict[str, Any]:
    """Write the report page and one PNG per name in PLOT_NAMES; return the key figures.

    `plots` maps plot names to PNG paths (default: beside the page, `<name>.png`). A section with
    nothing to plot still gets its PNG (a card saying why), so every declared output exists; the
    page shows the note instead of that card. The page embeds its images and links no file.
    """
    out_html = Path(out_html)
    plots = {name: Path(p) for name, p in (plots or {}).items()}
    unknown = set(plots) - set(PLOT_NAMES)
    if unknown:
        raise ValueError(f"unknown plot names {sorted(unknown)}; known: {list(PLOT_NAMES)}")
    data = load_run(files)
    sections = [make(data) for make in SECTIONS]
    images = {}
    for section in sections:
        if section.figure is not None:
            images[section.name] = png_bytes(section.figure)
    for name in PLOT_NAMES:
        section = next(s for s in sections if s.name == name)
        image = images.get(name) or png_bytes(note_figure(section.title, " ".join(section.notes)))
        _write_bytes(plots.get(name, out_html.parent / f"{name}.png"), image)
    figures = key_figures(data)
    notes = [f"{s.name}: {' '.join(s.notes)}" for s in sections if s.figure is None]
    log.info("report of run %s: %s", run, json.dumps(figures, default=str))
    for note in notes:
        log.info("no plot for %s", note)
    page = render_html(run or out_html.parent.parent.name, figures, sections, images)
    _write_bytes(out_html, page.encode())
    return figures
