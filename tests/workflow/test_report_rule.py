"""The report rule in real Snakemake, on a synthetic finished run (support/report_run.py), with
`snakemake --report`; and the report the small demo run (`finished_run`) built."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from support.report_run import (
    PER_SHARD,
    PNG_MAGIC,
    missing_references,
    write_run,
)
from support.workflow import SMALL_RUN

from eaglenest.stages.report.report import PLOT_NAMES

REPO = Path(__file__).resolve().parents[2]


SNAKEFILE = """\
configfile: "config/config.yaml"


include: "rules/common.smk"
include: "rules/report.smk"


report: "report/workflow.rst"
"""


@pytest.mark.slow
def test_report_rule_and_snakemake_report(tmp_path: Path):
    for name in ("rules", "scripts", "config", "src", "report", "envs"):
        shutil.copytree(REPO / name, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "Snakefile").write_text(SNAKEFILE)
    # The serving device's timings as a user gives them (report.device): the choice is made.
    device = {"name": "8x H200", "drafter_ratio": 0.03, "verify_cost": {"3": 1.05, "7": 1.2}}
    (tmp_path / "override.yaml").write_text(
        json.dumps(
            {
                "run": "synthetic",
                "prompts": {"max_samples": 12, "shard_size": PER_SHARD},
                "report": {"device": device},
            }
        )
    )
    write_run(tmp_path)
    command = [sys.executable, "-m", "snakemake", "--cores", "1"]
    config = ["--configfile", "override.yaml"]
    target = "results/synthetic/report/index.html"
    result = subprocess.run(
        [*command, target, *config],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert re.search(r"build_report\s+1", result.stdout + result.stderr)
    page = tmp_path / target
    assert missing_references(page) == []
    assert "2.41" in page.read_text()
    log = (tmp_path / "logs/synthetic/build_report.log").read_text()
    assert "report of run synthetic" in log
    # EAGLE-3 alone, no vLLM figures: our live loop's emitted tokens per round at K=3 (2.3)
    # over 1.05 + 3 * 0.03 target steps, against 2.7 / (1.2 + 7 * 0.03) at K=7.
    summary = json.loads((tmp_path / "results/synthetic/report/summary.json").read_text())
    choice = summary["choice"]
    assert (choice["family"], choice["k"], choice["device"]) == ("eagle3", 3, "8x H200")
    assert choice["tokens_per_target_step"] == pytest.approx(2.3 / 1.14)
    assert choice["acceptance_source"].startswith("our live loop (no vLLM run")

    result = subprocess.run(
        [*command, target, "--report", "report.zip", *config],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    with zipfile.ZipFile(tmp_path / "report.zip") as archive:
        names = archive.namelist()
        page = archive.read("report/report.html").decode()
    for name in PLOT_NAMES:
        assert any(n.endswith(f"/{name}.png") for n in names), names
    assert "This report covers run" in page  # report/workflow.rst, rendered with the config
    assert "conditional acceptance by draft position" in page  # a caption


@pytest.mark.slow
def test_the_pipelines_report_of_the_demo_run(finished_run: Path):
    """The report `snakemake` built at the end of the small demo run: every plot is there and
    non-empty, the page references no missing file and shows the run's acceptance figures."""
    results = finished_run / "results" / SMALL_RUN
    report = results / "report"
    for name in PLOT_NAMES:
        png = report / f"{name}.png"
        assert png.stat().st_size > 1000, name
        assert png.read_bytes().startswith(PNG_MAGIC)
    page = report / "index.html"
    assert missing_references(page) == []
    metrics = json.loads((results / "eval" / "metrics.json").read_text())
    text = page.read_text()
    for k in metrics["ks"]:
        assert f"{metrics['simulated'][str(k)]['acceptance_length']:.2f}" in text
    assert all(v["identical_to_greedy"] for v in metrics["live"].values())
    # config/config.yaml's draft vocabulary (48 ids) is below the ~55 the completions use.
    vocab = json.loads((results / "vocab" / "draft_vocab.json").read_text())
    assert vocab["distinct_ids_seen"] > vocab["draft_vocab_size"] and vocab["coverage"] < 1
    assert f"<td>{100 * vocab['coverage']:.2f}%</td>" in text
    assert_both_thinking_modes(metrics, text)


def assert_both_thinking_modes(metrics: dict, page: str) -> None:
    """The evaluate job (its train_tokens input, its thinking param) decoded the held-out prompts
    in both modes of the demo's template: trained thinking on, the prompts rendered off too,
    decoded live at every K; the report's section says so."""
    thinking = metrics["thinking"]
    assert thinking["trained"]["mode"] == "on" and thinking["trained"]["samples"]["on"] > 0
    assert (thinking["heldout_mode"], thinking["other_mode"]) == ("on", "off")
    assert thinking["switch"] == "enable_thinking" and thinking["not_flipped"] == 0
    ks = {str(k) for k in metrics["ks"]}
    prompts = metrics["live"][min(ks)]["prompts"]
    assert thinking["other_prompts"] == prompts
    on, off = thinking["modes"]["on"]["live"], thinking["modes"]["off"]["live"]
    assert set(on) == set(off) == ks
    for k in ks:
        # The generated mode's figures are the held-out prompts' own, the other's apart.
        assert on[k] == {key: metrics["live"][k][key] for key in on[k]}
        assert off[k]["prompts"] == prompts and off[k]["tokens"] > 0
        ratio = thinking["other_vs_generated"]["live"][k]
        assert ratio == off[k]["acceptance_length"] / on[k]["acceptance_length"]
    assert "live_groups" not in metrics
    section = page.split("<h2 id='thinking'>")[1].split("<h2")[0]
    assert "with thinking off, its acceptance length is" in section
    assert "<td>thinking on (all" in section
