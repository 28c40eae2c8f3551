"""A drafter with a sliding window (`train.drafter.sliding_window`), trained on the finished small
demo and served by the real vLLM (the CPU build of .venv-vllm), which reads the window from the
exported config.json (`layer_types` / `sliding_window`): vLLM's speculative output equals its plain
greedy output, and it needs the rounds our own live evaluator needs, which windows its decoding
cache the same way. The demo's answers run to ~60 tokens after prompts of ~30, so a 16-token window
cuts most of what a drafted token could attend to; the same weights decoded without the window
accept differently, so agreeing rounds are the window applied alike, not by chance."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from support.drafters import evaluate_on_heldout, run_files
from support.vllm import require_vllm_venv
from support.workflow import SMALL_RUN

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

WINDOW = 16
# K=7 too: with no room for its drafts past prompt + answer, vLLM stopped drafting over the
# longest answers' last ~2K positions (247 rounds against our 233; vllm_evaluate.draft_room).
KS = (3, 7)
PROMPTS, MAX_NEW_TOKENS = 8, 64


def live_figures(drafter_dir: Path, results: Path, out: Path) -> dict:
    """Our own live decoding of the held-out prompts with the drafter of `drafter_dir`."""
    return evaluate_on_heldout(
        drafter_dir, results, out, ks=list(KS), prompts=PROMPTS, max_new_tokens=MAX_NEW_TOKENS
    )


def test_a_windowed_drafter_decodes_in_vllm_as_in_our_live_evaluator(
    finished_run: Path, plain_decoding: dict, tmp_path: Path
):
    """Trained with a 16-token window and exported: at K = 3 and 7, vLLM's EAGLE-3 output equals
    its plain greedy output, ours equals the transformers target's greedy output, the tokens are
    the same, and vLLM's rounds and first drafts accepted are ours within one per prompt; our
    rounds without the window (same weights) are not."""
    from eaglenest.common.config import settings_from_sections
    from eaglenest.settings.train import TrainSettings
    from eaglenest.stages.evaluate.live import heldout_prompts
    from eaglenest.stages.evaluate.vllm_evaluate import evaluate_in_vllm
    from eaglenest.stages.train.train import train_drafter

    require_vllm_venv()
    results = finished_run / "results" / SMALL_RUN
    # train.sequence.sink 0: a sink is refused beside a window
    train = {"epochs": 12, "lr": 3e-3, "warmup_steps": 5, "max_batch_tokens": 1024,
             "ttt_steps": 3, "export_dtype": "float32",
             "drafter": {"sliding_window": [WINDOW]}, "sequence": {"sink": 0}}  # fmt: skip
    drafter = tmp_path / "drafter"
    report = train_drafter(
        train_shards=[results / "hidden" / "00000.safetensors"],
        eval_shards=[],
        out_dir=drafter,
        journal_dir=tmp_path / "journal",
        settings=settings_from_sections(
            TrainSettings, train=train, target={"path": str(results / "target")}
        ),
        **run_files(results),
    )
    assert report["drafter"]["sliding_window"] == WINDOW
    config = json.loads((drafter / "config.json").read_text())
    assert config["layer_types"] == ["sliding_attention"] and config["sliding_window"] == WINDOW

    prompts = heldout_prompts([results / "tokens" / "00001.parquet"], PROMPTS)
    longest = max(len(p) for p in prompts) + MAX_NEW_TOKENS
    assert longest > 3 * WINDOW, longest  # the window cuts most of each answer's context
    metrics = live_figures(drafter, results, tmp_path / "metrics.json")
    # The engine's arguments and plain decoding of the held-out prompts are the shared ones
    # (tests/engine/conftest.py: one request at a time, eager): no second plain engine.
    assert plain_decoding["arguments"]["prompts"] == prompts
    assert plain_decoding["arguments"]["max_new_tokens"] == MAX_NEW_TOKENS
    engine = evaluate_in_vllm(
        **plain_decoding["arguments"], drafter_dir=drafter, ks=KS, plain=plain_decoding["plain"]
    )

    # The same weights, decoded by our loop with full attention.
    unwindowed = tmp_path / "unwindowed"
    shutil.copytree(drafter, unwindowed)
    del config["layer_types"], config["sliding_window"]
    (unwindowed / "config.json").write_text(json.dumps(config))
    full = live_figures(unwindowed, results, tmp_path / "full.json")

    for k in map(str, KS):
        vllm, live, without = engine["per_k"][k], metrics["live"][k], full["live"][k]
        print(f"K={k}: vLLM {vllm['acceptance_length']:.4f} ({vllm['rounds']} rounds), live "
              f"{live['acceptance_length']:.4f} ({live['rounds']} rounds), live without the "
              f"window {without['acceptance_length']:.4f} ({without['rounds']} rounds)")  # fmt: skip
        assert vllm["identical_to_plain"] and live["identical_to_greedy"]
        assert vllm["tokens"] == live["tokens"]
        assert live["acceptance_length"] > 1.3  # trained enough that a wrong window would show
        # Unbatched, vLLM may verify once more a prompt than our loop at the end of an answer.
        assert abs(vllm["rounds"] - live["rounds"]) <= vllm["prompts"]
        # A first draft does not depend on K: vLLM's were accepted as often as ours at both.
        first = vllm["accepted_per_position"][0] - live["accepted_per_position"][0]
        assert abs(first) <= vllm["prompts"], (vllm["accepted_per_position"], live)
        assert abs(vllm["rounds"] - without["rounds"]) > vllm["prompts"]
