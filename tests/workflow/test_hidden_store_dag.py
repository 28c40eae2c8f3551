"""`hidden.store` shapes the DAG, planned by real Snakemake (dry runs of the small demo at 5
shards: 4 training, 1 held out; no job runs):
- files (the default): every shard's extract_hidden_states, as before;
- none: no extract_hidden_states job at all, training and evaluation read tokens shards;
- budget: extract_hidden_states for exactly the first training shards that fit in
  `hidden.cache_gb` (run/store.py: the plan's estimate of a shard), the same at every
  parse;
and `eaglenest plan` counts the jobs the DAG has, for a last shard that is short, a budget smaller
than one shard and every store mode (one split: eaglenest.run.split).
"""

from __future__ import annotations

import re

import pytest
from support.workflow import SMALL_DEMO, SMALL_RUN, copy_workflow, merged, planned_jobs, snakemake

SHARDS = [f"{i:05d}" for i in range(5)]
POOL = {"hidden": {"backend": "vllm"}, "vllm": {"capture_url": "http://127.0.0.1:9"}}
DRAFTER = f"results/{SMALL_RUN}/eval/metrics.json"


def store_config(store: str, cache_gb: float | None = None) -> dict:
    config = merged(SMALL_DEMO, {"prompts": {"max_samples": 100}})
    if store != "files":
        config = merged(config, POOL)
    return merged(config, {"hidden": {"store": store, "cache_gb": cache_gb}})


def captured_shards(stdout: str) -> list[str]:
    return sorted(set(re.findall(r"output: \S*hidden/(\d{5})\.safetensors", stdout)))


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return copy_workflow(tmp_path_factory.mktemp("hidden-store"))


def test_none_plans_no_capture_and_budget_exactly_the_shards_that_fit(workdir):
    from eaglenest.common.config import validate_config
    from eaglenest.run.store import estimated_sample_bytes

    files = snakemake(workdir, DRAFTER, "-n", config=store_config("files"))
    assert planned_jobs(files)["extract_hidden_states"] == 5
    assert captured_shards(files.stdout) == SHARDS

    none = snakemake(workdir, DRAFTER, "-n", config=store_config("none"))
    jobs = planned_jobs(none)
    assert "extract_hidden_states" not in jobs and jobs["train_drafter"] == 1, jobs
    assert captured_shards(none.stdout) == []

    shard_bytes = 20 * estimated_sample_bytes(validate_config(store_config("none")), 64)
    for fit in (0, 2):
        config = store_config("budget", (fit + 0.5) * shard_bytes / 1e9)
        budget = snakemake(workdir, DRAFTER, "-n", config=config)
        assert captured_shards(budget.stdout) == SHARDS[:fit], budget.stdout[-3000:]
        assert planned_jobs(budget).get("extract_hidden_states", 0) == fit
        again = snakemake(workdir, DRAFTER, "-n", config=config)
        assert captured_shards(again.stdout) == SHARDS[:fit]


@pytest.mark.parametrize(
    "store, cache_shards, samples, eval_shards",
    [
        ("files", None, 90, 1),  # 5 shards, the last of 10 samples, held out
        ("none", None, 90, ["00000", "00004"]),
        ("budget", 0.4, 90, 1),  # smaller than one shard: nothing stored
        ("budget", 2.2, 90, ["00001"]),  # 00000 and 00002 stored
        ("budget", 3.6, 90, ["00001"]),  # ... and the short 00004 (half a shard) fits too
    ],
)
def test_the_plan_counts_the_jobs_of_the_dag(workdir, store, cache_shards, samples, eval_shards):
    from eaglenest.common.config import validate_config
    from eaglenest.run.plan import DEMO_RATES, Assumptions, Rates, plan_run
    from eaglenest.run.store import estimated_sample_bytes

    config = merged(store_config(store), {"prompts": {"max_samples": samples}})
    config["train"] = {**config.get("train", {}), "eval_shards": eval_shards}
    if cache_shards is not None:
        shard_bytes = 20 * estimated_sample_bytes(validate_config(store_config("none")), 64)
        config["hidden"]["cache_gb"] = cache_shards * shard_bytes / 1e9
    validated = validate_config(merged(config, {}))
    tokens = validated["generation"]["max_tokens"] / 2
    assumptions = Assumptions(tokens, 64, Rates(**DEMO_RATES), validated["hidden"]["cache_gb"] or 1)
    plan = plan_run(validated, assumptions)
    planned = {rule: n for row in plan.stages for rule, n in row.jobs.items() if n}
    dry = planned_jobs(snakemake(workdir, "-n", config=config))
    assert {**planned, "all": 1} == dry
    stored_row = {row.mode: row for row in plan.stores}[store]
    assert stored_row.extract_jobs == dry.get("extract_hidden_states", 0)
