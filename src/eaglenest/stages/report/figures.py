"""The report's plots: one matplotlib figure per section, drawn from RunData's numbers, and the
card a section with nothing to plot gets instead. Figures are `matplotlib.figure.Figure`s, not
pyplot ones, so building a report keeps no global state and needs no display.
"""

from __future__ import annotations

import io
import math
from typing import Any

import numpy as np
import polars as pl
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from eaglenest.stages.report.data import BASELINE_NAMES, positions, temperature_rows


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


def counted_bars(axis, counts: list[tuple[str, int]], color: str) -> None:
    """Horizontal bars, first on top, each labelled with its count; integer ticks."""
    axis.barh([label for label, _ in counts][::-1], [n for _, n in counts][::-1], color=color)
    for y, (_, n) in enumerate(counts[::-1]):
        axis.text(n, y, f" {n:,}", va="center", fontsize=8)
    axis.xaxis.set_major_locator(MaxNLocator(integer=True))
    axis.margins(x=0.15)


def funnel_figure(stages: list[tuple[str, int]], drops: list[tuple[str, int]]) -> Figure:
    """Rows reaching each stage (left) and why rows were dropped (right)."""
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
    return figure


def lengths_figure(samples: pl.DataFrame | None, tokens: pl.DataFrame | None) -> Figure:
    """Reasoning and content lengths in characters; prompt and completion lengths in tokens."""
    figure, axes = new_figure(3, width=4.5)
    if samples is not None:
        for axis, column, color in zip(
            axes, ("reasoning_chars", "content_chars"), ("#4c72b0", "#55a868")
        ):
            axis.hist(samples[column].to_numpy(), bins=40, color=color)
            axis.set_xlabel(f"{column.split('_')[0]} length (characters)")
            axis.set_ylabel("samples")
    else:
        for axis in axes[:2]:
            _empty_axis(axis, "no samples files")
    if tokens is not None:
        columns = {"prompt_len": "prompt", "completion_len": "completion"}
        bins = np.histogram_bin_edges(tokens.select(list(columns)).to_numpy(), bins=40)
        for column, label in columns.items():
            axes[2].hist(tokens[column].to_numpy(), bins=bins, alpha=0.6, label=label)
        axes[2].set_xlabel("tokens per sample")
        axes[2].legend()
    else:
        _empty_axis(axes[2], "no tokens files")
    return figure


def generation_figure(
    latency_s: pl.Series, rate: pl.Series, per_shard: list[list], endpoints: list[dict]
) -> Figure:
    """Latency and completion tokens / s per request; throughput per shard (`shard_throughput`
    rows) where Snakemake's benchmark tables give the shard's wall time; requests in flight per
    endpoint over time against its cap (`endpoint_utilisation` rows)."""
    figure, axes = new_figure(4, width=4.5)
    axes[0].hist(latency_s.to_numpy(), bins=40, color="#4c72b0")
    axes[0].set_xlabel("request latency (s)")
    axes[0].set_ylabel("requests")
    axes[1].hist(rate.drop_nulls().to_numpy(), bins=40, color="#55a868")
    axes[1].set_xlabel("completion tokens / s per request")
    if per_shard:
        shard_bars(axes[2], [r[0] for r in per_shard], [r[4] for r in per_shard], "#8172b2")
        axes[2].set_ylabel("completion tokens / s")
        axes[2].set_xlabel("shard (wall time from Snakemake benchmark)")
    else:
        _empty_axis(axes[2], "no benchmark tables:\nshard wall time unknown")
    sampled = [e for e in endpoints if e["in_flight"]]
    for index, endpoint in enumerate(sampled):
        times, counts = zip(*endpoint["in_flight"])
        line = axes[3].step(times, counts, where="post", label=f"endpoint {index + 1}")
        axes[3].axhline(endpoint["cap"], color=line[0].get_color(), linestyle=":", linewidth=1)
    if sampled:
        axes[3].set_xlabel("seconds since the first shard job started")
        axes[3].set_ylabel("requests in flight (dotted: cap)")
        axes[3].legend()
    else:
        _empty_axis(axes[3], "no activity files:\nrequests in flight unknown")
    return figure


def hidden_figure(shards: list[str], summaries: list[dict], hidden_size: int | None) -> Figure:
    """Bytes per token (against 8·H, the fp16 pickle) and tokens per second, per shard."""
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
    return figure


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


# One color per source, the same in every acceptance panel.
SOURCE_COLORS = {"simulated": "C0", "live": "C1", "untrained": "C2", "prompt_lookup": "C3"}


def acceptance_figure(metrics: dict, ks: list[str]) -> Figure:
    """One panel per K: conditional acceptance by position (drafter and baselines, simulated);
    then acceptance length per K, simulated, live and baselines side by side; then, with a
    by-depth table (evaluate.depths), acceptance length against generated depth; last, beside it,
    the engine's acceptance by generated position inside its own answers (greedy and sampled)."""
    by_depth = metrics.get("by_depth")
    engine = metrics.get("engine") or {}
    by_position = any(figures.get("by_position") for _, figures in temperature_rows(engine, ks))
    figure, axes = new_figure(len(ks) + 1 + bool(by_depth) + by_position, width=4.2)
    if by_position:
        position_panel(axes.pop(), engine, ks)
    if by_depth:
        depth_panel(axes.pop(), by_depth)
    baselines = metrics.get("baselines") or {}
    live = metrics.get("live") or {}
    for axis, k in zip(axes, ks):
        sources = {"simulated": metrics["simulated"][k]}
        sources.update({n: (baselines.get(n) or {}).get(k) for n in BASELINE_NAMES})
        for name, entry in sources.items():
            if entry:
                values = entry["conditional_acceptance"]
                label = "drafter" if name == "simulated" else name
                axis.plot(
                    range(1, len(values) + 1),
                    values,
                    marker="o",
                    markersize=3,
                    color=SOURCE_COLORS[name],
                    label=label,
                )
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


# Line style per measurement; colour per K.
MEASUREMENT_STYLES = {"live": "-", "engine": ":", "engine_sampled": "-.", "simulated": "--"}


def depth_panel(axis, by_depth: dict[str, Any]) -> None:
    """Acceptance length against depth: per K, the live, engine and simulated figures."""
    for index, (k, rows) in enumerate(by_depth["per_k"].items()):
        for measurement, style in MEASUREMENT_STYLES.items():
            points = [
                (row["depth"], row[measurement]["acceptance_length"])
                for row in rows
                if row.get(measurement) and row[measurement].get("acceptance_length") is not None
            ]
            if points:
                axis.plot(
                    *zip(*points),
                    style,
                    marker="o",
                    markersize=3,
                    color=f"C{index}",
                    label=f"K={k} {measurement.replace('_', ' ')}",
                )
    axis.set_xlabel("generated depth (tokens)")
    axis.set_ylabel("acceptance length")
    axis.set_title("acceptance by depth")
    axis.legend(fontsize=6)


def position_panel(axis, engine: dict[str, Any], ks: list[str]) -> None:
    """The engine's acceptance length by generated position (bins of its per-step record): per
    K a colour, greedy solid, sampled dashed."""
    for k, figures in temperature_rows(engine, ks):
        points = [
            ((row["start"] + row["end"]) / 2, row["acceptance_length"])
            for row in positions(figures)
            if row["acceptance_length"] is not None
        ]
        if points:
            temperature = figures.get("temperature") or 0
            axis.plot(
                *zip(*points),
                "--" if temperature else "-",
                marker="o",
                markersize=3,
                color=f"C{ks.index(k)}",
                label=f"K={k} T={temperature:g}",
            )
    axis.set_xlabel("generated position (tokens)")
    axis.set_ylabel("acceptance length")
    axis.set_ylim(bottom=1)
    axis.set_title(f"acceptance by position ({engine.get('engine', 'engine')})")
    axis.legend(fontsize=6)


# What the families panel plots against depth, by the key of each depth row (choice.py).
FAMILY_PANELS = (
    ("acceptance_length", "live acceptance length", 1.0),
    ("emitted_per_round", "emitted tokens per round (live)", 1.0),
    ("drafter_s_per_round", "drafter ms per round", 1000.0),
    ("tokens_per_target_step", "tokens per target step", 1.0),
)
K_STYLES = ("-", "--", ":", "-.")


def families_figure(families: dict[str, dict[str, list[dict]]]) -> Figure:
    """The drafter families by depth (family -> K -> depth rows): live acceptance, emitted tokens
    per round, the drafter's time per round and tokens per target step; a colour per family, a
    line style per K."""
    figure, axes = new_figure(len(FAMILY_PANELS), width=4.2)
    for (key, label, scale), axis in zip(FAMILY_PANELS, axes, strict=True):
        for index, (family, per_k) in enumerate(families.items()):
            for k_index, (k, rows) in enumerate(per_k.items()):
                points = [(r["depth"], scale * r[key]) for r in rows if r.get(key) is not None]
                if points:
                    axis.plot(
                        *zip(*points),
                        K_STYLES[k_index % len(K_STYLES)],
                        marker="o",
                        markersize=3,
                        color=f"C{index}",
                        label=f"{family} K={k}",
                    )
        axis.set_xlabel("generated depth (tokens)")
        axis.set_ylabel(label)
        axis.set_ylim(bottom=0)
    if axes[0].get_legend_handles_labels()[0]:
        axes[0].legend(fontsize=7)
    axes[0].set_title("acceptance by depth")
    axes[-1].set_title("the choice's measure")
    return figure


def device_curve_figure(curve: dict[str, Any], crossovers: list[dict[str, Any]]) -> Figure:
    """Tokens per target step against the drafter/target forward-time ratio (log axis), each
    family (its title -> K and figures) at its best K at each r (the label lists the K from the
    left); the device's ratio and the crossovers marked."""
    figure, (axis,) = new_figure(1, width=6.0)
    for index, (family, line) in enumerate(curve["families"].items()):
        axis.plot(
            curve["ratios"],
            line["tokens_per_target_step"],
            color=f"C{index}",
            label=f"{family} K={'→'.join(map(str, dict.fromkeys(line['ks'])))}",
        )
    if curve["device_ratio"] is not None:  # None: no device's timings, an assumed curve
        axis.axvline(
            curve["device_ratio"], color="black", linestyle="--", linewidth=1, label="device"
        )
    for crossover in crossovers:
        if curve["ratios"][0] <= crossover["ratio"] <= curve["ratios"][-1]:
            axis.axvline(crossover["ratio"], color="grey", linestyle=":", linewidth=1)
    axis.set_xscale("log")
    axis.set_xlabel("drafter forward / target decode step (r)")
    axis.set_ylabel("tokens per target step")
    axis.set_title("the family choice on the serving device")
    axis.legend(fontsize=7)
    return figure
