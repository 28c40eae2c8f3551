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
    for store in ("files", "none"):  # read by budget only: it was silently ignored
        with pytest.raises(
            ConfigError,
            match=f"cache_gb 2 is read by hidden.store budget only, "
            f"and this run's store is {store}",
        ):
            config({"store": store, "cache_gb": 2, **POOL}, URL)
    store = HiddenStoreSettings.from_config(config({"store": "budget", "cache_gb": 2, **POOL}, URL))
    assert (store.store, store.cache_gb, store.from_pool) == ("budget", 2, True)
    both = config({"store": "none", **POOL}, {"capture_urls": ["http://a:1", "http://b:1"]})
    assert HiddenStoreSettings.from_config(both).from_pool


def test_budget_stores_the_first_training_shards_that_fit_and_plan_counts_the_same():
    from eaglenest.run.plan import Assumptions, Rates, plan_run
    from eaglenest.run.split import split_shards
    from eaglenest.run.store import estimated_sample_bytes

    base = config({"store": "budget", "cache_gb": 1, **POOL}, URL)
    # 6 shards of 20: 5 training, 1 held out.
    base["prompts"]["max_samples"] = 20 * 6
    shards = [f"{i:05d}" for i in range(5)]
    sample_bytes = estimated_sample_bytes(base, base["demo_target"]["hidden_size"])
    # hidden 64, bf16 aux and final_hidden: (3 + 1) x 64 x 2 bytes, + ids and mask = 521 a token
    assert sample_bytes == 160 / 2 * (4 * 64 * 2 + 8 + 1)
    shard_bytes = 20 * sample_bytes
    for fit in (0, 1, 3, 5):
        cache_gb = (fit + 0.5) * shard_bytes / 1e9 if fit < 5 else 1.0
        budget = {**base, "hidden": {**base["hidden"], "cache_gb": cache_gb}}
        split = split_shards(budget)
        assert split.stored_training == tuple(shards[:fit]) and split.stored_heldout == ()
        assert split.fetched_among(split.shards) == [*shards[fit:], "00005"]
        assumptions = Assumptions(160 / 2, 64, Rates(1, 1, 1), cache_gb)
        rows = {r.mode: r for r in plan_run(budget, assumptions).stores}
        assert rows["budget"].stored_shards == fit
    files = split_shards(config({}))
    assert files.stored == files.training + files.heldout == ("00000", "00001")
    none = split_shards(config({"store": "none", **POOL}, URL))
    assert none.stored == () and none.fetched_among(none.shards) == ["00000", "00001"]


def test_a_short_last_shard_weighs_its_own_samples():
    """With `max_samples` not a multiple of `shard_size`, the last shard holds fewer samples and
    its estimate is theirs: a budget that fits 2.5 full shards stores a 3rd shard of half size."""
    from eaglenest.run.split import split_shards
    from eaglenest.run.store import estimated_sample_bytes

    raw = config({"store": "budget", "cache_gb": 1, **POOL}, URL, train={"eval_shards": ["00000"]})
    raw["prompts"]["max_samples"] = 20 * 3 + 10  # 00003 holds 10
    sample_bytes = estimated_sample_bytes(raw, 64)
    for cache_samples, stored in (
        (19, ()),
        (40, ("00001", "00002")),
        (50, ("00001", "00002", "00003")),
    ):
        raw["hidden"]["cache_gb"] = cache_samples * sample_bytes / 1e9
        assert split_shards(raw).stored_training == stored


def test_eval_shards_that_the_run_lacks_or_that_hold_out_everything_are_refused():
    from eaglenest.run.split import split_shards

    with pytest.raises(ValueError, match=r"names shards \['00007'\] that this run does not have"):
        split_shards(config({}, train={"eval_shards": ["00007"]}))
    with pytest.raises(ValueError, match="holds out every shard \\(2\\)"):
        split_shards(config({}, train={"eval_shards": 2}))
