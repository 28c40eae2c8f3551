"""The figure files' formats (formats/metrics.py, formats/train_report.py): a real run's
eval/metrics.json and drafter/train_report.json read and written back key for key, the derived
figures against a hand computation, and a malformed file's error naming the file and the key.

data/: the two files of a real run of the small demo (config/tests/demo-small.yaml with
evaluate.depths [0, 64]: simulated, live, by depth and both thinking modes), as the stages
wrote them; the engine's figures (vLLM) are written here by hand in the shape
stages/evaluate/vllm_evaluate.py gives them."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from eaglenest.formats.figure_fields import FigureFileError
from eaglenest.formats.metrics import (
    CompareMetrics,
    EngineFigures,
    EvalMetrics,
    LiveFigures,
    SimulatedFigures,
    emitted_per_round,
    recorded_or_emitted,
)
from eaglenest.formats.train_report import TrainReport

DATA = Path(__file__).parent / "data"


def engine_figures(k: int, temperature: float = 0.0) -> dict:
    """One K's engine figures as vllm_evaluate.py files them (less the per-step record)."""
    return {
        "acceptance_length": 2.5,
        "rounds": 40,
        "rounds_per_prompt": [20, 20],
        "emitted_per_prompt": [55, 45],
        "per_position_acceptance": [0.7] + [0.4] * (k - 1),
        "accepted_per_position": [28] + [16] * (k - 1),
        "drafted_per_position": [40] * k,
        "draft_tokens": 40 * k,
        "accepted_tokens": 60,
        "tokens": 102,
        "prompts": 2,
        "identical_to_plain": True if temperature == 0 else None,
        "spec_wall_s": 1.5,
        "plain_wall_s": None if temperature else 2.0,
        "speedup": None if temperature else 1.33,
        "temperature": temperature,
        "set": "heldout",
        "spread": {"ci95": [2.1, 2.9], "prompts": 2},
        "by_position": {"bins": [{"start": 0, "acceptance_length": 2.5}]},
        "emitted_per_round": 2.5,
    }


def with_engine(metrics: dict) -> dict:
    """`metrics` with the engine's section, greedy and sampled, a K not served, and sets."""
    metrics = copy.deepcopy(metrics)
    ks = [str(k) for k in metrics["ks"]]
    metrics["engine"] = {
        "engine": "vllm",
        "prompts": 2,
        "max_new_tokens": 32,
        "plain": {"tokens": 64, "wall_s": 2.0},
        "per_k": {k: engine_figures(int(k)) for k in ks[:1]},
        "not_served": {ks[-1]: "vLLM's CPU build serves no such drafter here"},
        "definition": "vLLM's spec_decode counters: acceptance length = 1 + accepted / drafts",
        "sampled": {
            "temperature": 0.7,
            "top_p": 1.0,
            "seed": 0,
            "per_k": {k: engine_figures(int(k), 0.7) for k in ks[:1]},
            "by_depth": {},
        },
    }
    metrics["live_vs_engine"] = {ks[0]: 0.98}
    metrics["sets"] = {"mt_bench": {"temperature": 0.0, "engine": {"per_k": {}}}}
    return metrics


@pytest.fixture(scope="module")
def real_metrics() -> dict:
    return json.loads((DATA / "metrics.json").read_text())


@pytest.fixture(scope="module")
def real_train_report() -> dict:
    return json.loads((DATA / "train_report.json").read_text())


def test_a_real_runs_metrics_round_trip_key_for_key(real_metrics: dict):
    metrics = EvalMetrics.from_json(copy.deepcopy(real_metrics), "eval/metrics.json")
    assert metrics.to_json() == real_metrics
    written = json.dumps(metrics.to_json(), indent=2, sort_keys=True, ensure_ascii=False)
    assert written + "\n" == (DATA / "metrics.json").read_text()
    # What the report reads is typed.
    k = metrics.k_keys()[0]
    assert isinstance(metrics.simulated[k], SimulatedFigures)
    assert isinstance(metrics.live[k], LiveFigures)
    assert metrics.live[k].acceptance_length == real_metrics["live"][k]["acceptance_length"]
    assert metrics.by_depth.per_k[k][0].depth == 0
    assert metrics.thinking.to_json() == real_metrics["thinking"]
    assert metrics.thinking.heldout_mode == real_metrics["thinking"]["heldout_mode"]


def test_a_real_runs_train_report_round_trips_key_for_key(real_train_report: dict):
    report = TrainReport.from_json(copy.deepcopy(real_train_report), "drafter/train_report.json")
    assert report.to_json() == real_train_report
    written = json.dumps(report.to_json(), indent=2, sort_keys=True, ensure_ascii=False)
    assert written + "\n" == (DATA / "train_report.json").read_text()
    assert report.steps == real_train_report["steps"]
    assert report.train_acc == real_train_report["train_acc"]


def test_the_engines_figures_round_trip(real_metrics: dict):
    data = with_engine(real_metrics)
    metrics = EvalMetrics.from_json(copy.deepcopy(data))
    assert metrics.to_json() == data
    k = metrics.k_keys()[0]
    assert isinstance(metrics.engine.per_k[k], EngineFigures)
    assert metrics.engine.sampled.per_k[k].temperature == 0.7
    compare = {"name": "peer", "drafter": "/x", "ks": metrics.ks, "engine": data["engine"]}
    assert CompareMetrics.from_json(copy.deepcopy(compare)).to_json() == compare


def test_nulls_and_absent_keys_stay_as_they_were():
    data = {
        "ks": [3],
        "simulated": {"3": {"acceptance_length": 2.0, "conditional_acceptance": [0.5, 0, 0]}},
        "live": {"3": {"acceptance_length": 2.0, "greedy_s_per_token": None}},
    }
    assert EvalMetrics.from_json(copy.deepcopy(data)).to_json() == data


def test_a_record_built_by_the_stage_writes_its_frame_keys_as_null():
    simulated = SimulatedFigures(acceptance_length=2.0, conditional_acceptance=[0.5])
    metrics = EvalMetrics(ks=[1], simulated={"1": simulated}, more={"family": "x"})
    assert metrics.to_json() == {
        "ks": [1],
        "simulated": {"1": {"acceptance_length": 2.0, "conditional_acceptance": [0.5]}},
        "live": None,
        "live_baselines": None,
        "live_skipped_reason": None,
        "family": "x",
    }


def test_emitted_per_round_by_hand():
    # 654 tokens over 16 prompts: the prefill emits one each, 638 in 210 rounds.
    assert emitted_per_round(654, 16, 210) == pytest.approx(638 / 210)
    assert emitted_per_round(10, 2, 0) is None
    assert emitted_per_round(None, 2, 4) is None
    engine = EngineFigures.from_json(engine_figures(3))
    assert engine.emitted() == pytest.approx((102 - 2) / 40)
    live = LiveFigures.from_json({"acceptance_length": 2.0, "emitted_per_round": 1.75})
    assert live.emitted() == 1.75
    assert recorded_or_emitted({"emitted_per_round": 1.75, "tokens": 9}) == 1.75
    assert recorded_or_emitted({"tokens": 22, "prompts": 2, "rounds": 8}) == 2.5


def test_live_over_simulated_by_hand(real_metrics: dict):
    metrics = EvalMetrics.from_json(copy.deepcopy(real_metrics))
    for k, ratio in metrics.live_over_simulated().items():
        live, simulated = real_metrics["live"][k], real_metrics["simulated"][k]
        assert ratio == pytest.approx(live["acceptance_length"] / simulated["acceptance_length"])
        assert ratio == pytest.approx(real_metrics["live_vs_simulated"][k])


def broken(data: dict, *path_and_value) -> dict:
    data = copy.deepcopy(data)
    *path, value = path_and_value
    at = data
    for key in path[:-1]:
        at = at[key]
    if value is KeyError:
        del at[path[-1]]
    else:
        at[path[-1]] = value
    return data


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            ("simulated", "2", "conditional_acceptance", KeyError),
            r"simulated\[2\]: missing 'conditional_acceptance'",
        ),
        (("live", "3", "speedup", "fast"), r"live\[3\]: 'speedup' must be a number, got \"fast\""),
        (("ks", [2, 5]), r"'simulated' has no entry for K=5"),
        (
            ("engine", "per_k", "2", "acceptance_length", "2"),
            r"engine\.per_k\[2\]: 'acceptance_length' must be a number",
        ),
        (
            ("engine", "sampled", "per_k", "2", "rounds", 1.5),
            r"engine\.sampled\.per_k\[2\]: 'rounds' must be an integer",
        ),
        (("by_depth", "per_k", "2", {}), r"by_depth\.per_k\[2\]: expected a list of depth rows"),
        (
            ("by_depth", "per_k", "2", 0, "live", "tokens", "many"),
            r"by_depth\.per_k\[2\]\[0\]\.live: 'tokens' must be an integer",
        ),
        (
            ("baselines", "untrained", "2", "acceptance_length", KeyError),
            r"baselines\[untrained\]\[2\]: missing 'acceptance_length'",
        ),
    ],
)
def test_a_malformed_metrics_file_names_the_file_and_the_key(
    tmp_path: Path, real_metrics: dict, change: tuple, message: str
):
    path = tmp_path / "eval" / "metrics.json"
    path.parent.mkdir()
    path.write_text(json.dumps(broken(with_engine(real_metrics), *change)))
    with pytest.raises(FigureFileError, match=rf"^{path}.*{message}"):
        EvalMetrics.read(path)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"ttt_steps": 3, "train_acc": [0.5]}', r"missing 'steps' \(an integer\)"),
        (
            '{"steps": 4, "ttt_steps": 3, "train_acc": "high"}',
            r"'train_acc' must be a list of numbers",
        ),
        ("[1]", r"expected a JSON object, got list"),
        ("{", r"not readable as JSON"),
    ],
)
def test_a_malformed_train_report_names_the_file_and_the_key(
    tmp_path: Path, content: str, message: str
):
    path = tmp_path / "train_report.json"
    path.write_text(content)
    with pytest.raises(FigureFileError, match=rf"^{path}: {message}"):
        TrainReport.read(path)
