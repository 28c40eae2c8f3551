"""The report says the mode the drafter was trained in, its figures in each thinking mode (live,
vLLM greedy and sampled) and what the other mode costs, from eval/metrics.json's `thinking` as
the evaluate stage writes it (stages/evaluate/thinking.py's thinking_section); a run whose
metrics hold no `thinking` has no such section."""

from __future__ import annotations

import copy
from pathlib import Path

import polars as pl
from support.report_run import (
    EVAL_METRICS,
    missing_references,
    page_sections,
    write_json,
    write_run,
)

from eaglenest.stages.evaluate.thinking import OtherMode, thinking_section
from eaglenest.stages.report.inputs import RunFiles
from eaglenest.stages.report.report import build_report


def per_k(lengths: dict[str, float], prompts: int = 8) -> dict[str, dict]:
    return {
        k: {"acceptance_length": a, "emitted_per_round": a, "prompts": prompts, "tokens": 512}
        for k, a in lengths.items()
    }


def metrics_in_both_modes(train_tokens: Path) -> dict:
    """EVAL_METRICS with vLLM's figures and the other mode (off) decoded as the stage decodes it:
    a prompt group of the live loop and of the engines, filed by thinking_section."""
    metrics = copy.deepcopy(EVAL_METRICS)
    metrics["live_groups"] = {"thinking:off": per_k({"3": 1.2, "7": 1.3}, 7)}
    metrics["engine"] = {
        "engine": "vllm",
        "per_k": per_k({"3": 2.4, "7": 2.8}),
        "by_depth": {"thinking:off": per_k({"3": 1.2, "7": 1.4}, 7)},
        "sampled": {
            "temperature": 0.7,
            "per_k": per_k({"3": 2.0, "7": 2.2}),
            "by_depth": {"thinking:off": per_k({"3": 1.1, "7": 1.1}, 7)},
        },
    }
    found = OtherMode("enable_thinking", "on", "off", [[1, 2]] * 7, not_flipped=1)
    thinking = thinking_section(found, metrics, [train_tokens]).to_json()
    # As metrics.json holds it: keys sorted (the stage writes them so), "off" before "on".
    metrics["thinking"] = {**thinking, "modes": dict(sorted(thinking["modes"].items()))}
    return metrics


def build(run: Path, tmp_path: Path) -> str:
    root = run.parents[1]
    files = RunFiles.from_run_dir(run, root / "benchmarks" / run.name, root / "logs" / run.name)
    page = tmp_path / "report" / "index.html"
    build_report(files, page, run=run.name)
    assert missing_references(page) == []
    assert page_sections(page).get("thinking") in (
        None,
        "Thinking mode: trained in, and served in the other",
    )
    return page.read_text()


def test_the_report_says_the_training_mode_and_what_the_other_mode_costs(tmp_path: Path):
    run = write_run(tmp_path)
    pl.DataFrame({"thinking": [True] * 5}).write_parquet(tmp_path / "train.parquet")
    write_json(run / "eval" / "metrics.json", metrics_in_both_modes(tmp_path / "train.parquet"))
    text = build(run, tmp_path)
    section = text.split("<h2 id='thinking'>")[1].split("<h2")[0]
    # The cost at the largest K, vLLM's figure: 1.4 / 2.8.
    assert "with thinking off, its acceptance length is 50.0% of that with thinking on (K=7" in (
        section
    )
    assert "<td>thinking on (all 5 samples)</td>" in section  # its training tokens' mode
    assert "off: 7 held-out prompts rendered with enable_thinking: false" in section
    # A row per mode and way: the trained mode marked, the other mode's figures beside it.
    rows = [
        ["on (trained in)", "live", "8", "512", "2.33", "2.3", "2.79", "2.7"],
        ["on (trained in)", "vLLM, greedy", "8", "512", "2.4", "2.4", "2.8", "2.8"],
        ["on (trained in)", "vLLM, sampled", "8", "512", "2", "2", "2.2", "2.2"],
        ["off", "live", "7", "512", "1.2", "1.2", "1.3", "1.3"],
        ["off", "vLLM, greedy", "7", "512", "1.2", "1.2", "1.4", "1.4"],
        ["off", "vLLM, sampled", "7", "512", "1.1", "1.1", "1.1", "1.1"],
    ]
    cells = ["<td>EAGLE-3</td>" + "".join(f"<td>{c}</td>" for c in row) for row in rows]
    assert all(c in section for c in cells), section
    # The generated mode first, each mode's ways in order.
    assert sorted(cells, key=section.index) == cells
    assert "1 held-out prompts end as the template renders neither mode" in section


def test_no_thinking_section_without_the_mode_in_the_metrics(tmp_path: Path):
    run = write_run(tmp_path)  # EVAL_METRICS: written before the mode was recorded
    assert "<h2 id='thinking'>" not in build(run, tmp_path)
