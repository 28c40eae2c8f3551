"""The engine's acceptance and our live loop's are reported on one definition: emitted tokens per
round, each one's own acceptance length beside it."""

from __future__ import annotations

import pytest


def test_engine_and_live_acceptance_are_reported_on_one_definition():
    """The figures of the issue: 16 prompts, 654 tokens, 210 rounds in both; vLLM's counters say
    3.167, our loop 3.105. Emitted tokens per round: (654 - 16) / 210 in both."""
    from eaglenest.formats.metrics import emitted_per_round
    from eaglenest.stages.evaluate.vllm_evaluate import live_vs_engine
    from eaglenest.stages.report.acceptance import engine_table

    engine_k = {"acceptance_length": 3.167, "rounds": 210, "tokens": 654, "prompts": 16}
    live_k = {"acceptance_length": 3.105, "rounds": 210, "tokens": 654, "prompts": 16}
    assert emitted_per_round(654, 16, 210) == pytest.approx(638 / 210)
    engine_k["emitted_per_round"] = live_k["emitted_per_round"] = emitted_per_round(654, 16, 210)
    assert live_vs_engine({"3": live_k}, {"3": engine_k}) == {"3": pytest.approx(1.0)}
    metrics = {
        "simulated": {"3": {"acceptance_length": 3.0}},
        "live": {"3": live_k},
        "engine": {"engine": "vllm", "per_k": {"3": engine_k}},
    }
    html = engine_table(metrics, ["3"])
    cells = html.split("<tbody>")[1].split("</td><td>")
    assert cells[1] == cells[2] == "3.04"  # emitted per round: vLLM, live
    assert "3.17" in cells and "3.1" in cells  # each one's own acceptance length, beside
    assert "emitted tokens per round, vllm" in html and "vllm&#x27;s own acceptance length" in html
    assert "past the end of an answer" in html
