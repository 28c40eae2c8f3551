"""The drafter families that draft in one forward (P-EAGLE, DFlash) in a real vLLM (the CPU
build, .venv-vllm), on the small demo target of `finished_run`: each drafter trained by the train
stage itself (`train_drafter(family=...)`, its held-out loss falling), exported as vLLM loads it,
measured by the evaluate stage (simulated and in our own live loop, `family=`), then decoded by
vLLM at K beside the conftest's `plain_decoding` (one request at a time, eager):
vLLM's output equals plain greedy decoding, ours equals the transformers target's, and each
prompt takes the rounds in our loop that it takes in vLLM's, within one. Both families are
decoded by one vLLM process (an engine each, one after the other).

Both train from one capture of the union of their default layers (`union_run`: the run's shards
captured again with train.families p_eagle and dflash, hidden.aux_layer_ids null), each reading
its own: P-EAGLE vLLM's three (2, 4, 5), DFlash z-lab's five of the demo's 8 layers (2 to 6, its
target_layer_ids 1 to 5), which vLLM then captures itself when it serves each.
DFlash is at its defaults (train.dflash: 5 layers, block 8, the target's LM head, shared by vLLM)
and served at K = 3, below block_size - 1."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from safetensors import safe_open
from support.drafters import evaluate_on_heldout, run_files
from support.workflow import SMALL_RUN

FAMILIES = ("p_eagle", "dflash")
K = 3
BLOCK_SIZE = 8  # train.dflash's default, served at K < block_size - 1; P-EAGLE at the same K
TRAIN = {
    "epochs": 20,
    "lr": 3e-3,
    "warmup_steps": 5,
    "max_batch_tokens": 1024,
    "ttt_steps": K,  # P-EAGLE at its defaults: 4 layers, 4 depths (served at K <= 4)
    "eval_every": 4,
    "export_dtype": "float32",  # as the small demo's evaluation runs
    "dflash": {"max_anchors": 128},  # its defaults otherwise
}


def heldout_losses(drafter_dir: Path) -> list[float]:
    lines = (drafter_dir / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines if line.strip()]
    return [r["loss"] for r in records if r["split"] == "heldout"]


def trained_and_live(family: str, results: Path, out: Path, plain_args: dict):
    """The family's drafter trained by the train stage on shard 00000 (00001 held out), and the
    evaluate stage's figures for it (simulated, live) at K."""
    from eaglenest.common.config import settings_from_sections, validate_config
    from eaglenest.settings.train import FamilySettings, TrainSettings
    from eaglenest.stages.train.train import train_drafter

    target = {"path": str(results / "target")}
    sections = {"train": dict(TRAIN), "target": dict(target)}
    started = time.perf_counter()
    report = train_drafter(
        train_shards=[results / "hidden" / "00000.safetensors"],
        eval_shards=[results / "hidden" / "00001.safetensors"],
        out_dir=out / "drafter",
        journal_dir=out / "journal",
        settings=settings_from_sections(TrainSettings, **sections),
        family=FamilySettings.of(validate_config(sections), family),
        **run_files(results),
    )
    print(f"{family}: trained in {time.perf_counter() - started:.1f} s")
    metrics = evaluate_on_heldout(
        out / "drafter", results, out / "metrics.json", ks=[K], family=family,
        prompts=len(plain_args["prompts"]), max_new_tokens=plain_args["max_new_tokens"],
    )  # fmt: skip
    return {"dir": out / "drafter", "report": report, "metrics": metrics}


@pytest.fixture(scope="module")
def union_run(finished_run: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The finished run's results with its hidden states captured once more, for train.families
    p_eagle and dflash: the union of their defaults, by the hidden-state stage (transformers, as
    the run captured), and the target head that records it; tokens, target and draft vocabulary
    the run's own."""
    from eaglenest.common.config import settings_from_sections
    from eaglenest.formats.target_head import save_target_head
    from eaglenest.settings.hidden_states import HiddenSettings, TargetHeadSettings
    from eaglenest.stages.hidden_states.extract import extract_hidden_states

    results = finished_run / "results" / SMALL_RUN
    union = tmp_path_factory.mktemp("union") / SMALL_RUN
    (union / "hidden").mkdir(parents=True)
    for name in ("tokens", "target", "vocab"):
        (union / name).symlink_to(results / name)
    sections = {"target": {"path": str(results / "target")}, "train": {"families": list(FAMILIES)}}
    settings = settings_from_sections(HiddenSettings, hidden={"device": "cpu"}, **sections)
    for shard in ("00000", "00001"):
        out = union / "hidden" / f"{shard}.safetensors"
        extract_hidden_states(tokens=union / "tokens" / f"{shard}.parquet", out=out,
                              settings=settings, summary_out=out.with_suffix(".json"))  # fmt: skip
    head = settings_from_sections(TargetHeadSettings, **sections)
    save_target_head(union / "hidden" / "target_head.safetensors", head)
    return union


@pytest.fixture(scope="module")
def families(
    union_run: Path, plain_decoding: dict, tmp_path_factory: pytest.TempPathFactory
) -> dict:
    """Per family: its drafter, training report, evaluate-stage metrics, and vLLM's figures at
    K (both decoded by one vLLM process)."""
    from eaglenest.formats.target_head import TargetHead
    from eaglenest.stages.evaluate.families import load_family
    from eaglenest.stages.evaluate.vllm_evaluate import acceptance, decode_each, engine_request

    results = union_run
    arguments = plain_decoding["arguments"]
    work = tmp_path_factory.mktemp("families")
    found = {
        family: trained_and_live(family, results, work / family, arguments) for family in FAMILIES
    }
    head = TargetHead.load(run_files(results)["target_head"])
    assert head.aux_layer_ids == [2, 3, 4, 5, 6]  # captured once: the union
    requests = []
    for family in FAMILIES:
        drafter_dir = found[family]["dir"]
        loaded = load_family(
            family, drafter_dir, head.embed, head.aux_layer_ids, (K,), head.lm_head
        )
        request = {**engine_request(**arguments, drafter_dir=drafter_dir), "k": K}
        request["speculative_config"] = loaded.speculative_config(request["drafter"], K)
        requests.append(request)
    answers = decode_each(requests, arguments["runtime"], work)
    for family, answer in zip(FAMILIES, answers, strict=True):
        assert not answer.get("refused"), answer
        found[family]["vllm"] = acceptance(answer, plain_decoding["plain"], K)
    return found


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_trains_and_decodes_in_vllm_as_in_our_live_loop(family: str, families):
    """Trained by the train stage: its held-out loss falls and the export names the family as
    vLLM reads it. Decoded by vLLM (its speculative_config: eagle3 with parallel_drafting, or
    dflash): plain greedy's output; our live loop gives the transformers target's greedy output,
    with the same tokens; per prompt the two loops take the same rounds within one, and the
    metrics name the family, its K and the drafter's time."""
    found = families[family]
    losses = heldout_losses(found["dir"])
    assert found["report"]["family"] == family and len(losses) >= 2
    assert losses[-1] < losses[0], losses
    config = json.loads((found["dir"] / "config.json").read_text())
    if family == "dflash":
        assert config["architectures"] == ["DFlashDraftModel"]
        assert config["dflash_config"]["block_size"] == BLOCK_SIZE
        # z-lab's five of 8 layers (outputs of 1 to 5), of the union captured
        assert config["dflash_config"]["target_layer_ids"] == [1, 2, 3, 4, 5]
        assert config["num_hidden_layers"] == 5 and config["eaglenest"]["gamma"] == 4.0
        with safe_open(str(found["dir"] / "model.safetensors"), framework="pt") as f:
            assert "lm_head.weight" not in set(f.keys())  # vLLM shares the target's
    else:
        assert config["mask_token_id"] == found["report"]["drafter"]["mask_token_id"]
        assert config["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]  # vLLM's, of the union
    metrics = found["metrics"]
    assert (metrics["family"], metrics["ks"]) == (family, [K])
    vllm, live = found["vllm"], metrics["live"][str(K)]
    print(f"{family}: held-out loss {losses[0]:.3f} -> {losses[-1]:.3f}; vLLM "
          f"{vllm['acceptance_length']:.4f} ({vllm['rounds']} rounds {vllm['rounds_per_prompt']}), "
          f"live {live['acceptance_length']:.4f} ({live['rounds']} rounds "
          f"{live['rounds_per_prompt']}), simulated "
          f"{metrics['simulated'][str(K)]['acceptance_length']:.4f}, drafter "
          f"{1000 * live['drafter_s_per_round']:.2f} ms a round")  # fmt: skip
    assert vllm["identical_to_plain"] and live["identical_to_greedy"]
    assert vllm["tokens"] == live["tokens"]
    # Trained enough that drafts depend on the context (random drafters accept ~nothing here).
    assert live["acceptance_length"] > 1.2
    assert len(vllm["rounds_per_prompt"]) == len(live["rounds_per_prompt"]) == vllm["prompts"]
    for theirs, ours in zip(vllm["rounds_per_prompt"], live["rounds_per_prompt"], strict=True):
        assert abs(theirs - ours) <= 1, (vllm["rounds_per_prompt"], live["rounds_per_prompt"])
    assert live["drafter_s_per_round"] > 0
