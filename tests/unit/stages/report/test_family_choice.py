"""The run's choice of drafter family (stages/report/choice.py): tokens per target step charge
a family its drafter's time and its verification, the depths are weighted by where the run's
answers lie, each family counts at its best K; and which families the report reads
(family_files.py: those listed and those evaluated already, so taking one out reruns nothing)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import polars as pl
import pytest
from support.report_run import EVAL_METRICS, family_eval, write_json

from eaglenest.stages.report.choice import DepthFigures, choose_family, depth_weights
from eaglenest.stages.report.family_files import family_files, family_of_path, report_families


def lengths(*samples: tuple[int, int]) -> pl.DataFrame:
    """Token lengths of samples given as (prompt_len, n_tokens)."""
    prompt, total = zip(*samples, strict=True)
    return pl.DataFrame({"prompt_len": list(prompt), "n_tokens": list(total)})


def test_each_depth_weighs_the_generated_tokens_between_it_and_the_next():
    # Answers of 90 and 20 generated tokens (depths 0..89, 0..19): below 50, 50 + 20; from 50, 40.
    answers = lengths((10, 100), (10, 30))
    assert depth_weights(answers, [50, 0]) == pytest.approx({0: 70 / 110, 50: 40 / 110})
    # A depth no answer reaches weighs nothing; the first depth takes what lies below it.
    assert depth_weights(answers, [0, 50, 200])[200] == 0
    assert depth_weights(answers, [20]) == {20: 1.0}
    # Without the run's lengths every depth weighs the same.
    assert depth_weights(None, [0, 512]) == {0: 0.5, 512: 0.5}


def test_tokens_per_target_step_charge_the_drafter_and_the_verification():
    row = DepthFigures(
        depth=0,
        prompts=4,
        acceptance_length=3.1,
        emitted_per_round=3.0,
        engine_emitted_per_round=None,
        simulated_acceptance_length=None,
        drafter_s_per_round=0.006,
        target_s_per_round=0.012,
        greedy_s_per_token=0.010,
    )
    # A round takes 18 ms, 1.8 of the target's plain greedy steps, and emits 3 tokens.
    assert row.tokens_per_s == pytest.approx(3.0 / 0.018)
    assert row.tokens_per_target_step == pytest.approx(3.0 / 1.8)
    # Evaluated before the times were recorded: no figure, never a guess.
    assert dataclasses.replace(row, drafter_s_per_round=None).tokens_per_target_step is None


def test_the_family_chosen_pays_for_its_drafter_not_only_its_acceptance():
    # EAGLE-3 emits more a round, but its K forwards take 30 ms; DFlash's one forward 2 ms.
    eagle3 = family_eval([3], {0: (3.0, 0.030)})
    dflash = family_eval([3], {0: (2.6, 0.002)}, family="dflash")
    summary = choose_family({"eagle3": eagle3, "dflash": dflash}, None)
    per_k = {f: v["per_k"]["3"]["tokens_per_target_step"] for f, v in summary["families"].items()}
    # 3.0 tokens a 40 ms round (5 greedy steps of 8 ms), 2.6 a 12 ms one (1.5 steps).
    assert per_k == pytest.approx({"eagle3": 3.0 / 5, "dflash": 2.6 / 1.5})
    assert summary["choice"]["family"] == "dflash" and summary["choice"]["k"] == 3
    assert summary["choice"]["tokens_per_s"] == pytest.approx(2.6 / 0.012)


def test_the_family_chosen_is_the_one_that_holds_at_the_depths_the_answers_reach():
    # EAGLE-3 is better near the prompt, P-EAGLE holds deep into an answer.
    eagle3 = family_eval([3], {0: (3.0, 0.002), 512: (1.2, 0.002)})
    p_eagle = family_eval([3], {0: (2.4, 0.002), 512: (2.2, 0.002)}, family="p_eagle")
    families = {"eagle3": eagle3, "p_eagle": p_eagle}
    short = choose_family(families, lengths((20, 200), (20, 300)))
    assert short["choice"]["family"] == "eagle3"
    assert short["choice"]["depth_weights"] == {"0": 1.0, "512": 0.0}
    long = choose_family(families, lengths((20, 4000)))
    assert long["choice"]["family"] == "p_eagle"
    # Total tokens over total time: an answer of 3980 generated tokens, 512 below depth 512 at
    # 2.4 / 1.5 a step, 3468 from there at 2.2 / 1.5.
    expected = 3980 / (512 / (2.4 / 1.5) + 3468 / (2.2 / 1.5))
    assert long["choice"]["tokens_per_target_step"] == pytest.approx(expected)


def test_each_family_counts_at_its_best_k():
    # EVAL_METRICS (no depth table: the held-out prompts' live figures): K=3 emits 2.3 a 14 ms
    # round, K=7 2.7 a 21 ms one; a greedy step takes 8 ms.
    summary = choose_family({"eagle3": EVAL_METRICS}, None)
    family = summary["families"]["eagle3"]
    assert family["best_k"] == "3"
    assert family["per_k"]["7"]["tokens_per_target_step"] == pytest.approx(2.7 / (21 / 8))
    assert summary["choice"]["k"] == 3


def test_no_family_is_chosen_without_live_times_and_the_summary_says_why():
    untimed = {**EVAL_METRICS, "live": None, "live_skipped_reason": "evaluate.live is false"}
    summary = choose_family({"eagle3": untimed}, None)
    assert summary["choice"] is None
    assert summary["why_none"] == (
        "not decoded live, so no drafter or target time: evaluate.live is false"
    )
    assert choose_family({}, None)["why_none"].startswith("no drafter family evaluated yet")


def test_the_report_reads_the_families_listed_and_those_evaluated_already(tmp_path: Path):
    run = tmp_path / "results" / "run"
    write_json(run / "eval_dflash" / "metrics.json", {})
    write_json(run / "eval" / "metrics.json", {})
    write_json(run / "drafter" / "train_report.json", {})
    # EAGLE-3 and DFlash were evaluated, then taken out of train.families: still read, so the
    # report's inputs do not shrink (Snakemake would rerun it).
    families = report_families(["p_eagle"], run)
    assert families == ["eagle3", "p_eagle", "dflash"]
    evals = family_files("eval_metrics", families, run, ["p_eagle"])
    assert evals == [str(run / d / "metrics.json") for d in ("eval", "eval_p_eagle", "eval_dflash")]
    # A family taken out is read for what it has; a listed one for what its jobs will make.
    reports = family_files("train_report", families, run, ["p_eagle"])
    assert reports == [str(run / d / "train_report.json") for d in ("drafter", "drafter_p_eagle")]
    assert report_families(["eagle3"], tmp_path / "fresh") == ["eagle3"]
    assert family_of_path(run / "drafter_p_eagle" / "metrics.jsonl") == "p_eagle"
    assert family_of_path(run / "eval" / "metrics.json") == "eagle3"
    with pytest.raises(ValueError, match="not in a drafter family"):
        family_of_path(run / "vocab" / "draft_vocab.json")
