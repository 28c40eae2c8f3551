"""The family choice on the serving device (stages/report/device_choice.py, report.device):
tokens per target step = tau / (v(K) + d r) from vLLM's per-prompt figures, the curve against r,
the crossovers and the margin's bootstrap interval against a hand computation; no choice without
the device's timings; report.device's keys checked, a bad one named."""

from __future__ import annotations

import json
from pathlib import Path

import polars as pl
import pytest

from eaglenest.settings.report import DeviceTimings, ReportSettings, device_timings
from eaglenest.stages.report.device_choice import WHY_NO_DEVICE, choose_on_device


def lengths(*samples: tuple[int, int]) -> pl.DataFrame:
    """Token lengths of samples given as (prompt_len, n_tokens)."""
    prompt, total = zip(*samples, strict=True)
    return pl.DataFrame({"prompt_len": list(prompt), "n_tokens": list(total)})


DEVICE = DeviceTimings(
    name="H200",
    source="user",
    drafter_ratio=0.05,
    family_ratios={"dflash": 0.1},  # DFlash's deeper drafter: twice the ratio
    verify_cost={"3": 1.1},  # K=7 has none: left out
)


def engine_metrics(emitted: list[int], rounds: list[int]) -> dict:
    """A family's metrics at K 3 and 7: vLLM's per-prompt figures at K 3."""
    figures = {"emitted_per_prompt": emitted, "rounds_per_prompt": rounds, "prompts": 2}
    figures |= {"tokens": sum(emitted) + 2, "rounds": sum(rounds)}
    return {"ks": [3, 7], "engine": {"per_k": {"3": figures, "7": figures}, "not_served": {}}}


FAMILIES = {
    # tau: 30 / 10 = 3 (prompt 0 alone: 2, prompt 1 alone: 4), K forwards a round
    "eagle3": engine_metrics([10, 20], [5, 5]),
    # tau 2.0, one forward a round
    "p_eagle": engine_metrics([9, 15], [6, 6]),
    # tau 2.2 on every prompt, one forward a round at twice the ratio
    "dflash": engine_metrics([11, 11], [5, 5]),
}


def test_the_family_chosen_on_the_device_and_its_curve_by_hand():
    summary = choose_on_device(FAMILIES, DEVICE)
    # At r = 0.05: EAGLE-3 3 / (1.1 + 3 r), P-EAGLE 2 / (1.1 + r), DFlash 2.2 / (1.1 + 2 r).
    rates = {"eagle3": 3 / 1.25, "p_eagle": 2 / 1.15, "dflash": 2.2 / 1.2}
    for family, rate in rates.items():
        figures = summary["by_family"][family]
        assert figures["best_k"] == 3 and figures["per_k"]["7"]["tokens_per_target_step"] is None
        assert figures["per_k"]["3"]["tokens_per_target_step"] == pytest.approx(rate)
    choice = summary["choice"]
    assert (choice["family"], choice["k"], choice["device"]) == ("eagle3", 3, "H200")
    assert choice["tokens_per_target_step"] == pytest.approx(2.4)
    assert choice["acceptance_source"] == "vllm" and choice["timings_source"] == "user"
    curve = summary["curve"]
    assert curve["ratios"][0] == pytest.approx(0.002) and curve["ratios"][-1] == pytest.approx(0.5)
    at = curve["ratios"].index(min(curve["ratios"], key=lambda r: abs(r - 0.1)))
    r = curve["ratios"][at]
    assert curve["families"]["dflash"]["tokens_per_target_step"][at] == pytest.approx(
        2.2 / (1.1 + 2 * r)
    )
    # EAGLE-3 meets P-EAGLE where 3 (1.1 + r) = 2 (1.1 + 3 r): r = 1.1 / 3; P-EAGLE meets
    # DFlash at r = 0.22 / 1.8 below EAGLE-3 (no change of the best), EAGLE-3 meets DFlash past 1.
    assert summary["crossovers"] == [crossover(1.1 / 3, ("eagle3", 3), ("p_eagle", 3))]


def crossover(ratio: float, below: tuple[str, int], above: tuple[str, int]) -> dict:
    """A crossover as the summary lists it: the family and K best below the ratio and above."""
    return {"ratio": pytest.approx(ratio), "below": below[0], "above": above[0],
            "k_below": below[1], "k_above": above[1]}  # fmt: skip


def per_k_metrics(by_k: dict[str, tuple[list[int], list[int]]]) -> dict:
    """A family's metrics with vLLM's per-prompt figures (emitted, rounds) at each K."""
    per_k = {}
    for k, (emitted, rounds) in by_k.items():
        figures = {"emitted_per_prompt": emitted, "rounds_per_prompt": rounds, "prompts": 2}
        per_k[k] = figures | {"tokens": sum(emitted) + 2, "rounds": sum(rounds)}
    return {"ks": [int(k) for k in by_k], "engine": {"per_k": per_k, "not_served": {}}}


def test_the_curve_re_picks_each_familys_k_along_the_ratio_by_hand():
    # EAGLE-3: tau 3 at K=3, 4 at K=7 (K forwards a round); DFlash: 2.5 at K=3, 3 at K=7 (one).
    families = {
        "eagle3": per_k_metrics({"3": ([15, 15], [5, 5]), "7": ([20, 20], [5, 5])}),
        "dflash": per_k_metrics({"3": ([10, 15], [5, 5]), "7": ([15, 15], [5, 5])}),
    }
    device = DeviceTimings("H200", "user", 0.2, {}, {"3": 1.0, "7": 1.0})
    summary = choose_on_device(families, device)
    # At the device's r = 0.2: EAGLE-3 K=3 3 / 1.6 beats its K=7 4 / 2.4; DFlash K=7 3 / 1.2.
    assert summary["by_family"]["eagle3"]["best_k"] == 3
    assert (summary["choice"]["family"], summary["choice"]["k"]) == ("dflash", 7)
    # EAGLE-3's K=7 and K=3 meet where 4 (1 + 3r) = 3 (1 + 7r): r = 1/9.
    eagle3 = summary["curve"]["families"]["eagle3"]
    assert eagle3["k"] == 3
    assert eagle3["k_changes"] == [{"ratio": pytest.approx(1 / 9), "k_below": 7, "k_above": 3}]
    ratios = summary["curve"]["ratios"]
    assert eagle3["ks"] == [7 if r < 1 / 9 else 3 for r in ratios]
    assert eagle3["tokens_per_target_step"][0] == pytest.approx(4 / (1 + 7 * ratios[0]))
    assert summary["curve"]["families"]["dflash"]["k_changes"] == []
    # EAGLE-3 at K=7 meets DFlash at K=7 where 4 (1 + r) = 3 (1 + 7r): r = 1/17. At its K of
    # the device's ratio (3) alone, EAGLE-3 would meet DFlash nowhere in (0, 1] (3 (1 + r) =
    # 3 (1 + 3r) at r = 0): the crossover is there only because K is re-picked along r.
    assert summary["crossovers"] == [crossover(1 / 17, ("eagle3", 7), ("dflash", 7))]


def test_the_margins_interval_by_hand():
    # Second: DFlash, 2.2 / 1.2 on every prompt. Paired draws of two prompts: both prompt 0
    # (EAGLE-3 tau 2), both prompt 1 (tau 4) or one each (tau 3), the lowest and the highest a
    # quarter of the draws each: the 2.5 and 97.5 percentiles are the extremes.
    margin = choose_on_device(FAMILIES, DEVICE)["choice"]["margin"]
    assert margin["over"] == "dflash" and margin["paired"] is True
    assert margin["tokens_per_target_step"] == pytest.approx(2.4 - 2.2 / 1.2)
    assert margin["relative"] == pytest.approx(2.4 / (2.2 / 1.2) - 1)
    assert margin["ci95"] == pytest.approx([2 / 1.25 - 2.2 / 1.2, 4 / 1.25 - 2.2 / 1.2])
    assert (margin["resamples"], margin["seed"]) == (2000, 0)
    # Behind on a quarter of the draws (both prompt 0).
    assert margin["share_ahead"] == pytest.approx(0.75, abs=0.03)
    # The same seed, the same interval.
    assert choose_on_device(FAMILIES, DEVICE)["choice"]["margin"] == margin


def test_a_family_vllm_did_not_serve_counts_with_our_live_loops_acceptance_said_so():
    live = {"3": {"tokens": 26, "prompts": 2, "rounds": 10, "acceptance_length": 2.4}}
    unserved = {"ks": [3], "live": live, "engine": {"per_k": {}, "not_served": {"3": "MLA"}}}
    summary = choose_on_device({"eagle3": FAMILIES["eagle3"], "dflash": unserved}, DEVICE)
    figures = summary["by_family"]["dflash"]["per_k"]["3"]
    assert figures["acceptance_source"] == "our live loop (MLA)"
    # tau (26 - 2) / 10, one forward at DFlash's ratio 0.1.
    assert figures["tokens_per_target_step"] == pytest.approx(2.4 / 1.2)
    # Totals only: no interval, and the summary says why.
    assert summary["choice"]["margin"]["ci95"] is None
    assert "per-prompt" in summary["choice"]["margin"]["why_no_interval"]


def test_no_choice_without_the_devices_timings_and_the_summary_says_why():
    summary = choose_on_device(FAMILIES, None)
    assert summary["choice"] is None and summary["device"] is None
    assert summary["why_none"] == WHY_NO_DEVICE
    assert "report.device" in summary["why_none"]
    assert ReportSettings.from_config({"report": {"device": None}}).device is None


def timings(**section) -> DeviceTimings:
    return device_timings({"drafter_ratio": 0.03, "verify_cost": {"3": 1.05}, **section})


@pytest.mark.parametrize(
    ("section", "key"),
    [
        ({"drafter_ratio": 0.0}, "report.device.drafter_ratio: 0.0 is outside (0, 1]"),
        ({"drafter_ratio": 1.5}, "report.device.drafter_ratio: 1.5 is outside (0, 1]"),
        ({"family_ratios": {"dflash": 2}}, "report.device.family_ratios.dflash: 2 is outside"),
        ({"family_ratios": {"medusa": 0.1}}, "report.device.family_ratios: 'medusa' is not"),
        ({"verify_cost": {"3": 0.9}}, "report.device.verify_cost.3: 0.9 is below 1"),
        ({"verify_cost": {}}, "report.device.verify_cost: none given"),
        ({"drafter_ratio": None}, "report.device.drafter_ratio: not given"),
    ],
)
def test_a_bad_device_timing_is_refused_naming_its_key(section: dict, key: str):
    with pytest.raises(ValueError, match="^" + key.replace("(", r"\(").replace(")", r"\)")):
        timings(**section)


def test_the_timings_of_a_gpu_check_file_at_a_batch_under_the_configs(tmp_path: Path):
    path = tmp_path / "device_timings.json"
    by_batch = {
        "1": {"drafter_ratio": 0.02, "verify_cost": {"3": 1.01, "7": 1.03}},
        "32": {"drafter_ratio": 0.04, "verify_cost": {"3": 1.4, "7": 2.1}},
    }
    path.write_text(json.dumps({"device_timings": {"device": "NVIDIA H200", "by_batch": by_batch}}))
    found = device_timings({"file": str(path), "batch": 32, "verify_cost": {"7": 2.0}})
    assert found.name == "NVIDIA H200, batch 32" and found.source == str(path)
    assert found.drafter_ratio == 0.04 and found.verify_cost == {"3": 1.4, "7": 2.0}
    with pytest.raises(ValueError, match=r"^report.device.batch: 8 is not among"):
        device_timings({"file": str(path), "batch": 8})
    path.write_text(json.dumps({"device_timings": {"by_batch": {"1": {"drafter_ratio": 3}}}}))
    with pytest.raises(ValueError, match=r"^report.device.drafter_ratio: 3 \(from .*\) is outside"):
        device_timings({"file": str(path)})


def engine_by_depth(per_depth: dict[int, tuple[list[int], list[int]]]) -> dict:
    """A family's metrics at K 3 with vLLM's per-prompt figures at each depth cut, laid out as the
    evaluate stage writes them: the depth table's engine rows."""
    rows = [
        {"depth": depth, "engine": {"emitted_per_prompt": emitted, "rounds_per_prompt": rounds}}
        for depth, (emitted, rounds) in per_depth.items()
    ]
    heldout = {"emitted_per_round": 9.0}  # the held-out prompts': not read beside depth cuts
    return {
        "ks": [3],
        "by_depth": {"depths": list(per_depth), "per_k": {"3": rows}},
        "engine": {"per_k": {"3": heldout}},
    }


def test_the_acceptance_holds_over_the_depths_the_answers_reach():
    # EAGLE-3 emits 3 a round from the prompt, 1.5 past depth 1024; P-EAGLE 2.4 and 2.2.
    families = {
        "eagle3": engine_by_depth({0: ([20, 40], [10, 10]), 1024: ([15, 15], [10, 10])}),
        "p_eagle": engine_by_depth({0: ([24, 24], [10, 10]), 1024: ([22, 22], [10, 10])}),
    }
    device = DeviceTimings("H100", "user", 0.03, {}, {"3": 1.05})
    # Short answers (positions 20-299) lie below 1024: EAGLE-3, 3 / (1.05 + 3 * 0.03).
    short = choose_on_device(families, device, lengths((20, 300)))
    assert short["choice"]["family"] == "eagle3"
    assert short["choice"]["tokens_per_target_step"] == pytest.approx(3 / 1.14)
    # One long answer of 3980 generated tokens: 1024 below depth 1024, 2956 past it; tau is total
    # tokens over total rounds across them.
    long = choose_on_device(families, device, lengths((20, 4000)))
    tau = {
        family: 3980 / (1024 / near + 2956 / deep)
        for family, (near, deep) in {"eagle3": (3, 1.5), "p_eagle": (2.4, 2.2)}.items()
    }
    figures = long["by_family"]["p_eagle"]["per_k"]["3"]
    assert figures["emitted_per_round"] == pytest.approx(tau["p_eagle"])
    assert figures["by_depth"]["1024"] == {"tau": 2.2, "weight": pytest.approx(2956 / 3980)}
    assert long["choice"]["family"] == "p_eagle"
    assert long["choice"]["tokens_per_target_step"] == pytest.approx(tau["p_eagle"] / 1.08)
    margin = long["choice"]["margin"]
    assert margin["tokens_per_target_step"] == pytest.approx(
        tau["p_eagle"] / 1.08 - tau["eagle3"] / 1.14
    )
    assert margin["paired"] is True and margin["ci95"][0] <= margin["tokens_per_target_step"]


def test_a_nan_verify_cost_never_wins_the_choice_of_k():
    # Timings built past check_timings (the report's own, a test's): NaN at the first K lost
    # every comparison both ways, so max kept it and summary.json chose K 3 at a rate of NaN.
    device = DeviceTimings("H200", "user", 0.2, {}, {"3": float("nan"), "7": 1.0})
    families = {"dflash": per_k_metrics({"3": ([10, 15], [5, 5]), "7": ([15, 15], [5, 5])})}
    summary = choose_on_device(families, device)
    assert summary["choice"]["k"] == 7
    assert summary["choice"]["tokens_per_target_step"] == pytest.approx(3 / 1.2)
    assert summary["by_family"]["dflash"]["per_k"]["3"]["tokens_per_target_step"] is None
    assert summary["curve"]["families"]["dflash"]["ks"] == [7] * len(summary["curve"]["ratios"])
    json.dumps(summary["choice"], allow_nan=False)
    json.dumps(summary["curve"], allow_nan=False)
