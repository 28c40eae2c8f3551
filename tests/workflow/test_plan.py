"""`eaglenest plan`: shards, jobs, disk and hours of a config before anything runs. On the demo the
jobs are those a real dry run plans; on the Kimi-K2.5 example the disk is the documented
arithmetic (21,533 bytes a token, 3.5 TB at 10K samples) and scales with the samples; every
`hidden.store` mode is planned."""

from __future__ import annotations

import math

import pytest
from support.stand_in_vllm import stand_in_vllm_folder
from support.workflow import (
    REPO,
    copy_workflow,
    load_test_config,
    merged,
    planned_jobs,
    snakemake,
)

from eaglenest.cli import main
from eaglenest.common.config import merged_config
from eaglenest.run.plan import DEMO_RATES, Assumptions, Rates, format_plan, plan_run
from eaglenest.run.store import with_captured_layers

KIMI = str(REPO / "config" / "examples" / "kimi-k2.5.yaml")
DEMO = str(REPO / "config" / "config.yaml")
KIMI_HIDDEN = 7168
KIMI_LAYERS = 61
GPU_RATES = Rates(
    generate_tokens_per_s=2500, capture_tokens_per_s=50_000, train_tokens_per_s=20_000
)


def kimi_plan(samples: int | None = None, cache_gb: float = 1000.0):
    # The example trains eagle3 and dflash: the capture keeps the union of their layers, seven of
    # Kimi-K2.5's 61 (vLLM's 2, 30, 58 and z-lab's five), as `eaglenest plan --num-layers 61`.
    config = with_captured_layers(merged_config([KIMI]), KIMI_LAYERS)
    assert config["hidden"]["aux_layer_ids"] == [2, 16, 30, 31, 45, 58, 59]
    if samples:
        config["prompts"]["max_samples"] = samples
    return plan_run(config, Assumptions(16_384, KIMI_HIDDEN, GPU_RATES, cache_gb))


def test_the_demo_plan_has_the_jobs_of_a_dry_run(tmp_path):
    config = merged_config([DEMO])
    rates = Rates(**DEMO_RATES)
    plan = plan_run(config, Assumptions(config["generation"]["max_tokens"] / 2, 128, rates, 1.0))
    planned = {rule: n for row in plan.stages for rule, n in row.jobs.items() if n}
    workdir = copy_workflow(tmp_path)
    dry = planned_jobs(snakemake(workdir, "-n"))
    assert {**planned, "all": 1} == dry
    assert plan.shards == config["prompts"]["max_samples"] // config["prompts"]["shard_size"]


def test_an_mla_target_plans_an_mla_eagle3_and_a_dflash_beside_it(tmp_path):
    """train.drafter.attention is EAGLE-3's: beside the DeepSeek-V3 demo target (MLA, the
    architecture of Kimi-K2.5; config/tests/deepseek-v3.yaml) an MLA EAGLE-3 and a DFlash (Qwen3
    attention, as z-lab's Kimi-K2.5-DFlash) are planned, one training job each, nothing refused."""
    deepseek = load_test_config("deepseek-v3")
    assert deepseek["train"]["drafter"]["attention"] == "mla"
    config = merged(deepseek, {"train": {"families": ["eagle3", "dflash"]}})
    workdir = stand_in_vllm_folder(copy_workflow(tmp_path))  # its vLLM jobs' vllm.python
    dry = planned_jobs(snakemake(workdir, "-n", config=config))
    assert dry["train_drafter"] == 2 and dry["evaluate_drafter"] == 2, dry


def test_kimi_disk_is_the_documented_arithmetic_and_scales_with_the_samples():
    ten_k, half_m = kimi_plan(), kimi_plan(500_000)
    assert ten_k.hidden_bytes_per_token == 50_221  # docs/real-targets.md: 7 fp8 layers, top-1
    assert (ten_k.shards, ten_k.train_shards, ten_k.eval_shards) == (50, 49, 1)
    assert half_m.shards == 2500
    files = {plan.samples: {row.mode: row for row in plan.stores} for plan in (ten_k, half_m)}
    assert files[10_000]["files"].hidden_bytes == pytest.approx(10_000 * 16_384 * 50_221)
    assert files[10_000]["files"].hidden_bytes == pytest.approx(8.228e12, rel=1e-3)
    assert files[500_000]["files"].hidden_bytes == pytest.approx(50 * 8.228e12, rel=1e-3)
    for plan in (ten_k, half_m):
        rows = {row.mode: row for row in plan.stores}
        assert rows["none"].hidden_bytes == 0 and rows["none"].extract_jobs == 0
        shard_bytes = 200 * 16_384 * 50_221
        assert rows["budget"].stored_shards == math.floor(1000e9 / shard_bytes) == 6
        assert rows["budget"].hidden_bytes <= 1000e9


def test_kimi_hours_follow_the_rates_and_the_epochs():
    plan = kimi_plan()
    hours = {row.stage: row.hours for row in plan.stages}
    tokens = 10_000 * 16_384
    assert hours["hidden"] == pytest.approx(tokens / 50_000 / 3600)  # one capture server
    assert hours["generate"] == pytest.approx(tokens / 2500 / 3600)  # one endpoint
    # 10 epochs over the 49 training shards on 8 GPUs, for each of the example's two families,
    # each step reading train.sequence's 8,192 tokens of a ~16,384-token answer (disk: all).
    trained = 49 * 200 * 8_192
    assert plan.train_tokens_per_epoch == trained
    assert hours["train"] == pytest.approx(2 * trained * 10 / (20_000 * 8) / 3600)
    stores = {row.mode: row for row in plan.stores}
    shard_h = tokens / 50 / 50_000 / 3600
    assert stores["files"].capture_hours == pytest.approx(50 * shard_h)
    assert stores["none"].capture_hours == pytest.approx((49 * 10 + 1) * shard_h)
    assert stores["budget"].capture_hours == pytest.approx((6 + 43 * 10 + 1) * shard_h)
    two_servers = with_captured_layers(merged_config([KIMI]), KIMI_LAYERS)
    two_servers["vllm"]["capture_urls"] = ["http://node-a:8765", "http://node-b:8765"]
    plan = plan_run(two_servers, Assumptions(16_384, KIMI_HIDDEN, GPU_RATES, 1000.0))
    halved = {row.stage: row.hours for row in plan.stages}["hidden"]
    assert halved == pytest.approx(hours["hidden"] / 3)  # the example's URL and two more


def test_the_command_prints_every_stage_and_mode(capsys):
    code = main(["plan", "--configfile", KIMI, "--set", "prompts.max_samples=500000",
                 "--hidden-size", str(KIMI_HIDDEN), "--num-layers", str(KIMI_LAYERS),
                 "--capture-tokens-per-s", "50000"])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0
    assert "500,000 samples in 2,500 shards" in out
    for stage in ("generate", "samples", "hidden", "train", "evaluate", "report"):
        assert f"\n{stage} " in out
    assert "411.4 TB" in out and "not built yet" not in out
    assert "training reads at most train.sequence.length 8,192 tokens a sample" in out
    assert format_plan(kimi_plan(500_000)).splitlines()[0] == out.splitlines()[0]


def test_the_command_asks_for_a_hidden_size_it_cannot_read(capsys):
    assert main(["plan", "--configfile", KIMI]) == 2
    assert "--hidden-size" in capsys.readouterr().out
    # The example's two families capture the union of their layers: how many needs the target's.
    assert main(["plan", "--configfile", KIMI, "--hidden-size", str(KIMI_HIDDEN)]) == 2
    assert "--num-layers N" in capsys.readouterr().out


def test_the_rates_come_from_a_finished_runs_files(finished_run):
    from support.workflow import SMALL_RUN

    from eaglenest.run.plan import rates_from_run

    rates, bytes_per_token = rates_from_run(finished_run, SMALL_RUN)
    assert set(rates) == set(DEMO_RATES) and all(0 < r < 1e7 for r in rates.values())
    # The raw answers keep the server's JSON: more bytes a token than the token ids alone.
    assert bytes_per_token["raw"] > bytes_per_token["tokens"] > 0
