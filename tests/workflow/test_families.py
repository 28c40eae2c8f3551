"""Several drafter families from one run (train.families): on a copy of the finished small demo
run (EAGLE-3 trained and evaluated), adding P-EAGLE and DFlash plans their training and
evaluation only, and a run of P-EAGLE alone plans no EAGLE-3; trained by Snakemake, their
directories hold what vLLM 0.32 reads, as their loaders read it back; evaluated, the report has
every family's sections and the families side by side, and its summary names the family chosen;
taking a family out again reruns nothing, the report included. A key only some families read
(EAGLE-3's training-time test, its variants, evaluate.ks) reruns the jobs of those alone."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from safetensors import safe_open
from support.report_run import missing_references, page_sections
from support.workflow import SMALL_DEMO, SMALL_RUN, job_logs, merged, planned_jobs, snakemake

pytestmark = pytest.mark.slow

ALL_FAMILIES = ["eagle3", "p_eagle", "dflash"]
TITLES = {"eagle3": "EAGLE-3", "p_eagle": "P-EAGLE", "dflash": "DFlash"}
# A short DFlash recipe: blocks of 4 (K = 3, the demo's ttt_steps), few anchors a row;
# family-only keys, so EAGLE-3's job keeps its settings. P-EAGLE at its defaults (4 layers,
# 4 depths, a trained mask embedding).
DFLASH = {"block_size": 4, "max_anchors": 32}


# DFlash on the finished run's capture, vLLM's default of the demo's 8 layers: its own default
# (z-lab's five) would widen the capture, and so recapture and retrain the whole run.
DFLASH_LAYERS = {"dflash": [2, 4, 5]}


def with_families(families: list[str]) -> dict:
    train = {"families": families, "dflash": DFLASH, "aux_layer_ids": DFLASH_LAYERS}
    return merged(SMALL_DEMO, {"train": train})


def without_report(planned: dict[str, int]) -> dict[str, int]:
    """The planned jobs less the report's: the report may show the families it is given."""
    assert planned.get("build_report", 0) <= 1, planned
    return {rule: n for rule, n in planned.items() if rule != "build_report"}


def test_adding_families_to_a_finished_run_plans_only_their_jobs(finished_run_copy: Path):
    result = snakemake(finished_run_copy, "-n", config=with_families(ALL_FAMILIES))
    planned = without_report(planned_jobs(result))
    assert planned == {"train_drafter": 2, "evaluate_drafter": 2, "all": 1}
    results = f"results/{SMALL_RUN}"
    for family in ("p_eagle", "dflash"):
        assert f"{results}/drafter_{family}/config.json" in result.stdout
        assert f"{results}/eval_{family}/metrics.json" in result.stdout
    assert not eagle3_outputs(result.stdout)
    # DFlash at its own default layers (z-lab's five of the demo's 8) widens the capture: every
    # shard is captured again, the head records it, every family is retrained on it.
    widened = merged(SMALL_DEMO, {"train": {"families": ["eagle3", "dflash"], "dflash": DFLASH}})
    planned = planned_jobs(snakemake(finished_run_copy, "-n", config=widened))
    assert planned["extract_hidden_states"] == 2 and planned["save_target_head"] == 1, planned
    assert planned["train_drafter"] == 2, planned

    # A run of P-EAGLE alone: no EAGLE-3 drafter is trained for it, nor evaluated, nor read.
    results = finished_run_copy / "results" / SMALL_RUN
    for folder in ("drafter", "eval"):
        shutil.rmtree(results / folder)
    alone = snakemake(finished_run_copy, "-n", config=with_families(["p_eagle"]))
    assert planned_jobs(alone) == {
        "train_drafter": 1,
        "evaluate_drafter": 1,
        "build_report": 1,
        "all": 1,
    }
    assert not eagle3_outputs(alone.stdout)
    assert f"{SMALL_RUN}/drafter_p_eagle/config.json" in alone.stdout


# train section changes (over with_families) -> the families whose training and evaluation rerun
KEYS_READ_BY = [
    # EAGLE-3's training-time test: P-EAGLE's depths are set (4; null would be ttt_steps).
    ({"step_weight": 0.5, "ttt_steps": 4}, {"eagle3"}),
    # An EAGLE-3 variant and activation checkpointing: not DFlash's.
    (
        {"drafter": {"norm_before_fc": False}, "activation_checkpointing": True},
        {"eagle3", "p_eagle"},
    ),
    ({"dflash": {**DFLASH, "gamma": 2.0}}, {"dflash"}),  # and DFlash's jobs see their own keys
]


def test_a_key_only_some_families_read_reruns_only_their_jobs(finished_run_copy: Path):
    """Every family's outputs recorded as this config's, without training: placeholders that
    `snakemake --touch` records with each job's params, as a run would (nothing planned after;
    --forcerun, as touch records only the jobs it would run). Then a dry run per change plans
    the training and evaluation of the families that read it (P-EAGLE's and DFlash's own
    keys plan theirs: the records are there)."""
    config = with_families(ALL_FAMILIES)
    results = finished_run_copy / "results" / SMALL_RUN
    for family in ("p_eagle", "dflash"):
        names = ("config.json", "model.safetensors", "metrics.jsonl", "train_report.json")
        for path in [
            *(results / f"drafter_{family}" / n for n in names),
            results / f"eval_{family}" / "metrics.json",
        ]:
            path.parent.mkdir(exist_ok=True)
            path.write_text("{}")
    touched = snakemake(finished_run_copy, "--touch", "--forcerun", "train_drafter", config=config)
    assert touched.returncode == 0, touched.stdout[-3000:] + touched.stderr[-3000:]
    assert planned_jobs(snakemake(finished_run_copy, "-n", config=config)) == {}
    for change, families in KEYS_READ_BY:
        result = snakemake(finished_run_copy, "-n", config=merged(config, {"train": change}))
        planned = without_report(planned_jobs(result))
        assert planned_families(result.stdout) == (families, families), change
        assert planned == {
            "train_drafter": len(families),
            "evaluate_drafter": len(families),
            "all": 1,
        }, change
    # evaluate.ks (the demo's [2, 3]): P-EAGLE's (up to its 4 depths) and DFlash's (up to
    # block_size - 1 = 3) change with [3, 5]; with [2, 3, 5] only EAGLE-3's do.
    ks = merged(config, {"evaluate": {"ks": [3, 5]}})
    result = snakemake(finished_run_copy, "-n", config=ks)
    assert planned_families(result.stdout) == (set(), {"eagle3", "p_eagle", "dflash"})
    ks = merged(config, {"evaluate": {"ks": [2, 3, 5]}})
    result = snakemake(finished_run_copy, "-n", config=ks)
    assert planned_families(result.stdout) == (set(), {"eagle3"})


def planned_families(dry_run: str) -> tuple[set[str], set[str]]:
    """The families whose training, and whose evaluation, a dry run plans (its output lines)."""
    lines = [line for line in dry_run.splitlines() if line.strip().startswith("output:")]
    outputs = "\n".join(lines)
    trained = re.findall(r"/drafter(_p_eagle|_dflash)?/config\.json", outputs)
    evaluated = re.findall(r"/eval(_p_eagle|_dflash)?/metrics\.json", outputs)
    return (
        {s.removeprefix("_") or "eagle3" for s in trained},
        {s.removeprefix("_") or "eagle3" for s in evaluated},
    )


def eagle3_outputs(dry_run: str) -> list[str]:
    """The output lines of a dry run that name an EAGLE-3 drafter or evaluation file."""
    outputs = [line for line in dry_run.splitlines() if line.strip().startswith("output:")]
    return [line for line in outputs if "/drafter/" in line or "/eval/" in line]


def test_p_eagle_and_dflash_trained_by_snakemake_are_what_vllm_reads(finished_run_copy: Path):
    import torch

    from eaglenest.drafter.dflash.export import load_dflash
    from eaglenest.drafter.dflash.model import dflash_target_layer_ids
    from eaglenest.drafter.p_eagle.export import load_p_eagle
    from eaglenest.formats.target_head import TargetHead

    results = finished_run_copy / "results" / SMALL_RUN
    config = with_families(ALL_FAMILIES)
    targets = [f"results/{SMALL_RUN}/drafter_{f}/config.json" for f in ("p_eagle", "dflash")]
    result = snakemake(finished_run_copy, *targets, config=config, timeout_s=1200)
    assert result.returncode == 0, (
        result.stdout[-3000:] + result.stderr[-3000:] + job_logs(finished_run_copy)
    )
    head = TargetHead.load(results / "hidden" / "target_head.safetensors")
    for family in ("p_eagle", "dflash"):
        out = results / f"drafter_{family}"
        names = {"config.json", "model.safetensors", "metrics.jsonl", "train_report.json"}
        assert names <= {p.name for p in out.iterdir()}
        report = json.loads((out / "train_report.json").read_text())
        assert report["family"] == family and report["heldout_positions"] > 0
        assert (results.parent.parent / "logs" / SMALL_RUN / f"train_drafter_{family}.log").exists()
    # What vLLM 0.32 reads: P-EAGLE's mask token and mask_hidden (llm_base_proposer.py,
    # llama_eagle3.py), DFlash's architecture, block and target layers (qwen3_dflash.py).
    p_eagle = json.loads((results / "drafter_p_eagle" / "config.json").read_text())
    with safe_open(str(results / "drafter_p_eagle" / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    # Its 4 layers (vLLM: midlayer. is layers.0.) and the embedding with the trained mask row.
    assert {"mask_hidden", "embed_tokens.weight", "layers.3.mlp.down_proj.weight"} <= names
    model, depths = load_p_eagle(results / "drafter_p_eagle", head.embed, head.aux_layer_ids)
    assert (depths, model.num_hidden_layers, p_eagle["num_hidden_layers"]) == (4, 4, 4)
    assert p_eagle["mask_token_id"] == model.mask_token_id
    assert not torch.equal(model.mask_embedding(), head.embed[model.mask_token_id])
    dflash = json.loads((results / "drafter_dflash" / "config.json").read_text())
    assert dflash["architectures"] == ["DFlashDraftModel"]
    assert dflash["dflash_config"]["block_size"] == DFLASH["block_size"]
    assert dflash["dflash_config"]["target_layer_ids"] == dflash_target_layer_ids(
        head.aux_layer_ids
    )
    # train.dflash's defaults otherwise: 5 layers, the target's LM head (none exported), gamma
    # following the block (1 + 3 * 4 / 8).
    assert dflash["num_hidden_layers"] == 5 and dflash["eaglenest"]["gamma"] == 2.5
    with safe_open(str(results / "drafter_dflash" / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in f.keys()  # noqa: SIM118 (not a dict)
    loaded = load_dflash(
        results / "drafter_dflash", head.embed, head.aux_layer_ids, lm_head=head.lm_head
    )
    assert loaded.config.mask_token_id == dflash["dflash_config"]["mask_token_id"]

    # Trained, not yet evaluated: only their evaluations are left; a family taken out again
    # reruns nothing of the others.
    left = snakemake(finished_run_copy, "-n", config=config)
    assert without_report(planned_jobs(left)) == {"evaluate_drafter": 2, "all": 1}
    fewer = snakemake(finished_run_copy, "-n", config=with_families(["eagle3", "dflash"]))
    assert without_report(planned_jobs(fewer)) == {"evaluate_drafter": 1, "all": 1}
    assert "eval_dflash/metrics.json" in fewer.stdout
    assert planned_jobs(snakemake(finished_run_copy, "-n", config=with_families(["eagle3"]))) == {}

    # Evaluated (only P-EAGLE and DFlash) and reported.
    done = snakemake(finished_run_copy, config=config, timeout_s=1200)
    assert done.returncode == 0, (
        done.stdout[-3000:] + done.stderr[-3000:] + job_logs(finished_run_copy)
    )
    # A run prints its job table on stderr (a dry run on stdout).
    ran = planned_jobs(subprocess.CompletedProcess(done.args, 0, done.stderr))
    assert ran == {"evaluate_drafter": 2, "build_report": 1, "all": 1}
    assert_the_report_of_three_families(results)
    # Taken out of train.families, a family keeps its files and its place in the report: no
    # job of any family, and not the report, reruns.
    for families in (ALL_FAMILIES, ["eagle3", "dflash"], ["p_eagle"], ["eagle3"]):
        again = snakemake(finished_run_copy, "-n", config=with_families(families))
        assert planned_jobs(again) == {}, (families, again.stdout[-2000:])


def assert_the_report_of_three_families(results: Path) -> None:
    """Every family's training and acceptance sections, the families side by side, this
    machine's fastest among them in report/summary.json (`this_machine`), from times each
    family's evaluation measured; no choice without report.device."""
    page = results / "report" / "index.html"
    sections = page_sections(page)
    for family, title in (("", "EAGLE-3"), ("_p_eagle", "P-EAGLE"), ("_dflash", "DFlash")):
        for part in ("training", "acceptance"):
            assert sections[f"{part}{family}"].endswith(f"({title})"), sections
    assert "families" in sections
    assert missing_references(page) == []
    summary = json.loads((results / "report" / "summary.json").read_text())
    assert summary["choice"] is None and "report.device" in summary["why_none"], summary
    here = summary["this_machine"]
    assert here["fastest_here"]["family"] in ALL_FAMILIES, summary
    assert here["fastest_here"]["tokens_per_target_step"] > 0
    for family, suffix in (("eagle3", ""), ("p_eagle", "_p_eagle"), ("dflash", "_dflash")):
        metrics = json.loads((results / f"eval{suffix}" / "metrics.json").read_text())
        for k, live in metrics["live"].items():
            times = ("drafter_s_per_round", "target_s_per_round", "greedy_s_per_token")
            assert all(live[t] > 0 for t in times), (family, k, live)
            rate = here["families"][family]["per_k"][k]["tokens_per_target_step"]
            assert rate is not None and rate > 0, (family, k)
    # DFlash at the demo's ks up to block_size - 1 (DFLASH: blocks of 4), as vLLM serves it.
    assert list(here["families"]["dflash"]["per_k"]) == ["2", "3"]
    chosen = here["fastest_here"]
    text = page.read_text()
    assert f"Fastest on this machine: {TITLES[chosen['family']]} at K={chosen['k']}" in text
