"""The report's sections, in page order (`SECTIONS`): each turns RunData into a `Section` (its
plot, its tables, and notes for what the run lacks). A section whose files are absent is only a
note. Here the data's sections (funnel, sources, lengths, generation); the hidden states' are in
hidden.py, training's in training.py, acceptance's in acceptance.py.
"""

from __future__ import annotations

import html
import json
from collections import Counter
from collections.abc import Callable
from typing import Any

import polars as pl

from eaglenest.stages.report.acceptance import section_acceptance
from eaglenest.stages.report.data import (
    RunData,
    answered_requests,
    drop_counts,
    endpoint_utilisation,
    funnel_counts,
    median,
    quantiles,
    shard_throughput,
    sum_reports,
    value_counts,
)
from eaglenest.stages.report.figures import (
    funnel_figure,
    generation_figure,
    lengths_figure,
)
from eaglenest.stages.report.hidden import section_hidden
from eaglenest.stages.report.page import Section, fmt, key_values, pct, table
from eaglenest.stages.report.training import section_training


def section_funnel(data: RunData) -> Section:
    section = Section("funnel", "Prompts and drops per stage")
    stages, drops = funnel_counts(data), drop_counts(data)
    if not stages:
        section.notes.append("No prompt, samples or tokens reports: nothing ran yet.")
        return section
    section.figure = funnel_figure(stages, drops)
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
    section.figure = lengths_figure(data.samples, data.tokens)
    stats = []
    if data.samples is not None:
        for column in ("reasoning_chars", "content_chars"):
            stats.append([column.replace("_", " "), *quantiles(data.samples[column]).values()])
    if data.tokens is not None:
        for column, label in (
            ("prompt_len", "prompt"),
            ("completion_len", "completion"),
            ("n_tokens", "total"),
        ):
            stats.append([f"{label} tokens", *quantiles(data.tokens[column]).values()])
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
            ("raw rows by reasoning field", dict(sum_reports(reports, "reasoning_fields")))
        )
        pairs.append(("raw rows by token layout", dict(sum_reports(reports, "token_layouts"))))
    if data.samples is not None:
        pairs.append(("samples by reasoning field", value_counts(data.samples["reasoning_field"])))
    if data.tokens is not None:
        pairs.append(("samples by token source", value_counts(data.tokens["token_source"])))
    elif data.tokens_reports:
        pairs.append(
            (
                "samples by token source",
                dict(sum_reports(data.tokens_reports.values(), "token_sources")),
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


def agreement_block(data: RunData) -> str:
    """Server ids against the rebuild: exact share per shard, first mismatches; what the server's
    reasoning parser stripped, per shard (the comparison puts it back first)."""
    rows, mismatches = [], []
    total = Counter()
    for shard, report in data.tokens_reports.items():
        agreement = report.get("agreement") or {}
        counts = {
            k: agreement.get(k, 0)
            for k in ("compared", "exact", "prompt_exact", "completion_exact", "retokenized")
        }
        counts["parser stripped"] = report.get("parser_stripped_whitespace", 0)
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
        [
            "shard",
            "compared",
            "exact",
            "prompt exact",
            "completion exact",
            "same text, other tokens",
            "parser stripped",
            "share exact",
        ],
        rows,
    )
    if total["parser stripped"]:
        out += (
            f"<p class='note'>The server's reasoning parser stripped trailing whitespace from the "
            f"reasoning of {total['parser stripped']} samples (e.g. vLLM's kimi_k2 before "
            "<code>&lt;/think&gt;</code>): their token ids hold it and are what is trained on; "
            "the rebuild is compared with it put back. A run without token ids would lose it."
            "</p>"
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
    answered, rate = answered_requests(raw)
    per_shard = shard_throughput(raw, data.generate_wall_s)
    endpoints = endpoint_utilisation(data.generate_activity)
    section.figure = generation_figure(answered["latency_s"], rate, per_shard, endpoints)
    latency = quantiles(answered["latency_s"])
    errors = value_counts(raw["error_kind"].drop_nulls())
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
                ("completion tokens / s per request, median", median(rate)),
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
    if endpoints:
        header = ["endpoint", "cap", "shard jobs", "wall (s)", "busy slot-s", "utilisation"]
        header += ["most in flight", "most queued by the server"]
        rows = [
            [e["url"], e["cap"], e["jobs"], e["wall_s"], e["busy_s"], pct(e["utilisation"])]
            + [
                e["max_in_flight"],
                "not published" if e["max_server_waiting"] is None else e["max_server_waiting"],
            ]
            for e in endpoints
        ]
        section.blocks.append(table(header, rows))
        section.notes.append(
            "Endpoints over the latest run's shard jobs (logs/{run}/generate_responses/"
            "*.activity.json): utilisation is "
            "busy slot-seconds / (cap x wall); in flight and queued are sampled every "
            "generation.activity_s over all shard jobs."
        )
    return section


SECTIONS: tuple[Callable[[RunData], Section], ...] = (
    section_funnel,
    section_sources,
    section_lengths,
    section_generation,
    section_hidden,
    section_training,
    section_acceptance,
)
