"""The report's sections, in page order: each turns RunData into a `Section` (its plot, its
tables, and notes for what the run lacks). A section whose files are absent is only a note.
"""

from __future__ import annotations

import html
import json
from collections import Counter
from collections.abc import Callable
from typing import Any

import polars as pl

from eaglenest.settings.families import DRAFTER_VARIANTS, family_suffix
from eaglenest.stages.report.acceptance import section_acceptance
from eaglenest.stages.report.data import (
    RunData,
    answered_requests,
    drop_counts,
    endpoint_utilisation,
    funnel_counts,
    hidden_totals,
    median,
    quantiles,
    shard_throughput,
    sum_reports,
    value_counts,
)
from eaglenest.stages.report.figures import (
    funnel_figure,
    generation_figure,
    hidden_figure,
    lengths_figure,
    training_figure,
)
from eaglenest.stages.report.page import Section, fmt, key_values, pct, size_text, table


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


def section_hidden(data: RunData) -> Section:
    section = Section("hidden_states", "Hidden states: bytes per token")
    if not data.hidden:
        section.notes.append(
            "No hidden-state summaries (hidden/{shard}.json): with hidden.store none, training "
            "and evaluation asked the capture servers for the states and no shard was stored."
        )
        return section
    shards = list(data.hidden)
    summaries = list(data.hidden.values())
    hidden_size = summaries[0].get("hidden_size")
    section.figure = hidden_figure(shards, summaries, hidden_size)
    tokens, size, per_token = hidden_totals(summaries)
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
    if data.hidden_verify:
        section.blocks.append(backend_agreement_block(data.hidden_verify))
    return section


def backend_agreement_block(verify: dict[str, Any]) -> str:
    """hidden/verify.json: vLLM's states against transformers' on the first samples."""
    rows = [
        (
            "samples / model dtype / tolerance",
            f"{verify['samples']} / {verify['model_dtype']} / {verify['tolerance']:.1e}",
        ),
        *[
            (
                f"layer {name}: max / mean relative",
                f"{f['max_relative']:.2e} / {f['mean_relative']:.2e}",
            )
            for name, f in verify["layers"].items()
        ],
    ]
    return "<h3>vLLM against transformers (hidden.verify_samples)</h3>" + key_values(rows)


def draft_vocab_block(summary: dict[str, Any]) -> str:
    """The draft vocabulary: its size, and the share of completion tokens inside it (below 1,
    training skips the positions whose target token is outside and counts them)."""
    rows = [
        (
            "draft / target vocabulary (ids)",
            f"{fmt(summary['draft_vocab_size'])} / {fmt(summary['target_vocab_size'])}",
        ),
        ("distinct ids in completions", summary.get("distinct_ids_seen")),
        ("coverage of completion tokens", pct(summary["coverage"], 2)),
    ]
    return "<h3>Draft vocabulary</h3>" + key_values(rows)


def section_training(data: RunData) -> Section:
    section = Section("training", "Training: loss and accuracy per TTT step")
    if data.draft_vocab:
        section.blocks.append(draft_vocab_block(data.draft_vocab))
    folder = f"drafter{family_suffix(data.family)}"
    if data.train_lines is None and data.train_report is None:
        section.notes.append(
            f"Not trained yet: no {folder}/metrics.jsonl or {folder}/train_report.json."
        )
        return section
    train, heldout = data.train_lines or [], data.heldout_lines or []
    if train or heldout:
        section.figure = training_figure(train, heldout)
    else:
        section.notes.append(f"{folder}/metrics.jsonl has no lines yet.")
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
        if report.get("settings"):
            section.blocks.append("<h3>Recipe</h3>" + key_values(recipe_rows(report)))
        accuracy = [
            [f"step {i + 1}", a, _at(report.get("heldout_acc"), i)]
            for i, a in enumerate(report["train_acc"])
        ]
        section.blocks.append("<h3>Accuracy per TTT step (end of training)</h3>")
        section.blocks.append(table(["TTT step", "train", "held-out"], accuracy))
    else:
        section.notes.append(f"No {folder}/train_report.json: training has not finished.")
    return section


# family -> how the recipe names its drafting (before the EAGLE-3 layer it is built on)
DRAFTING: dict[str, str] = {
    "eagle3": "",
    "p_eagle": "P-EAGLE: its depths drafted in one forward",
    "dflash": "DFlash: a block drafted in one forward, non-causal inside it",
}


def recipe_rows(report: dict[str, Any]) -> list[tuple[str, Any]]:
    """What the drafter was trained with (train_report.json's `drafter` and `settings`); keys
    an older report lacks show their value before they existed."""
    settings, drafter = report["settings"], report.get("drafter") or {}
    get = settings.get
    slot_weights, inputs = drafted_slots(report)
    variant = [name for name in DRAFTER_VARIANTS if drafter.get(name)]
    architecture = "EAGLE-3 with " + ", ".join(variant) if variant else "EAGLE-3 (plain)"
    if DRAFTING.get(report.get("family")):
        architecture = f"{DRAFTING[report['family']]}; {architecture}"
    if drafter.get("sliding_window"):
        architecture += f"; attention within a {drafter['sliding_window']}-token sliding window"
    loss = (
        f"{get('loss', 'cross_entropy')}; target mass outside the draft vocab: "
        f"{get('target_outside_vocab', 'renormalise')}; "
        f"{slot_weights}; "
        f"on {get('loss_positions', 'completion')} positions"
    )
    betas = tuple(get("adam_betas", (0.9, 0.95)))
    optimiser = (
        f"AdamW lr {fmt(get('lr'))}, betas {betas}, weight decay {fmt(get('weight_decay'))}, "
        f"grad clip {fmt(get('grad_clip'))}"
    )
    schedule = (
        f"{get('warmup_steps')} warm-up steps, cosine to {fmt(get('min_lr_ratio'))} x lr; "
        f"{get('epochs')} epochs, {get('max_batch_tokens')} tokens a batch"
    )
    pool = get("shuffle_pool", 0)
    if get("packing", False):
        batches = "new each epoch, random samples packed several to a row"
    elif pool:
        batches = f"new each epoch, length-sorted in pools of {pool} batches' worth of tokens"
    else:
        batches = "the same length-sorted batches every epoch, reordered"
    return [
        ("architecture", architecture),
        ("loss", loss),
        ("drafted steps / their inputs", inputs),
        ("LM head", get("lm_head_init", "random")),
        ("initialisation", f"N(0, {fmt(get('init_std'))})" if get("init_std") else "PyTorch's"),
        ("aux noise", fmt(get("aux_noise", 0.0))),
        ("optimiser", optimiser),
        ("schedule", schedule),
        ("batches", batches),
    ]


def drafted_slots(report: dict[str, Any]) -> tuple[str, str]:
    """How a family's loss weighs its drafted slots, and how many it drafts from what: the
    TTT keys are EAGLE-3's only (another family's settings leave them out)."""
    # An older report names no family: EAGLE-3's.
    return DRAFTED_SLOTS.get(report.get("family"), _ttt_slots)(report)


def _ttt_slots(report: dict[str, Any]) -> tuple[str, str]:
    settings = report["settings"]
    weights = f"TTT step i weighted {fmt(settings.get('step_weight'))}^i"
    return weights, f"{settings.get('ttt_steps')} / {settings.get('ttt_inputs', 'data')} tokens"


def _depth_slots(report: dict[str, Any]) -> tuple[str, str]:
    weights = "depth d weighted as speculators' COD sampling keeps it"
    return weights, f"{report['ttt_steps']} / mask tokens"


def _block_slots(report: dict[str, Any]) -> tuple[str, str]:
    gamma = (report.get("drafter") or {}).get("gamma")
    return (
        f"block slot j weighted exp(-(j - 1) / {fmt(gamma)})",
        f"{report['ttt_steps']} / mask tokens",
    )


# family -> how its loss weighs its drafted slots (recipe_rows)
DRAFTED_SLOTS = {"eagle3": _ttt_slots, "p_eagle": _depth_slots, "dflash": _block_slots}


def _at(values: list | None, i: int) -> Any:
    return values[i] if values and i < len(values) else None


SECTIONS: tuple[Callable[[RunData], Section], ...] = (
    section_funnel,
    section_sources,
    section_lengths,
    section_generation,
    section_hidden,
    section_training,
    section_acceptance,
)
