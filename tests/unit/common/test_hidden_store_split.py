"""`hidden.store`: the config checks of none and budget, and which training shards budget stores
(the first that fit in `hidden.cache_gb`, from the config alone, as `eaglenest plan` counts)."""

from __future__ import annotations

import copy

import pytest
from support.workflow import SMALL_DEMO

from eaglenest.common.config import ConfigError, validate_config

POOL = {"backend": "vllm"}
URL = {"capture_url": "http://127.0.0.1:8765"}


def config(hidden: dict, vllm: dict | None = None, **sections) -> dict:
    raw = copy.deepcopy(SMALL_DEMO)
    raw["hidden"] = {**raw.get("hidden", {}), **hidden}
    raw["vllm"] = {**raw.get("vllm", {}), **(vllm or {})}
    raw.update(sections)
    return validate_config(raw)


def test_files_is_the_default_and_none_and_budget_need_the_capture_servers():
    from eaglenest.settings.hidden_states import HiddenStoreSettings

    store = HiddenStoreSettings.from_config(config({}))
    assert (store.store, store.cache_gb, store.from_pool) == ("files", None, False)
    with pytest.raises(ConfigError, match="hidden.store none .* needs hidden.backend vllm"):
        config({"store": "none"}, URL)
    with pytest.raises(ConfigError, match="hidden.store none .* set vllm.capture_urls"):
        config({"store": "none", **POOL})
    with pytest.raises(ConfigError, match="hidden.store budget needs hidden.cache_gb"):
        config({"store": "budget", **POOL}, URL)
    with pytest.raises(ConfigError, match="hidden.store"):
        config({"store": "somewhere"})
    store = HiddenStoreSettings.from_config(config({"store": "budget", "cache_gb": 2, **POOL}, URL))
    assert (store.store, store.cache_gb, store.from_pool) == ("budget", 2, True)
    both = config({"store": "none", **POOL}, {"capture_urls": ["http://a:1", "http://b:1"]})
    assert HiddenStoreSettings.from_config(both).from_pool


def test_budget_stores_the_first_training_shards_that_fit_and_plan_counts_the_same():
    from eaglenest.common.hidden_store import estimated_shard_bytes, stored_training_shards
    from eaglenest.common.plan import Assumptions, Rates, plan_run

    shards = [f"{i:05d}" for i in range(5)]
    base = config({"store": "budget", "cache_gb": 1, **POOL}, URL)
    shard_bytes = estimated_shard_bytes(base, base["demo_target"]["hidden_size"])
    # hidden 64, bf16 aux and final_hidden: (3 + 1) x 64 x 2 bytes, + ids and mask = 521 a token
    assert shard_bytes == 20 * 160 / 2 * (4 * 64 * 2 + 8 + 1)
    for fit in (0, 1, 3, 5):
        cache_gb = (fit + 0.5) * shard_bytes / 1e9 if fit < 5 else 1.0
        budget = config({"store": "budget", "cache_gb": cache_gb, **POOL}, URL)
        assert stored_training_shards(budget, shards) == shards[:fit]
        assumptions = Assumptions(160 / 2, 64, Rates(1, 1, 1), cache_gb)
        prompts = {**budget["prompts"], "max_samples": 20 * 6}  # 6 shards: 5 training, 1 held out
        rows = {r.mode: r for r in plan_run({**budget, "prompts": prompts}, assumptions).stores}
        assert rows["budget"].stored_shards == fit
    assert stored_training_shards(config({}), shards) == shards
    assert stored_training_shards(config({"store": "none", **POOL}, URL), shards) == []
