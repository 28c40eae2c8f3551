"""The report of a run with several drafter families (support/report_run.py: the synthetic run,
each family's files in drafter{suffix}/ and eval{suffix}/): each family's training and acceptance
sections, the families side by side by depth with their drafter time, this machine's fastest
family, the family chosen for a serving device (report.device) in the page and in
report/summary.json; a run of one other family titles its sections with it."""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path

import pytest
from support.report_run import (
    PNG_MAGIC,
    family_eval,
    missing_references,
    page_sections,
    write_family,
    write_json,
    write_run,
)

from eaglenest.settings.report import DeviceTimings
from eaglenest.stages.report.inputs import RunFiles
from eaglenest.stages.report.report import PLOT_NAMES, build_report

# Near the prompt EAGLE-3 emits most; deep into an answer DFlash holds; P-EAGLE between. Each
# (emitted tokens per round, drafter seconds per round); the target verifies in 10 ms a round and
# decodes plainly in 8 ms a token.
EAGLE3 = {0: (2.9, 0.012), 32: (1.5, 0.012)}
P_EAGLE = {0: (2.2, 0.003), 32: (1.6, 0.003)}
DFLASH = {0: (2.0, 0.002), 32: (1.9, 0.002)}


def three_families(tmp_path: Path) -> Path:
    run = write_run(tmp_path)
    write_family(run, "eagle3", family_eval([3, 7], EAGLE3))
    write_family(run, "p_eagle", family_eval([3], P_EAGLE, "p_eagle"))
    write_family(run, "dflash", family_eval([3], DFLASH, "dflash"))
    return run


def build(run: Path) -> tuple[Path, dict]:
    page = run / "report" / "index.html"
    return page, build_report(RunFiles.from_run_dir(run), page, run=run.name)


def section_html(text: str, section_id: str) -> str:
    """The page from a section's heading to the next one's."""
    start = text.index(f"<h2 id='{section_id}'>")
    end = text.find("<h2 ", start + 1)
    return text[start : end if end > 0 else len(text)]


def test_every_family_has_its_sections_and_the_families_stand_side_by_side(tmp_path: Path):
    page, _ = build(three_families(tmp_path))
    sections = page_sections(page)
    ids = list(sections)
    expected = ["training", "training_p_eagle", "training_dflash"]
    assert ids[ids.index("training") : ids.index("training") + 3] == expected
    expected = ["acceptance", "acceptance_p_eagle", "acceptance_dflash"]
    assert ids[ids.index("acceptance") : ids.index("acceptance") + 3] == expected
    assert ids[-2:] == ["families", "choice"]
    assert sections["training"].endswith("(EAGLE-3)")
    assert sections["acceptance_dflash"].endswith("(DFlash)")
    text = page.read_text()
    # Every family's plot on the page; the vocabulary once, with the first family; the families'
    # and the choice's curve (no report.device: under the stated assumption, no device line).
    assert text.count("data:image/png;base64,") == 4 + 3 + 3 + 1 + 1
    assert text.count("<h3>Draft vocabulary</h3>") == 1
    assert missing_references(page) == []
    # The families' plot is the PNG the rule declares (not a card).
    families = section_html(text, "families")
    embedded = re.search(r"data:image/png;base64,([^']+)'", families).group(1)
    assert base64.b64decode(embedded) == (page.parent / "families.png").read_bytes()
    for name in PLOT_NAMES:
        assert (page.parent / f"{name}.png").read_bytes().startswith(PNG_MAGIC)
    # By depth: DFlash's drafter time a round (2 ms) beside EAGLE-3's (12 ms), and its tokens
    # per target step at depth 32: 1.9 tokens a 12 ms round, 1.5 greedy steps of 8 ms.
    rows = [re.findall(r"<td>(.*?)</td>", row) for row in re.findall(r"<tr>(.*?)</tr>", families)]
    # family, K, depth, prompts, acceptance, emitted live / engine, drafter / target / greedy ms
    dflash = ["DFlash", "3", "32", "4", "1.95", "1.9", "–", "2", "10", "8", "1.27"]
    assert dflash in rows
    eagle3 = next(row for row in rows if row[:3] == ["EAGLE-3", "7", "0"])
    assert eagle3[:10] == ["EAGLE-3", "7", "0", "4", "2.95", "2.9", "–", "12", "10", "8"]


def test_this_machines_fastest_family_holds_at_the_answers_depths_and_is_not_the_choice(
    tmp_path: Path,
):
    run = three_families(tmp_path)
    page, figures = build(run)
    summary = json.loads((page.parent / "summary.json").read_text())
    # This machine's figures: the synthetic answers run from position 12 to 30-58 tokens (18-46
    # generated): 246 of their tokens lie below generated depth 32, 28 past it. EAGLE-3's 12 ms drafter costs it more
    # than it gains near the prompt, and DFlash holds past depth 32.
    assert summary["choice"] is None and summary["device"] is None
    here = summary["this_machine"]
    choice = here["fastest_here"]
    assert (choice["family"], choice["k"]) == ("dflash", 3)
    weights = choice["depth_weights"]
    assert weights == pytest.approx({"0": 246 / 274, "32": 28 / 274})
    expected = 1 / (weights["0"] / (2.0 / 1.5) + weights["32"] / (1.9 / 1.5))
    assert choice["tokens_per_target_step"] == pytest.approx(expected)
    assert set(here["families"]) == {"eagle3", "p_eagle", "dflash"}
    assert summary["run"] == run.name
    text = page.read_text()
    assert "Fastest on this machine: DFlash at K=3" in text
    assert "No family chosen: no serving device's timings (report.device)" in text
    assert figures["drafter family chosen"].startswith("none (no serving device's timings")
    # A depth past every answer (they end by 58 tokens) weighs nothing in the choice.
    deeper = {**EAGLE3, 4096: (9.0, 0.001)}
    write_family(run, "eagle3", family_eval([3, 7], deeper))
    summary = json.loads((build(run)[0].parent / "summary.json").read_text())
    here = summary["this_machine"]
    assert here["families"]["eagle3"]["per_k"]["3"]["depth_weights"]["4096"] == 0
    assert here["fastest_here"]["family"] == "dflash"


def test_a_family_trained_on_other_shards_is_said(tmp_path: Path):
    run = three_families(tmp_path)
    path = run / "drafter_p_eagle" / "train_report.json"
    report = json.loads(path.read_text())
    write_json(path, {**report, "train_shards": ["00000", "00001"]})
    text = build(run)[0].read_text()
    assert "P-EAGLE was trained on other shards than EAGLE-3 (2 against 1)" in text


def test_a_run_of_one_other_family_names_it(tmp_path: Path):
    run = write_run(tmp_path, finished=False)
    write_family(run, "p_eagle", family_eval([3], P_EAGLE, "p_eagle"))
    page, figures = build(run)
    sections = page_sections(page)
    assert sections["training"] == "Training: loss and accuracy per TTT step (P-EAGLE)"
    assert sections["acceptance"].endswith("(P-EAGLE)")
    assert "families" not in sections and "drafter family chosen" not in figures
    summary = json.loads((page.parent / "summary.json").read_text())
    assert summary["this_machine"]["fastest_here"]["family"] == "p_eagle"
    # Not yet evaluated: the note names the family's own folder.
    (run / "eval_p_eagle" / "metrics.json").unlink()
    assert "Not evaluated yet: no eval_p_eagle/metrics.json." in build(run)[0].read_text()


def with_engine(metrics: dict, emitted: list[int], rounds: list[int]) -> dict:
    """`metrics` with vLLM's per-prompt figures at each of its K."""
    figures = {"emitted_per_prompt": emitted, "rounds_per_prompt": rounds, "prompts": len(rounds)}
    figures |= {"tokens": sum(emitted) + len(rounds), "rounds": sum(rounds)}
    figures |= {"acceptance_length": 1 + sum(emitted) / sum(rounds)}
    return {
        **metrics,
        "engine": {"engine": "vllm", "per_k": {str(k): figures for k in metrics["ks"]}},
    }


def test_the_family_chosen_for_the_serving_device_from_vllms_acceptance(tmp_path: Path):
    run = three_families(tmp_path)
    # vLLM: EAGLE-3 emits 3 a round, P-EAGLE 2.5, DFlash 2 (on this machine DFlash was fastest).
    write_family(run, "eagle3", with_engine(family_eval([3, 7], EAGLE3), [40, 50], [15, 15]))
    write_family(
        run, "p_eagle", with_engine(family_eval([3], P_EAGLE, "p_eagle"), [30, 45], [15, 15])
    )
    write_family(run, "dflash", with_engine(family_eval([3], DFLASH, "dflash"), [30, 30], [15, 15]))
    device = DeviceTimings("8x H200", "user", 0.03, {}, {"3": 1.05, "7": 1.2})
    page = run / "report" / "index.html"
    figures = build_report(RunFiles.from_run_dir(run), page, run=run.name, device=device)
    summary = json.loads((page.parent / "summary.json").read_text())
    choice = summary["choice"]
    # EAGLE-3 at K=3: 3 / (1.05 + 3 * 0.03); P-EAGLE 2.5 / 1.08.
    assert (choice["family"], choice["k"], choice["acceptance_source"]) == ("eagle3", 3, "vllm")
    assert choice["tokens_per_target_step"] == pytest.approx(3 / 1.14)
    assert choice["margin"]["over"] == "p_eagle" and len(choice["margin"]["ci95"]) == 2
    assert summary["device"]["name"] == "8x H200" and summary["device"]["source"] == "user"
    assert summary["this_machine"]["fastest_here"]["family"] == "dflash"
    assert figures["drafter family chosen"].startswith("EAGLE-3 K=3 (2.63 tokens per target step")
    text = page.read_text()
    assert "Chosen for 8x H200 (timings: user): EAGLE-3 at K=3" in text
    # The curve is the PNG the rule declares.
    embedded = re.search(r"data:image/png;base64,([^']+)'", section_html(text, "choice")).group(1)
    assert base64.b64decode(embedded) == (page.parent / "choice.png").read_bytes()
