"""Depth health (report/summary.json `depth_health`, stages/report/depth_health.py): from
hand-built depth tables, a flat curve holds, a gradual fall is a decay, a cliff just past a
configured position is a step naming its key, a fall inside the noise is no collapse, one depth
is a reason; and a report of a run carries it in summary.json and on the page."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from support.report_run import family_eval, write_family, write_json, write_run

from eaglenest.common.config import ConfigError, settings_from_sections
from eaglenest.settings.report import ReportSettings
from eaglenest.stages.report.depth_health import bootstrap_interval, family_health
from eaglenest.stages.report.inputs import RunFiles
from eaglenest.stages.report.report import build_report

DEPTHS = (0, 1024, 2048, 4096, 8192)
CONTINUATION = 256
# Eight prompts' spread around a depth's mean: the same at every depth, so only the mean moves.
SPREAD = (-0.12, 0.1, -0.05, 0.08, 0.0, -0.09, 0.11, -0.03)


def row(depth: int, lengths: list[float], source: str = "live") -> dict:
    """A depth row whose `source` figures have these per-prompt acceptance lengths (20 rounds
    each, so the pooled figure is their mean)."""
    figures = {
        "acceptance_length": sum(lengths) / len(lengths),
        "rounds": 20 * len(lengths),
        "prompts": len(lengths),
        "per_prompt": lengths,
        "rounds_per_prompt": [20] * len(lengths),
    }
    return {"depth": depth, "prompts": len(lengths), "live": None, "engine": None, source: figures}


def metrics(means: list[float], ks=(3, 7), depths=DEPTHS, source: str = "live") -> dict:
    """An eval metrics.json's `by_depth` with these mean acceptance lengths by depth (each K's
    the same; the larger K a bit higher, so a mix-up of K shows)."""
    per_k = {
        str(k): [
            row(d, [m + s + (k - min(ks)) * 0.5 for s in SPREAD], source)
            for d, m in zip(depths, means, strict=True)
        ]
        for k in ks
    }
    return {"by_depth": {"depths": list(depths), "continuation_tokens": CONTINUATION,
                         "per_k": per_k}}  # fmt: skip


def test_a_flat_curve_is_no_collapse():
    health = family_health(metrics([3.0, 3.05, 2.95, 3.0, 2.98]), None, None, 0.7)
    assert health["collapse_at"] is None and health["kind"] is None and health["fix"] == []
    assert health["source"] == "live" and health["k"] == 3 and health["threshold"] == 0.7
    assert list(health["by_depth"]) == [str(d) for d in DEPTHS]
    first, deep = health["by_depth"]["0"], health["by_depth"]["8192"]
    assert first["ratio"] == 1.0 and first["prompts"] == 8
    assert first["acceptance"] == pytest.approx(3.0)  # K=3's, not K=7's 3.5
    lo, hi = first["interval"]
    assert lo < first["acceptance"] < hi and hi - lo < 0.3
    assert deep["ratio"] == pytest.approx(2.98 / 3.0)
    assert deep["ratio_interval"][0] < deep["ratio"] < deep["ratio_interval"][1]
    assert "No collapse" in health["message"]


def test_a_gradual_fall_is_a_decay_at_the_first_depth_wholly_below_the_threshold():
    # Ratios 1, 0.87, 0.73, 0.6, 0.5: 2048 is above 0.7 (its interval too), 4096 the first below.
    config = {"max_position_embeddings": 4096}  # in reach, but the fall took several depths
    health = family_health(metrics([3.0, 2.6, 2.2, 1.8, 1.5]), config, None, 0.7)
    assert health["collapse_at"] == 4096 and health["kind"] == "decay"
    assert health["position"] is None
    assert health["fix"] == ["train.sequence.mode", "train.sequence.length"]
    assert "train.sequence.mode: windows" in health["message"]
    # A stricter threshold calls it later.
    assert (
        family_health(metrics([3.0, 2.6, 2.2, 1.8, 1.5]), config, None, 0.55)["collapse_at"] == 8192
    )


CLIFF = [3.0, 3.02, 2.97, 1.05, 1.03]  # falls to near 1 between 2048 and 4096


@pytest.mark.parametrize(
    ("config", "report", "key", "fix"),
    [
        ({"max_position_embeddings": 3000}, None, "max_position_embeddings",
         ["train.drafter.max_position_embeddings"]),
        ({"max_position_embeddings": 32768, "sliding_window": 2560}, None, "sliding_window",
         ["train.drafter.sliding_window"]),
        ({"rope_scaling": {"rope_type": "yarn", "original_max_position_embeddings": 4096}}, None,
         "rope_scaling.original_max_position_embeddings",
         ["train.drafter.rope_theta", "the target's rope scaling (target.path config.json)"]),
        (None, {"steps": 1, "max_position_trained": 4200}, "max_position_trained",
         ["train.sequence.mode", "train.sequence.length"]),
    ],
)  # fmt: skip
def test_a_cliff_past_a_configured_position_is_a_step_naming_it(config, report, key, fix):
    health = family_health(metrics(CLIFF), config, report, 0.7)
    assert health["collapse_at"] == 4096 and health["kind"] == "step"
    assert health["position"]["key"] == key and health["fix"] == fix
    assert key in health["message"] and "step" in health["message"]


def test_the_same_cliff_with_no_configured_position_in_reach_is_learned():
    # 32768 positions and a window of 1024 (reached before 1024, not between 2048 and 4096).
    config = {"max_position_embeddings": 32768, "sliding_window": 1024}
    health = family_health(metrics(CLIFF), config, {"steps": 1}, 0.7)
    assert health["collapse_at"] == 4096 and health["kind"] == "decay"
    assert health["position"] is None


def test_a_fall_inside_the_noise_is_no_collapse():
    # Depth 2048's mean is 0.58x depth 0's, but its prompts spread from 1.1 to 3.2.
    by_depth = metrics([3.0, 3.0], depths=(0, 2048), ks=(3,))
    deep = by_depth["by_depth"]["per_k"]["3"][1]["live"]
    deep["per_prompt"] = [1.1, 3.2, 1.2, 1.3, 3.1, 1.15, 1.2, 1.6]
    deep["acceptance_length"] = sum(deep["per_prompt"]) / 8
    health = family_health(by_depth, None, None, 0.7)
    assert health["by_depth"]["2048"]["ratio"] < 0.7
    assert health["by_depth"]["2048"]["ratio_interval"][1] >= 0.7
    assert health["collapse_at"] is None and health["kind"] is None
    # The same mean from tight prompts is a collapse.
    deep["per_prompt"] = [1.74] * 8
    deep["acceptance_length"] = 1.74
    assert family_health(by_depth, None, None, 0.7)["collapse_at"] == 2048


def test_one_depth_is_a_reason_not_a_verdict():
    health = family_health(metrics([3.0], depths=(0,)), None, None, 0.7)
    assert health["collapse_at"] is None and health["kind"] is None
    assert "1 depth measured" in health["reason"] and "not judged" in health["message"]
    assert list(health["by_depth"]) == ["0"]
    none = family_health({"ks": [3]}, None, None, 0.7)
    assert "0 depth measured" in none["reason"] and none["source"] is None


def test_vllms_rows_come_first_and_its_interval_without_per_prompt_figures():
    by_depth = metrics([3.0, 1.0], depths=(0, 4096), ks=(3,))
    for depth_row, (engine, ci95) in zip(
        by_depth["by_depth"]["per_k"]["3"], [(2.8, [2.6, 3.0]), (1.02, [1.0, 1.05])], strict=True
    ):
        depth_row["engine"] = {"acceptance_length": engine, "ci95": ci95, "prompts": 8}
    health = family_health(by_depth, None, None, 0.7)
    assert health["source"] == "vllm" and health["by_depth"]["0"]["acceptance"] == 2.8
    assert health["by_depth"]["4096"]["interval"] == [1.0, 1.05]
    assert health["collapse_at"] == 4096 and health["kind"] == "decay"


def test_the_bootstrap_is_seeded_and_weighs_prompts_by_their_rounds():
    lengths = [1.5, 2.0, 3.5, None, 2.5]
    first = bootstrap_interval(lengths, [10, 30, 5, 0, 20], 2048)
    assert first == bootstrap_interval(lengths, [10, 30, 5, 0, 20], 2048)
    # A prompt of many rounds weighs as its rounds do: it pulls the pooled figure to its length.
    lengths, rounds = [1.5] + [3.5] * 9, [1000] + [1] * 9
    assert bootstrap_interval(lengths, rounds, 0)[0] < 1.6
    assert bootstrap_interval(lengths, None, 0)[0] > 2.5  # without rounds: each prompt once
    assert bootstrap_interval([None], None, 0) is None


def test_collapse_ratio_is_a_config_key_the_report_rule_tracks():
    assert settings_from_sections(ReportSettings).collapse_ratio == 0.7
    stricter = settings_from_sections(ReportSettings, report={"collapse_ratio": 0.5})
    assert stricter.collapse_ratio == 0.5
    # The rule's `settings` param is this JSON: a new ratio reruns the report.
    assert stricter.to_json() != settings_from_sections(ReportSettings).to_json()
    with pytest.raises(ConfigError, match="collapse_ratio"):
        settings_from_sections(ReportSettings, report={"collapse_ratio": 1.5})


def test_the_report_carries_depth_health_in_summary_and_page(tmp_path: Path):
    run = write_run(tmp_path)
    # EAGLE-3 holds by depth (no per-prompt figures: its points); P-EAGLE falls off a cliff past
    # its drafter's max_position_embeddings, with each prompt's figures.
    write_family(run, "eagle3", family_eval([3], {0: (2.5, 0.004), 1024: (2.45, 0.004)}))
    cliff = family_eval([3], {0: (2.5, 0.002), 1024: (2.5, 0.002), 2048: (0.98, 0.002)}, "p_eagle")
    for depth_row in cliff["by_depth"]["per_k"]["3"]:
        live = depth_row["live"]
        live["per_prompt"] = [live["acceptance_length"] + s / 4 for s in SPREAD[:4]]
        live["rounds_per_prompt"] = [5] * 4
    write_family(run, "p_eagle", copy.deepcopy(cliff))
    write_json(run / "drafter_p_eagle" / "config.json", {"max_position_embeddings": 1536})
    root = run.parents[1]
    files = RunFiles.from_run_dir(run, root / "benchmarks" / run.name, root / "logs" / run.name)
    assert [p.parent.name for p in files.drafter_config] == ["drafter", "drafter_p_eagle"]
    build_report(files, run / "report" / "index.html", run=run.name, collapse_ratio=0.7)
    health = json.loads((run / "report" / "summary.json").read_text())["depth_health"]
    assert set(health) == {"eagle3", "p_eagle"}
    assert health["eagle3"]["collapse_at"] is None and health["eagle3"]["source"] == "live"
    assert health["eagle3"]["by_depth"]["0"]["interval"] is None
    p_eagle = health["p_eagle"]
    assert (p_eagle["collapse_at"], p_eagle["kind"], p_eagle["k"]) == (2048, "step", 3)
    assert p_eagle["position"] == {
        "key": "max_position_embeddings",
        "value": 1536,
        "file": "config.json",
    }
    assert p_eagle["fix"] == ["train.drafter.max_position_embeddings"]
    assert set(p_eagle["by_depth"]["2048"]) >= {"acceptance", "interval", "ratio", "prompts"}
    page = (run / "report" / "index.html").read_text()
    assert page.count("<h3>Depth health") == 2
    assert "Collapse at depth 2048" in page and "train.drafter.max_position_embeddings" in page
