"""Hidden states by vLLM (`hidden.backend: vllm`, vLLM's extract_hidden_states) through
Snakemake, against the real vLLM CPU build: on `finished_run`'s shards (the conftest's
`vllm_captured_run`, one offline engine per shard job), equal to the transformers backend's to
fp32 precision, and read by training beside a transformers shard."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from support.vllm import EXACT
from support.workflow import SMALL_RUN


def relative_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


def test_the_vllm_backend_writes_what_transformers_does(vllm_captured_run: dict, tmp_path: Path):
    """`hidden.backend: vllm` through Snakemake reran the shards' hidden states (nothing
    upstream: the fixture's dry run); shard 00001's aux and final states equal the transformers
    backend's to fp32 precision, the token rows are the same, and training reads the shard beside
    a transformers one."""
    from eaglenest.common.config import settings_from_sections
    from eaglenest.drafter.batches import BatchPlan, TargetSignal, build_batch, open_shards
    from eaglenest.formats.draft_vocab import DraftVocab
    from eaglenest.formats.hidden_shard import open_hidden_shard
    from eaglenest.formats.target_head import TargetHead
    from eaglenest.settings.hidden_states import HiddenSettings
    from eaglenest.stages.hidden_states.extract import extract_hidden_states

    workdir = vllm_captured_run["workdir"]
    results = workdir / "results" / SMALL_RUN
    summary = json.loads((results / "hidden" / "00001.json").read_text())
    assert summary["backend"] == "vllm" and summary["dtype"] == "fp32"
    assert not list((results / "hidden").glob(".*vllm*")), "per-request files were left behind"
    # The job's engine on CPU: its engine core and worker in the job's engine process, none
    # spawned apart (eaglenest.vllm_engine.process.one_shot_llm).
    log = (workdir / "logs" / SMALL_RUN / "extract_hidden_states" / "00001.log").read_text()
    assert "(MainProcess pid=" in log, log[-3000:]
    assert "(EngineCore pid=" not in log and "(Worker pid=" not in log, log[-3000:]

    reference = tmp_path / "transformers.safetensors"
    extract_hidden_states(
        tokens=results / "tokens" / "00001.parquet",
        out=reference,
        settings=settings_from_sections(
            HiddenSettings, hidden=EXACT, target={"path": str(results / "target")}
        ),
    )
    engine, ours = (
        open_hidden_shard(results / "hidden" / "00001.safetensors"),
        open_hidden_shard(reference),
    )
    assert engine.metadata["backend"] == "vllm" and ours.metadata["backend"] == "transformers"
    assert engine.sample_ids == ours.sample_ids and len(engine) == len(ours) > 0
    worst = {"aux": 0.0, "final_hidden": 0.0}
    for i in range(len(ours)):
        a, b = engine.sample(i), ours.sample(i)
        assert torch.equal(a["input_ids"], b["input_ids"])
        assert torch.equal(a["loss_mask"], b["loss_mask"])
        for name, largest in worst.items():
            worst[name] = max(largest, relative_difference(a[name], b[name]))
    print(f"vLLM vs transformers, largest relative difference: {worst}")
    assert max(worst.values()) <= 1e-5, worst

    head = TargetHead.load(results / "hidden" / "target_head.safetensors")
    vocab = DraftVocab.load(results / "vocab" / "draft_vocab.safetensors")
    shards = open_shards([results / "hidden" / "00001.safetensors", reference], head, vocab)
    plan = BatchPlan(shards, max_batch_tokens=4096, seed=0)
    batch = TargetSignal(head, vocab).fill(build_batch(plan.epoch_order(0)[0], shards))
    assert batch.aux.shape[-1] == 3 * head.hidden_size and batch.loss_mask.any()
