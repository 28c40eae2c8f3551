"""The report's hidden-state section: the stored states' bytes per token, and vLLM's states
against transformers' (hidden/verify.json)."""

from __future__ import annotations

from typing import Any

from eaglenest.stages.report.data import RunData, hidden_totals
from eaglenest.stages.report.figures import hidden_figure
from eaglenest.stages.report.page import Section, fmt, key_values, size_text


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
