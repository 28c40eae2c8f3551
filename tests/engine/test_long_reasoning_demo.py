"""The long-reasoning demo through real Snakemake (config/tests/long-reasoning.yaml, made small:
four prompts of the run seed 10, whose answers are 600 to 3,200 tokens): the written target's
answers are its walks exactly (the server's text and the token ids the pipeline rebuilt), every
stage runs at those lengths, and for each drafter family the config trains (EAGLE-3, P-EAGLE and
DFlash, from the same shards in the one run) acceptance by depth is measured alike by our live
decoding and by a real vLLM (prompts sent as token ids): per depth, rounds within one a prompt,
both outputs equal to plain greedy decoding, the simulated acceptance per depth there too.
Trained one step here, the drafters draft nothing the target accepts (acceptance 1.0, as
EAGLE-3's was before): what this checks is each family's decoding at depth, ours against vLLM's;
trained families' rounds are compared on the small demo (test_drafter_families_in_vllm.py).
The full-size run (24 prompts, depths to 8,192, K=3) and its figures: docs/demo-target.md,
experiments/RESULTS.md#families."""

from __future__ import annotations

import json
import re
import time

import pytest
from support.vllm import EAGER, PIPELINE_VLLM, require_vllm_venv
from support.workflow import copy_workflow, job_logs, load_test_config, merged, snakemake

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

LONG = load_test_config("long-reasoning")
RUN = LONG["run"]
DEPTHS = [0, 1024, 2048]
FAMILIES = ("eagle3", "p_eagle", "dflash")  # the config's train.families, one run
SMALL = {
    "demo_target": {"heldout_prompts": 1},  # the build's check: one walk of 600 states
    "prompts": {"max_samples": 4, "shard_size": 2},  # seed 10: walks of 618, 638 | 3157, 1201
    "train": {"epochs": 1},  # one step: what is checked is decoding at depth, not the drafts
    "evaluate": {
        "ks": [3],
        "live_prompts": 2,
        # 16 tokens a prompt and depth, decoded alike by our live loop and vLLM (plain, K=3,
        # greedy and sampled): what is compared is the same at 16 as at 32 (the untrained
        # drafters' rounds are one token each), at half the decoding of each family's evaluation.
        "live_max_new_tokens": 16,
        "depths": DEPTHS,
        "engine": "vllm",
    },
    # Prefill in chunks of 512: the prompts cut at 1,024 and 2,048 take several steps, as a
    # Kimi-K2.5 answer's 20K tokens always do. Sampled with per-prompt seeds, a chunked prefill
    # ended vLLM's CPU build ("CPU Generator does not use offset": vllm_engine/cpu_generators.py).
    "vllm": {**PIPELINE_VLLM, "engine_args": {**EAGER, "max_num_batched_tokens": 512}},
}


@pytest.fixture(scope="module")
def long_run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    require_vllm_venv()
    workdir = copy_workflow(tmp_path_factory.mktemp("long") / "workflow")
    config = {**merged(LONG, SMALL), "seed": 10}
    started = time.monotonic()
    # Three families trained and evaluated: ~930 CPU-s against 555 for EAGLE-3 alone (at K=3
    # and 7); under a load of 10 on 2 cores the run's wall time passed 30 minutes.
    result = snakemake(workdir, config=config, timeout_s=3000)
    assert result.returncode == 0, result.stderr[-3000:] + job_logs(workdir)
    print(f"long-reasoning demo (4 prompts): {time.monotonic() - started:.0f} s")
    return {"workdir": workdir, "run": workdir / "results" / RUN}


def test_the_long_targets_answers_are_its_walks_token_for_token(long_run):
    import polars as pl
    from transformers import AutoTokenizer

    from eaglenest.demo.long_tasks import state_token, walk

    run = long_run["run"]
    samples = pl.concat([pl.read_parquet(p) for p in sorted((run / "samples").glob("0*.parquet"))])
    tokens = pl.concat([pl.read_parquet(p) for p in sorted((run / "tokens").glob("0????.parquet"))])
    assert samples.height == tokens.height == 4
    tokenizer = AutoTokenizer.from_pretrained(run / "target")
    lengths = []
    for row in samples.iter_rows(named=True):
        prompt = row["messages"][-1]["content"]
        key, start = map(int, re.fullmatch(r"Walk the chain K(\d+) from s(\d+)\.", prompt).groups())
        assert row["reasoning"].strip() == "".join(state_token(n) for n in walk(key, start))
        assert row["content"].strip() == f"K{key:02d}"
        ids = tokens.filter(pl.col("id") == row["id"])["input_ids"][0].to_list()
        assert ids[-1] == tokenizer.convert_tokens_to_ids("<|im_end|>")
        lengths.append(len(ids))
    assert max(lengths) > 3_000, lengths


@pytest.mark.parametrize("family", FAMILIES)
def test_own_live_and_vllm_need_the_same_rounds_at_every_depth_of_the_long_run(long_run, family):
    assert LONG["train"]["families"] == list(FAMILIES)
    folder = "eval" if family == "eagle3" else f"eval_{family}"
    metrics = json.loads((long_run["run"] / folder / "metrics.json").read_text())
    table = metrics["by_depth"]
    assert table["depths"] == DEPTHS
    assert set(table["per_k"]) == {"3"}
    for k, rows in table["per_k"].items():
        assert [row["prompts"] for row in rows] == [2, 2, 1]
        check_depth_rows(f"{family} {k}", rows)


def test_one_plain_engine_serves_every_familys_evaluation(long_run):
    """The plain decoding is the decode_plain job's, once for the three families: no evaluate
    job starts a plain engine, each starts its K's."""
    logs = sorted((long_run["workdir"] / "logs" / RUN).rglob("*.log"))
    texts = {path.name: path.read_text(errors="replace") for path in logs}
    plain = {name: text.count("vLLM (plain) ready") for name, text in texts.items()}
    assert {name: n for name, n in plain.items() if n} == {"decode_plain.log": 1}, plain
    suffixes = ["" if family == "eagle3" else f"_{family}" for family in FAMILIES]
    for suffix in suffixes:
        assert re.search(r"vLLM \(k\d+\) ready", texts[f"evaluate_drafter{suffix}.log"])
    assert (long_run["run"] / "eval_plain" / "decoding.json").is_file()


def check_depth_rows(k: str, rows: list[dict]) -> None:
    for row in rows:
        live, engine, simulated = row["live"], row["engine"], row["simulated"]
        print(f"K={k} depth {row['depth']}: live {live['acceptance_length']:.3f} ({live['rounds']} "
              f"rounds), vLLM {engine['acceptance_length']:.3f} ({engine['rounds']} rounds), "
              f"simulated {simulated['acceptance_length']:.3f}")  # fmt: skip
        assert live["identical_to_greedy"] and engine["identical_to_plain"]
        assert live["tokens"] == engine["tokens"]
        assert abs(live["rounds"] - engine["rounds"]) <= row["prompts"]
        assert simulated["positions"] > 0
        # Sampled at the run's temperature too, by the same engines, over chunked prefills.
        sampled = row["engine_sampled"]
        assert (sampled["temperature"], sampled["prompts"]) == (0.7, row["prompts"])
        assert sampled["tokens"] > 0 and sampled["rounds"] > 0
