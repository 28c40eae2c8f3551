"""The report shows the serving engine's greedy and sampled figures side by side with their
spread over prompts, acceptance by generated position as a table and a panel beside the
by-depth one, and the sampled figures in the depth table; eval/metrics.json's figures made by
the evaluate stage's own functions (vllm_evaluate.figures_at_temperatures, depths.depth_table)
on answers shaped as the engine gives them."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
from support.report_run import EVAL_METRICS, missing_references, write_json, write_run

from eaglenest.stages.evaluate.depths import DepthCut, depth_table
from eaglenest.stages.evaluate.vllm_evaluate import Sampling, figures_at_temperatures
from eaglenest.stages.report.inputs import ReportInputError, RunFiles
from eaglenest.stages.report.report import build_report

SAMPLING = Sampling(0.7, seed=11)


def engine_answer(per_prompt: list[list[int]], k: int) -> dict:
    """An engine answer (vllm_engine/decode.py's): each prompt's accepted drafts per step, its
    tokens the ones those steps emit, the counters their sums."""
    tokens = [[5] * (1 + sum(a + 1 for a in steps)) for steps in per_prompt]
    steps = sum(len(s) for s in per_prompt)
    accepted = sum(sum(s) for s in per_prompt)
    return {
        "tokens": tokens,
        "wall_s": 1.0,
        "spec": {"drafts": steps, "accepted_tokens": accepted, "draft_tokens": k * steps,
                 "accepted_per_position": [accepted] + [0] * (k - 1)},
        "rounds_per_prompt": [len(s) for s in per_prompt],
        "per_step_accepted": per_prompt,
        "per_step_drafted": [[k] * len(s) for s in per_prompt],
    }  # fmt: skip


def engine_figures(k: int) -> dict[str, dict]:
    """K's figures by temperature: greedy accepts 2 drafts a step, sampled 1, over 6 prompts
    (one step of each a draft above or below, the totals even)."""
    shift = [(i % 3) - 1 for i in range(6)]
    greedy = engine_answer([[2 + d, 2, 3, 1, 2, 2, 2, 2, 2, 2] for d in shift], k)
    sampled = [[1 + d, 0, 1, 2, 1, 1] + [1, 0, 1, 2, 1, 1] * 2 for d in shift]
    greedy["sampled"] = {"0.7": engine_answer(sampled, k)}
    plain = {"tokens": greedy["tokens"], "wall_s": 2.0}
    return figures_at_temperatures(greedy, plain, k, 64, SAMPLING)


def metrics_with_engine() -> dict:
    metrics = copy.deepcopy(EVAL_METRICS)
    figures = {str(k): engine_figures(k) for k in metrics["ks"]}
    metrics["engine"] = {
        "engine": "vllm",
        "per_k": {k: f["0"] for k, f in figures.items()},
        "sampled": {"temperature": 0.7, "top_p": 1.0, "seed": 11,
                    "per_k": {k: f["0.7"] for k, f in figures.items()}},
    }  # fmt: skip
    cuts = [DepthCut(0, [[1]] * 6), DepthCut(64, [[1]] * 6)]
    at = {key: {str(c.depth): {k: f[key] for k, f in figures.items()} for c in cuts}
          for key in ("0", "0.7")}  # fmt: skip
    metrics["by_depth"] = depth_table(cuts, (3, 7), 64, {}, None, at["0"], at["0.7"]).to_json()
    return metrics


def test_greedy_and_sampled_are_shown_side_by_side_with_their_spread(tmp_path: Path):
    run = write_run(tmp_path)
    metrics = metrics_with_engine()
    write_json(run / "eval" / "metrics.json", metrics)
    root = run.parents[1]
    files = RunFiles.from_run_dir(run, root / "benchmarks" / run.name, root / "logs" / run.name)
    page = tmp_path / "report" / "index.html"
    build_report(files, page, run=run.name)
    text = page.read_text()
    assert "Greedy and sampled, with the spread over prompts (vllm)" in text
    spread_table = text.split("Greedy and sampled, with the spread over prompts")[1]
    spread_table = spread_table.split("</table>")[0]
    # Greedy 1 + 2.0 a step, sampled 1 + 1.0: both rows per K, the difference paired and signed.
    assert spread_table.count("<td>3</td><td>0</td><td>3</td>") == 1
    assert spread_table.count("<td>3</td><td>0.7</td><td>2</td>") == 1
    assert spread_table.count("<td>-1.000</td>") == 2  # K=3 and K=7
    assert "<td>2.92 / 3 / 3.08</td><td>2.9 – 3.1</td>" in spread_table  # the per-prompt spread
    assert "temperature 0.7, top_p 1, vLLM's rejection sampling, each prompt seeded from 11" in text
    assert "Acceptance by generated position (vllm)" in text
    assert "<th>0–8</th>" in text and "<th>56–64</th>" in text
    assert "engine acceptance length at T=0.7" in text
    assert missing_references(page) == []
    assert (page.parent / "acceptance.png").stat().st_size > 1000

    broken = copy.deepcopy(metrics)
    broken["engine"]["sampled"]["per_k"]["3"].pop("acceptance_length")
    write_json(run / "eval" / "metrics.json", broken)
    with pytest.raises(ReportInputError, match=r"engine\.sampled\.per_k\[3\].*acceptance_length"):
        build_report(files, tmp_path / "again" / "index.html", run=run.name)
