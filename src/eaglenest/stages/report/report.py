"""The run report: one self-contained HTML page, and one PNG per plot, from a run's files.

It reads what the stages wrote under results/{run}/ (prompt and drop counts, samples, tokens,
hidden-state summaries, generation latencies, training metrics, acceptance) and shows where rows
were lost and why, which reasoning field and token source the data came from, how the rebuilt
tokens agree with the server's, what generation and hidden states cost, how training went and
what the drafter accepts. Plots are embedded in the page as base64 PNG, so the page is one file.

A section whose files are absent (a run not trained yet, live acceptance not measured) renders as
a note; a file that is present but malformed is a `ReportInputError` naming the file.
"""

from __future__ import annotations

import argparse
import base64
import html
import io
import json
import logging
import math
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from eaglenest.common.io import atomic_path
from eaglenest.formats.lengths import (
    CHAR_LENGTHS,
    COMPLETION_LEN,
    SAMPLE_LENGTH_COLUMNS,
    TOKEN_LENGTH_COLUMNS,
    read_shard_lengths,
)

log = logging.getLogger(__name__)

# One PNG per plot, named after it: the report rule declares each as an output.
PLOT_NAMES = ("funnel", "lengths", "generation", "hidden_states", "training", "acceptance")
BASELINE_NAMES = ("untrained", "prompt_lookup")


class ReportInputError(ValueError):
    """A file the report reads is malformed; the message names the file and what is wrong."""


# ---------------------------------------------------------------------------------------------
# Which files: explicit lists (the rule's inputs), or found in a run directory
# ---------------------------------------------------------------------------------------------


def _paths(values: str | Path | Iterable[str | Path] | None) -> list[Path]:
    if isinstance(values, (str, Path)):
        return [Path(values)]
    return [Path(v) for v in values or []]


def _optional(value: str | Path | None) -> Path | None:
    return Path(value) if value else None


@dataclass
class RunFiles:
    """The files a report reads. Any list may be empty and any path None: that section is a note.

    Shard files are matched by their shard id (the file name up to the first dot). Benchmark tables
    (Snakemake's `benchmark:` of generate) are optional: those that do not exist are skipped.
    """

    prompts_report: Path | None = None
    probe: Path | None = None
    raw: list[Path] = field(default_factory=list)
    samples: list[Path] = field(default_factory=list)
    samples_reports: list[Path] = field(default_factory=list)
    tokens: list[Path] = field(default_factory=list)
    tokens_reports: list[Path] = field(default_factory=list)
    lengths: list[Path] = field(default_factory=list)
    hidden_summaries: list[Path] = field(default_factory=list)
    generate_benchmarks: list[Path] = field(default_factory=list)
    train_metrics: Path | None = None
    train_report: Path | None = None
    eval_metrics: Path | None = None

    def __post_init__(self) -> None:
        for name in ("prompts_report", "probe", "train_metrics", "train_report", "eval_metrics"):
            setattr(self, name, _optional(getattr(self, name)))
        for name in ("raw", "samples", "samples_reports", "tokens", "tokens_reports", "lengths"):
            setattr(self, name, _paths(getattr(self, name)))
        self.hidden_summaries = _paths(self.hidden_summaries)
        self.generate_benchmarks = _paths(self.generate_benchmarks)

    @classmethod
    def from_run_dir(
        cls, run_dir: str | Path, benchmarks_dir: str | Path | None = None
    ) -> RunFiles:
        """Every report input that exists in results/{run}/ (and benchmarks/{run}/)."""
        run_dir = Path(run_dir)

        def shard_files(folder: str, suffix: str) -> list[Path]:
            return sorted((run_dir / folder).glob(f"[0-9][0-9][0-9][0-9][0-9]{suffix}"))

        def existing(relative: str) -> Path | None:
            path = run_dir / relative
            return path if path.exists() else None

        benchmarks = []
        if benchmarks_dir is not None:
            benchmarks = sorted((Path(benchmarks_dir) / "generate").glob("*.tsv"))
        return cls(
            prompts_report=existing("prompts/report.json"),
            probe=existing("probe.json"),
            raw=shard_files("raw", ".parquet"),
            samples=shard_files("samples", ".parquet"),
            samples_reports=shard_files("samples", ".report.json"),
            tokens=shard_files("tokens", ".parquet"),
            tokens_reports=shard_files("tokens", ".report.json"),
            lengths=shard_files("tokens", ".lengths.parquet"),
            hidden_summaries=shard_files("hidden", ".json"),
            generate_benchmarks=benchmarks,
            train_metrics=existing("drafter/metrics.jsonl"),
            train_report=existing("drafter/train_report.json"),
            eval_metrics=existing("eval/metrics.json"),
        )


def shard_of(path: Path) -> str:
    return path.name.split(".")[0]


# ---------------------------------------------------------------------------------------------
# Reading and checking files: every error names the file
# ---------------------------------------------------------------------------------------------


def read_json_file(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ReportInputError(f"{path}: not readable as JSON ({err})") from err


def read_json_object(path: Path) -> dict[str, Any]:
    data = read_json_file(path)
    if not isinstance(data, dict):
        raise ReportInputError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_number_list(value: Any) -> bool:
    return isinstance(value, list) and all(_is_number(v) for v in value)


CHECKS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "number": (_is_number, "a number"),
    "int": (lambda v: isinstance(v, int) and not isinstance(v, bool), "an integer"),
    "numbers": (_is_number_list, "a list of numbers"),
    "str": (lambda v: isinstance(v, str), "a string"),
    "strs": (lambda v: isinstance(v, list) and all(isinstance(s, str) for s in v), "strings"),
    "bool": (lambda v: isinstance(v, bool), "true or false"),
    "object": (lambda v: isinstance(v, dict), "an object"),
}


def check_fields(
    data: Any, where: str, required: dict[str, str], optional: dict[str, str] | None = None
) -> None:
    """Raise ReportInputError unless `data` has the required keys with the right kinds (and the
    optional ones, when present and not null, too)."""
    if not isinstance(data, dict):
        raise ReportInputError(f"{where}: expected a JSON object, got {type(data).__name__}")
    for key, kind in {**required, **(optional or {})}.items():
        if key not in data or data[key] is None:
            if key in required:
                raise ReportInputError(f"{where}: missing {key!r} ({CHECKS[kind][1]})")
            continue
        check, description = CHECKS[kind]
        if not check(data[key]):
            shown = json.dumps(data[key])[:80]
            raise ReportInputError(f"{where}: {key!r} must be {description}, got {shown}")


TRAIN_LINE_FIELDS = {"step": "int", "loss": "number", "acc": "numbers"}
TRAIN_LINE_OPTIONAL = {
    "epoch": "number",
    "lr": "number",
    "loss_tokens": "int",
    "skipped_outside_vocab": "int",
    "tokens_per_s": "number",
    "elapsed_s": "number",
}
TRAIN_REPORT_FIELDS = {"steps": "int", "ttt_steps": "int", "train_acc": "numbers"}
TRAIN_REPORT_OPTIONAL = {
    "epochs": "number",
    "train_tokens": "int",
    "wall_s": "number",
    "tokens_per_s": "number",
    "heldout_acc": "numbers",
    "heldout_loss": "number",
    "skipped_outside_vocab_share": "number",
    "eval_shards": "strs",
    "train_shards": "strs",
}
ACCEPTANCE_FIELDS = {"acceptance_length": "number", "conditional_acceptance": "numbers"}
LIVE_FIELDS = {"acceptance_length": "number"}
LIVE_OPTIONAL = {
    "target_forwards_per_token": "number",
    "speedup": "number",
    "tokens": "int",
    "prompts": "int",
    "identical_to_greedy": "bool",
    "spec_wall_s": "number",
    "greedy_wall_s": "number",
}


def read_train_metrics(path: Path) -> tuple[list[dict], list[dict]]:
    """(train lines, held-out lines) of drafter/metrics.jsonl, each checked against the contract."""
    train, heldout = [], []
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise ReportInputError(f"{path}: not readable ({err})") from err
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{path} line {number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise ReportInputError(f"{where}: not JSON ({err})") from err
        check_fields(record, where, {"split": "str", **TRAIN_LINE_FIELDS}, TRAIN_LINE_OPTIONAL)
        if record["split"] == "train":
            train.append(record)
        elif record["split"] == "heldout":
            heldout.append(record)
        else:
            raise ReportInputError(
                f"{where}: 'split' must be train or heldout, got {record['split']!r}"
            )
    return train, heldout


def read_train_report(path: Path) -> dict[str, Any]:
    report = read_json_object(path)
    check_fields(report, str(path), TRAIN_REPORT_FIELDS, TRAIN_REPORT_OPTIONAL)
    return report


def read_eval_metrics(path: Path) -> dict[str, Any]:
    """eval/metrics.json, checked: simulated acceptance per K, live (or null), baselines."""
    metrics = read_json_object(path)
    check_fields(
        metrics,
        str(path),
        {"ks": "numbers", "simulated": "object"},
        {
            "live": "object",
            "live_skipped_reason": "str",
            "baselines": "object",
            "live_baselines": "object",
        },
    )
    for k in metrics["ks"]:
        key = str(k)
        if key not in metrics["simulated"]:
            raise ReportInputError(f"{path}: 'simulated' has no entry for K={key}")
        check_fields(
            metrics["simulated"][key],
            f"{path} simulated[{key}]",
            ACCEPTANCE_FIELDS,
            {"positions": "int"},
        )
        if metrics.get("live") is not None and key in metrics["live"]:
            check_fields(metrics["live"][key], f"{path} live[{key}]", LIVE_FIELDS, LIVE_OPTIONAL)
        for name, per_k in (metrics.get("live_baselines") or {}).items():
            check_fields(per_k, f"{path} live_baselines[{name}]", {})
            if key in per_k:
                where = f"{path} live_baselines[{name}][{key}]"
                check_fields(per_k[key], where, LIVE_FIELDS, LIVE_OPTIONAL)
        for name, per_k in (metrics.get("baselines") or {}).items():
            check_fields(per_k, f"{path} baselines[{name}]", {})
            if key in per_k:
                check_fields(per_k[key], f"{path} baselines[{name}][{key}]", ACCEPTANCE_FIELDS)
    return metrics


def _scan(path: Path, columns: list[str]) -> pl.DataFrame:
    try:
        frame = pl.read_parquet(path, columns=columns)
    except Exception as err:  # polars raises several kinds for a bad or foreign file
        raise ReportInputError(f"{path}: cannot read columns {columns} ({err})") from err
    return frame.with_columns(pl.lit(shard_of(path)).alias("shard"))


def _concat(paths: list[Path], read: Callable[[Path], pl.DataFrame]) -> pl.DataFrame | None:
    frames = [read(p) for p in paths]
    return pl.concat(frames, how="vertical_relaxed") if frames else None


def read_raw(path: Path) -> pl.DataFrame:
    columns = ["latency_s", "prompt_tokens", "completion_tokens", "attempts", "error_kind"]
    return _scan(path, columns)


def read_sample_lengths(path: Path) -> pl.DataFrame:
    frame = _scan(path, ["reasoning", "content", "reasoning_field"])
    return frame.select("shard", "reasoning_field", *CHAR_LENGTHS)


def read_token_lengths(path: Path) -> pl.DataFrame:
    frame = _scan(path, TOKEN_LENGTH_COLUMNS)
    return frame.with_columns(COMPLETION_LEN)


def _read_lengths(path: Path) -> tuple[pl.DataFrame, pl.DataFrame]:
    try:
        samples, tokens = read_shard_lengths(path)
    except Exception as err:  # polars raises several kinds for a bad or foreign file
        raise ReportInputError(f"{path}: not a lengths file ({err})") from err
    shard = pl.lit(shard_of(path)).alias("shard")
    samples = samples.with_columns(shard).select("shard", *SAMPLE_LENGTH_COLUMNS)
    tokens = tokens.with_columns(shard).select(*TOKEN_LENGTH_COLUMNS, "shard", "completion_len")
    return samples, tokens


def _lengths(files: RunFiles) -> tuple[pl.DataFrame | None, pl.DataFrame | None]:
    """Sample and token lengths: from the lengths files when there are any (the pipeline's
    report), else from the samples and tokens files (a run made before those files existed)."""
    if not files.lengths:
        return _concat(files.samples, read_sample_lengths), _concat(
            files.tokens, read_token_lengths
        )
    pairs = [_read_lengths(p) for p in files.lengths]
    return (
        pl.concat([s for s, _ in pairs], how="vertical_relaxed"),
        pl.concat([t for _, t in pairs], how="vertical_relaxed"),
    )


def read_benchmark_wall_s(path: Path) -> float:
    """Wall seconds of a Snakemake benchmark table (the mean over repeats)."""
    try:
        table = pl.read_csv(path, separator="\t")
        return float(table["s"].mean())
    except Exception as err:
        raise ReportInputError(f"{path}: not a Snakemake benchmark table ({err})") from err


# ---------------------------------------------------------------------------------------------
# The loaded run
# ---------------------------------------------------------------------------------------------


@dataclass
class RunData:
    prompts: dict | None
    probe: dict | None
    samples_reports: dict[str, dict]
    tokens_reports: dict[str, dict]
    hidden: dict[str, dict]
    raw: pl.DataFrame | None
    samples: pl.DataFrame | None
    tokens: pl.DataFrame | None
    generate_wall_s: dict[str, float]
    train_lines: list[dict] | None
    heldout_lines: list[dict] | None
    train_report: dict | None
    eval: dict | None


def _by_shard(paths: list[Path]) -> dict[str, dict]:
    return {shard_of(p): read_json_object(p) for p in sorted(paths)}


def load_run(files: RunFiles) -> RunData:
    train_lines = heldout_lines = None
    if files.train_metrics is not None:
        train_lines, heldout_lines = read_train_metrics(files.train_metrics)
    sample_lengths, token_lengths = _lengths(files)
    return RunData(
        prompts=read_json_object(files.prompts_report) if files.prompts_report else None,
        probe=read_json_object(files.probe) if files.probe else None,
        samples_reports=_by_shard(files.samples_reports),
        tokens_reports=_by_shard(files.tokens_reports),
        hidden=_by_shard(files.hidden_summaries),
        raw=_concat(files.raw, read_raw),
        samples=sample_lengths,
        tokens=token_lengths,
        generate_wall_s={
            shard_of(p): read_benchmark_wall_s(p) for p in files.generate_benchmarks if p.exists()
        },
        train_lines=train_lines,
        heldout_lines=heldout_lines,
        train_report=read_train_report(files.train_report) if files.train_report else None,
        eval=read_eval_metrics(files.eval_metrics) if files.eval_metrics else None,
    )


# ---------------------------------------------------------------------------------------------
# Formatting and HTML pieces
# ---------------------------------------------------------------------------------------------


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


def pct(share: float | None) -> str:
    return "–" if share is None else f"{100 * share:.1f}%"


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


def quantiles(values: pl.Series) -> dict[str, Any]:
    values = values.drop_nulls()
    if values.is_empty():
        return {"n": 0, "mean": None, "median": None, "p90": None, "max": None}
    return {
        "n": values.len(),
        "mean": float(values.mean()),
        "median": float(values.median()),
        "p90": float(values.quantile(0.9, interpolation="linear")),
        "max": values.max(),
    }


@dataclass
class Section:
    """One part of the report: a plot (None: the section is a note), tables and notes."""

    name: str
    title: str
    figure: Figure | None = None
    blocks: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def new_figure(columns: int, width: float = 5.0, height: float = 3.6) -> tuple[Figure, list]:
    figure = Figure(figsize=(width * columns, height), layout="constrained")
    axes = figure.subplots(1, columns, squeeze=False)[0]
    return figure, list(axes)


def note_figure(title: str, text: str) -> Figure:
    """The PNG of a section with nothing to plot: its title and why."""
    figure = Figure(figsize=(6, 2))
    figure.text(0.5, 0.62, title, ha="center", va="center", fontsize=12, weight="bold")
    figure.text(0.5, 0.35, text, ha="center", va="center", fontsize=9, wrap=True)
    return figure


def png_bytes(figure: Figure) -> bytes:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=100)
    return buffer.getvalue()


def _empty_axis(axis, text: str) -> None:
    axis.text(0.5, 0.5, text, ha="center", va="center", transform=axis.transAxes)
    axis.set_xticks([])
    axis.set_yticks([])


def shard_bars(axis, shards: list[str], values: list[float], color: str) -> None:
    """One bar per shard; at most about 20 shard ids on the axis, however many shards."""
    axis.bar(range(len(shards)), values, color=color)
    step = max(1, math.ceil(len(shards) / 20))
    axis.set_xticks(range(0, len(shards), step), shards[::step], rotation=90)


def _sum_reports(reports: Iterable[dict], key: str) -> Counter:
    total: Counter = Counter()
    for report in reports:
        total.update({k: v for k, v in (report.get(key) or {}).items() if v})
    return total


# ---------------------------------------------------------------------------------------------
# Sections
# ---------------------------------------------------------------------------------------------


def funnel_counts(data: RunData) -> list[tuple[str, int]]:
    """How many rows each stage had, in pipeline order (stages without files left out)."""
    stages: list[tuple[str, int]] = []
    if data.prompts:
        stages.append(("prompts read", data.prompts.get("rows_read", data.prompts.get("rows", 0))))
        stages.append(("usable prompts", data.prompts.get("prompts", 0)))
    samples = data.samples_reports.values()
    if samples:
        stages.append(("requested (in shards)", sum(r.get("raw_rows", 0) for r in samples)))
        stages.append(("answered", sum(r.get("answered", 0) for r in samples)))
        stages.append(("validated", sum(r.get("kept", 0) for r in samples)))
    if data.tokens_reports:
        stages.append(("tokenized", sum(r.get("written", 0) for r in data.tokens_reports.values())))
    if data.hidden:
        stages.append(("hidden states", sum(r.get("samples", 0) for r in data.hidden.values())))
    return stages


def drop_counts(data: RunData) -> list[tuple[str, int]]:
    """Every reason a row was dropped, as `stage: reason` with its count over all shards."""
    drops: list[tuple[str, int]] = []
    if data.prompts:
        drops += [(f"prompts: {k}", v) for k, v in (data.prompts.get("skipped") or {}).items() if v]
    drops += [
        (f"validate: {k}", v)
        for k, v in _sum_reports(data.samples_reports.values(), "dropped").items()
    ]
    tokens: Counter = Counter()
    for report in data.tokens_reports.values():
        overlength = report.get("overlength") or {}
        tokens["overlength"] += overlength.get("dropped", 0)
        tokens["prompt_over_max_length"] += overlength.get("dropped_prompt_over_max_length", 0)
        tokens["rebuild_decode_mismatch"] += report.get("dropped_rebuild_decode_mismatch", 0)
    drops += [(f"tokenize: {k}", v) for k, v in tokens.items() if v]
    return drops


def counted_bars(axis, counts: list[tuple[str, int]], color: str) -> None:
    """Horizontal bars, first on top, each labelled with its count; integer ticks."""
    axis.barh([label for label, _ in counts][::-1], [n for _, n in counts][::-1], color=color)
    for y, (_, n) in enumerate(counts[::-1]):
        axis.text(n, y, f" {n:,}", va="center", fontsize=8)
    axis.xaxis.set_major_locator(MaxNLocator(integer=True))
    axis.margins(x=0.15)


def section_funnel(data: RunData) -> Section:
    section = Section("funnel", "Prompts and drops per stage")
    stages, drops = funnel_counts(data), drop_counts(data)
    if not stages:
        section.notes.append("No prompt, samples or tokens reports: nothing ran yet.")
        return section
    figure, (left, right) = new_figure(2, width=5.5)
    counted_bars(left, stages, "#4c72b0")
    left.set_xlabel("rows")
    left.set_title("rows reaching each stage")
    if drops:
        counted_bars(right, drops, "#c44e52")
        right.set_xlabel("rows dropped")
        right.set_title("why rows were dropped")
    else:
        _empty_axis(right, "no row was dropped")
    section.figure = figure
    section.blocks.append(table(["stage", "rows"], [list(s) for s in stages]))
    section.blocks.append(
        table(["drop reason", "rows"], [list(d) for d in drops]) if drops else "<p>No drops.</p>"
    )
    section.blocks.append(shard_table(data))
    truncated = sum(
        (r.get("overlength") or {}).get("truncated", 0) for r in data.tokens_reports.values()
    )
    if truncated:
        section.notes.append(f"{truncated:,} samples were kept but cut at tokenize.max_length.")
    return section


def shard_table(data: RunData) -> str:
    shards = sorted(set(data.samples_reports) | set(data.tokens_reports) | set(data.hidden))
    rows = []
    for shard in shards:
        samples = data.samples_reports.get(shard, {})
        tokens = data.tokens_reports.get(shard, {})
        overlength = tokens.get("overlength") or {}
        rows.append(
            [
                shard,
                samples.get("raw_rows"),
                samples.get("answered"),
                samples.get("kept"),
                fmt(samples.get("dropped")) if samples else None,
                tokens.get("written"),
                overlength.get("dropped"),
                overlength.get("truncated"),
                data.hidden.get(shard, {}).get("samples"),
            ]
        )
    header = [
        "shard",
        "requested",
        "answered",
        "validated",
        "validation drops",
        "tokenized",
        "overlength dropped",
        "truncated",
        "hidden states",
    ]
    return table(header, rows)


def section_lengths(data: RunData) -> Section:
    section = Section("lengths", "Reasoning and content lengths")
    if data.samples is None and data.tokens is None:
        section.notes.append("No samples or tokens files.")
        return section
    figure, axes = new_figure(3, width=4.5)
    stats = []
    if data.samples is not None:
        for axis, column, color in zip(
            axes, ("reasoning_chars", "content_chars"), ("#4c72b0", "#55a868")
        ):
            axis.hist(data.samples[column].to_numpy(), bins=40, color=color)
            axis.set_xlabel(f"{column.split('_')[0]} length (characters)")
            axis.set_ylabel("samples")
            stats.append([column.replace("_", " "), *quantiles(data.samples[column]).values()])
    else:
        for axis in axes[:2]:
            _empty_axis(axis, "no samples files")
    if data.tokens is not None:
        columns = {"prompt_len": "prompt", "completion_len": "completion"}
        bins = np.histogram_bin_edges(data.tokens.select(list(columns)).to_numpy(), bins=40)
        for column, label in columns.items():
            axes[2].hist(data.tokens[column].to_numpy(), bins=bins, alpha=0.6, label=label)
        axes[2].set_xlabel("tokens per sample")
        axes[2].legend()
        for column, label in (("prompt_len", "prompt"), ("completion_len", "completion"),
                              ("n_tokens", "total")):  # fmt: skip
            stats.append([f"{label} tokens", *quantiles(data.tokens[column]).values()])
    else:
        _empty_axis(axes[2], "no tokens files")
    section.figure = figure
    section.blocks.append(table(["", "n", "mean", "median", "p90", "max"], stats))
    return section


def section_sources(data: RunData) -> Section:
    """Tables only: which field carried the reasoning, where the token ids came from, agreement."""
    section = Section("sources", "Reasoning field, token source and agreement")
    pairs: list[tuple[str, Any]] = []
    if data.probe:
        token_ids = data.probe.get("token_ids") or {}
        pairs += [
            ("probe: reasoning field", data.probe.get("reasoning_field")),
            ("probe: token ids returned", token_ids.get("supported")),
            ("probe: token id layout", token_ids.get("layout")),
            ("probe: think token ids", _think_ids(data.probe.get("think_token_ids") or {})),
        ]
    if data.samples_reports:
        reports = data.samples_reports.values()
        pairs.append(
            ("raw rows by reasoning field", dict(_sum_reports(reports, "reasoning_fields")))
        )
        pairs.append(("raw rows by token layout", dict(_sum_reports(reports, "token_layouts"))))
    if data.samples is not None:
        pairs.append(("samples by reasoning field", _value_counts(data.samples["reasoning_field"])))
    if data.tokens is not None:
        pairs.append(("samples by token source", _value_counts(data.tokens["token_source"])))
    elif data.tokens_reports:
        pairs.append(
            (
                "samples by token source",
                dict(_sum_reports(data.tokens_reports.values(), "token_sources")),
            )
        )
    if not pairs:
        section.notes.append("No probe, samples or tokens files.")
        return section
    section.blocks.append(key_values(pairs))
    section.blocks.append(agreement_block(data))
    return section


def _think_ids(think: dict) -> str:
    if not think:
        return "–"
    start, end = (f"{think.get(k)} = {think.get(k + '_id')}" for k in ("start", "end"))
    return f"{start}, {end}"


def _value_counts(series: pl.Series) -> dict[str, int]:
    return dict(sorted(Counter(series.to_list()).items()))


def agreement_block(data: RunData) -> str:
    """Server ids against the rebuild: exact share per shard, first mismatches."""
    rows, mismatches = [], []
    total = Counter()
    for shard, report in data.tokens_reports.items():
        agreement = report.get("agreement") or {}
        counts = {
            k: agreement.get(k, 0)
            for k in ("compared", "exact", "prompt_exact", "completion_exact")
        }
        total.update(counts)
        rows.append(
            [shard, *counts.values(), pct(agreement.get("share")) if counts["compared"] else "–"]
        )
        mismatches += agreement.get("first_mismatches") or []
    if not rows:
        return "<p class='note'>No tokens reports: agreement unknown.</p>"
    if not total["compared"]:
        return (
            "<p class='note'>Server/rebuild agreement: nothing compared (the server returned no "
            "token ids, or tokenize.verify_rebuild is off).</p>"
        )
    rows.append(["all", *total.values(), pct(total["exact"] / total["compared"])])
    out = "<h3>Server ids vs rebuild</h3>" + table(
        ["shard", "compared", "exact", "prompt exact", "completion exact", "share exact"], rows
    )
    if mismatches:
        shown = "\n".join(json.dumps(m, ensure_ascii=False) for m in mismatches[:5])
        out += f"<p>First mismatches:</p><pre>{html.escape(shown)}</pre>"
    return out


def section_generation(data: RunData) -> Section:
    section = Section("generation", "Generation latency and throughput")
    if data.raw is None or data.raw.is_empty():
        section.notes.append("No raw generation files.")
        return section
    raw = data.raw
    answered = raw.filter(pl.col("error_kind").is_null())
    rate = answered.filter(pl.col("latency_s") > 0).select(
        (pl.col("completion_tokens") / pl.col("latency_s")).alias("rate")
    )["rate"]
    figure, axes = new_figure(3, width=4.5)
    axes[0].hist(answered["latency_s"].to_numpy(), bins=40, color="#4c72b0")
    axes[0].set_xlabel("request latency (s)")
    axes[0].set_ylabel("requests")
    axes[1].hist(rate.drop_nulls().to_numpy(), bins=40, color="#55a868")
    axes[1].set_xlabel("completion tokens / s per request")
    per_shard = shard_throughput(raw, data.generate_wall_s)
    if per_shard:
        shard_bars(axes[2], [r[0] for r in per_shard], [r[4] for r in per_shard], "#8172b2")
        axes[2].set_ylabel("completion tokens / s")
        axes[2].set_xlabel("shard (wall time from Snakemake benchmark)")
    else:
        _empty_axis(axes[2], "no benchmark tables:\nshard wall time unknown")
    section.figure = figure
    latency = quantiles(answered["latency_s"])
    errors = _value_counts(raw["error_kind"].drop_nulls())
    section.blocks.append(
        key_values(
            [
                ("requests", raw.height),
                ("answered", answered.height),
                ("failed (by kind)", errors or "none"),
                ("retried requests", raw.filter(pl.col("attempts") > 1).height),
                (
                    "latency mean / median / p90 / max (s)",
                    " / ".join(fmt(latency[k]) for k in ("mean", "median", "p90", "max")),
                ),
                ("prompt tokens (usage)", int(answered["prompt_tokens"].sum())),
                ("completion tokens (usage)", int(answered["completion_tokens"].sum())),
                ("completion tokens / s per request, median", _median(rate)),
            ]
        )
    )
    if per_shard:
        header = [
            "shard",
            "requests",
            "completion tokens",
            "wall (s)",
            "completion tokens/s",
            "requests/s",
        ]
        section.blocks.append(table(header, per_shard))
    else:
        section.notes.append(
            "No Snakemake benchmark tables for generate (benchmarks/{run}/generate/*.tsv): "
            "throughput per shard is unknown; per-request rates are shown."
        )
    return section


def _median(series: pl.Series) -> float | None:
    series = series.drop_nulls()
    return None if series.is_empty() else float(series.median())


def shard_throughput(raw: pl.DataFrame, wall_s: dict[str, float]) -> list[list[Any]]:
    rows = []
    for shard, frame in sorted(raw.group_by("shard"), key=lambda g: g[0][0]):
        shard = shard[0]
        if shard not in wall_s or wall_s[shard] <= 0:
            continue
        tokens = int(frame["completion_tokens"].fill_null(0).sum())
        seconds = wall_s[shard]
        rows.append(
            [shard, frame.height, tokens, seconds, tokens / seconds, frame.height / seconds]
        )
    return rows


def section_hidden(data: RunData) -> Section:
    section = Section("hidden_states", "Hidden states: bytes per token")
    if not data.hidden:
        section.notes.append("No hidden-state summaries (hidden/{shard}.json).")
        return section
    shards = list(data.hidden)
    summaries = list(data.hidden.values())
    hidden_size = summaries[0].get("hidden_size")
    figure, (left, right) = new_figure(2)
    shard_bars(left, shards, [s.get("bytes_per_token") or 0 for s in summaries], "#4c72b0")
    if hidden_size:
        left.axhline(8 * hidden_size, color="#c44e52", linestyle="--", label="8·H (fp16 pickle)")
        left.legend()
    left.set_ylabel("bytes per token")
    shard_bars(right, shards, [s.get("tokens_per_s") or 0 for s in summaries], "#55a868")
    right.set_ylabel("tokens / s (stage)")
    left.set_xlabel("shard")
    right.set_xlabel("shard")
    section.figure = figure
    tokens = sum(s.get("tokens", 0) for s in summaries)
    size = sum(s.get("bytes", 0) for s in summaries)
    per_token = size / tokens if tokens else None
    section.blocks.append(
        key_values(
            [
                (
                    "dtype / target signal",
                    f"{summaries[0].get('dtype')} / {summaries[0].get('target_signal')}",
                ),
                ("aux layer ids", summaries[0].get("aux_layer_ids")),
                ("hidden size H", hidden_size),
                (
                    "samples / tokens",
                    f"{fmt(sum(s.get('samples', 0) for s in summaries))} / {fmt(tokens)}",
                ),
                ("bytes on disk", size_text(size)),
                ("bytes per token", per_token),
                (
                    "share of 8·H",
                    per_token / (8 * hidden_size) if per_token and hidden_size else None,
                ),
                ("stage seconds (sum)", sum(s.get("seconds") or 0 for s in summaries)),
            ]
        )
    )
    return section


def section_training(data: RunData) -> Section:
    section = Section("training", "Training: loss and accuracy per TTT step")
    if data.train_lines is None and data.train_report is None:
        section.notes.append(
            "Not trained yet: no drafter/metrics.jsonl or drafter/train_report.json."
        )
        return section
    train, heldout = data.train_lines or [], data.heldout_lines or []
    if train or heldout:
        section.figure = training_figure(train, heldout)
    else:
        section.notes.append("drafter/metrics.jsonl has no lines yet.")
    report = data.train_report
    if report:
        section.blocks.append(
            key_values(
                [
                    ("steps / epochs", f"{fmt(report['steps'])} / {fmt(report.get('epochs'))}"),
                    ("TTT steps", report["ttt_steps"]),
                    ("train tokens", report.get("train_tokens")),
                    (
                        "wall (s) / tokens per s",
                        f"{fmt(report.get('wall_s'))} / {fmt(report.get('tokens_per_s'))}",
                    ),
                    ("held-out loss", report.get("heldout_loss")),
                    (
                        "tokens outside the draft vocab (skipped)",
                        pct(report.get("skipped_outside_vocab_share")),
                    ),
                    (
                        "train / held-out shards",
                        f"{len(report.get('train_shards') or [])} / "
                        + f"{len(report.get('eval_shards') or [])}",
                    ),
                ]
            )
        )
        accuracy = [
            [f"step {i + 1}", a, _at(report.get("heldout_acc"), i)]
            for i, a in enumerate(report["train_acc"])
        ]
        section.blocks.append("<h3>Accuracy per TTT step (end of training)</h3>")
        section.blocks.append(table(["TTT step", "train", "held-out"], accuracy))
    else:
        section.notes.append("No drafter/train_report.json: training has not finished.")
    return section


def _at(values: list | None, i: int) -> Any:
    return values[i] if values and i < len(values) else None


def training_figure(train: list[dict], heldout: list[dict]) -> Figure:
    figure, (loss_axis, acc_axis, speed_axis) = new_figure(3, width=4.5)
    if train:
        loss_axis.plot([r["step"] for r in train], [r["loss"] for r in train], label="train")
    if heldout:
        loss_axis.plot(
            [r["step"] for r in heldout], [r["loss"] for r in heldout], "o--", label="held-out"
        )
    loss_axis.set_xlabel("step")
    loss_axis.set_ylabel("loss")
    loss_axis.legend()
    ttt_steps = max(len(r["acc"]) for r in train + heldout)
    colors = [f"C{i % 10}" for i in range(ttt_steps)]
    for i in range(ttt_steps):
        points = [(r["step"], r["acc"][i]) for r in train if i < len(r["acc"])]
        if points:
            acc_axis.plot(*zip(*points), color=colors[i], label=f"TTT step {i + 1}")
        points = [(r["step"], r["acc"][i]) for r in heldout if i < len(r["acc"])]
        if points:
            acc_axis.plot(*zip(*points), "o--", color=colors[i], markersize=3)
    acc_axis.set_xlabel("step (dashed: held-out)")
    acc_axis.set_ylabel("accuracy")
    acc_axis.set_ylim(0, 1)
    acc_axis.legend(fontsize=7)
    speed = [(r["step"], r["tokens_per_s"]) for r in train if r.get("tokens_per_s") is not None]
    if speed:
        speed_axis.plot(*zip(*speed), color="#8172b2")
        speed_axis.set_xlabel("step")
        speed_axis.set_ylabel("training tokens / s")
    else:
        _empty_axis(speed_axis, "no tokens_per_s")
    return figure


def section_acceptance(data: RunData) -> Section:
    section = Section("acceptance", "Acceptance: by position, live vs simulated, baselines")
    metrics = data.eval
    if metrics is None:
        section.notes.append("Not evaluated yet: no eval/metrics.json.")
        return section
    ks = [str(k) for k in metrics["ks"]]
    live = metrics.get("live")
    baselines = metrics.get("baselines") or {}
    section.figure = acceptance_figure(metrics, ks)
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
    section.blocks.append(table(header, rows))
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


def live_table(live_by_name: dict[str, dict], ks: list[str]) -> str:
    keys = ("acceptance_length", "speedup", "target_forwards_per_token", "identical_to_greedy")
    rows = [
        [name, k, *[(per_k.get(k) or {}).get(key) for key in keys]]
        for name, per_k in live_by_name.items()
        for k in ks
    ]
    return table(["proposer", "K", *[key.replace("_", " ") for key in keys]], rows)


# One color per source, the same in every acceptance panel.
SOURCE_COLORS = {"simulated": "C0", "live": "C1", "untrained": "C2", "prompt_lookup": "C3"}


def acceptance_figure(metrics: dict, ks: list[str]) -> Figure:
    """One panel per K: conditional acceptance by position (drafter and baselines, simulated);
    last panel: acceptance length per K, simulated, live and baselines side by side."""
    figure, axes = new_figure(len(ks) + 1, width=4.2)
    baselines = metrics.get("baselines") or {}
    live = metrics.get("live") or {}
    for axis, k in zip(axes, ks):
        sources = {"simulated": metrics["simulated"][k]}
        sources.update({n: (baselines.get(n) or {}).get(k) for n in BASELINE_NAMES})
        for name, entry in sources.items():
            if entry:
                values = entry["conditional_acceptance"]
                label = "drafter" if name == "simulated" else name
                axis.plot(range(1, len(values) + 1), values, marker="o", markersize=3,
                          color=SOURCE_COLORS[name], label=label)  # fmt: skip
        axis.set_title(f"K={k}")
        axis.set_xlabel("draft position")
        axis.set_ylim(0, 1.02)
        axis.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes[0].set_ylabel("conditional acceptance (simulated)")
    axes[0].legend(fontsize=7)
    lengths = axes[-1]
    series = {
        "simulated": [metrics["simulated"][k]["acceptance_length"] for k in ks],
        "live": [(live.get(k) or {}).get("acceptance_length") for k in ks],
    }
    for name in BASELINE_NAMES:
        series[name] = [
            ((baselines.get(name) or {}).get(k) or {}).get("acceptance_length") for k in ks
        ]
    for name, per_k in (metrics.get("live_baselines") or {}).items():
        series[f"live {name}"] = [(per_k.get(k) or {}).get("acceptance_length") for k in ks]
    series = {name: values for name, values in series.items() if any(v is not None for v in values)}
    width = 0.8 / len(series)
    for offset, (name, values) in enumerate(series.items()):
        xs = [i + (offset - (len(series) - 1) / 2) * width for i in range(len(ks))]
        heights = [v if v is not None else 0 for v in values]
        color = SOURCE_COLORS.get(name, f"C{4 + offset}")
        lengths.bar(xs, heights, width, label=name, color=color)
    lengths.set_xticks(range(len(ks)), [f"K={k}" for k in ks])
    lengths.set_ylabel("acceptance length")
    lengths.set_ylim(
        0, 1.35 * max(v for values in series.values() for v in values if v is not None)
    )
    lengths.set_title("tokens per target forward" + ("" if live else " (no live run)"))
    lengths.legend(fontsize=7)
    return figure


SECTIONS: tuple[Callable[[RunData], Section], ...] = (
    section_funnel,
    section_sources,
    section_lengths,
    section_generation,
    section_hidden,
    section_training,
    section_acceptance,
)


# ---------------------------------------------------------------------------------------------
# Key figures and the page
# ---------------------------------------------------------------------------------------------


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
        figures["token source"] = _value_counts(data.tokens["token_source"])
        figures["tokens (validated samples)"] = int(data.tokens["n_tokens"].sum())
    compared = sum(
        (r.get("agreement") or {}).get("compared", 0) for r in data.tokens_reports.values()
    )
    exact = sum((r.get("agreement") or {}).get("exact", 0) for r in data.tokens_reports.values())
    if compared:
        figures["server/rebuild agreement"] = pct(exact / compared)
    if data.hidden:
        size = sum(s.get("bytes", 0) for s in data.hidden.values())
        tokens = sum(s.get("tokens", 0) for s in data.hidden.values())
        figures["hidden bytes per token"] = size / tokens if tokens else None
    if data.train_report:
        figures["training steps"] = data.train_report["steps"]
        figures["held-out accuracy per TTT step"] = data.train_report.get("heldout_acc")
    if data.eval:
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


def main(argv: list[str] | None = None) -> int:
    """`python -m eaglenest.stages.report.report results/RUN [--out DIR]`: a report of whatever exists."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--benchmarks", type=Path, help="benchmarks/RUN (generation wall times)")
    parser.add_argument("--out", type=Path, help="report folder (default RUN_DIR/report)")
    args = parser.parse_args(argv)
    out = args.out or args.run_dir / "report"
    figures = build_report(
        RunFiles.from_run_dir(args.run_dir, args.benchmarks),
        out / "index.html",
        run=args.run_dir.name,
    )
    print(json.dumps(figures, indent=2, default=str))
    print(f"wrote {out / 'index.html'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
