"""A drafter family's train_drafter job tracks only the `train` keys its training reads
(`TrainSettings.of_family`): EAGLE-3's training-time test (ttt_steps, step_weight, ttt_inputs) is
not P-EAGLE's nor DFlash's, nor is the drafter's attention (llama | mla) and its MLA sizes, the EAGLE-3 variants and activation checkpointing are not DFlash's,
so changing one of them changes no other family's job settings (and reruns none of its jobs:
tests/workflow/test_families.py). A left-out key fails where read, naming it. Its
evaluate_drafter job tracks the K it is measured at, not evaluate.ks. EAGLE-3's jobs keep the
whole `train` and `evaluate` sections, as before families, so a finished run reruns nothing."""

from __future__ import annotations

import dataclasses

import pytest

from eaglenest.common.config import validate_config
from eaglenest.settings.evaluate import EvaluateSettings, evaluate_job_settings_json
from eaglenest.settings.families import FAMILIES, FAMILY_SPECS
from eaglenest.settings.train import (
    DrafterSettings,
    TrainSettings,
    train_job_settings,
    train_job_settings_json,
)

BASE = {"families": list(FAMILIES)}

# key changed (merged into the train section) -> the families whose job settings it changes
CHANGES = {
    "lr": ({"lr": 0.01}, {"eagle3", "p_eagle", "dflash"}),
    "step_weight": ({"step_weight": 0.5}, {"eagle3"}),
    "ttt_inputs": ({"ttt_inputs": "drafter", "families": ["eagle3", "dflash"]}, {"eagle3"}),
    # P-EAGLE's depths null means ttt_steps: it reads ttt_steps through them, only then.
    "ttt_steps, depths null": (
        {"ttt_steps": 5, "p_eagle": {"depths": None}},
        {"eagle3", "p_eagle"},
    ),
    "ttt_steps, depths set": ({"ttt_steps": 5, "p_eagle": {"depths": 7}}, {"eagle3"}),
    "ttt_steps, depths default": ({"ttt_steps": 5}, {"eagle3"}),
    "an EAGLE-3 variant": ({"drafter": {"norm_before_fc": False}}, {"eagle3", "p_eagle"}),
    "activation_checkpointing": ({"activation_checkpointing": True}, {"eagle3", "p_eagle"}),
    "a drafter size": ({"drafter": {"intermediate_size": 96}}, {"eagle3", "p_eagle", "dflash"}),
    # The attention is EAGLE-3's: P-EAGLE and DFlash are llama/Qwen3 attention beside any target.
    "the attention": ({"drafter": {"attention": "mla"}}, {"eagle3"}),
    "an MLA size": ({"drafter": {"kv_lora_rank": 16}}, {"eagle3"}),
    "DFlash's block": ({"dflash": {"block_size": 4}}, {"dflash"}),
    # DFlash's default head is the target's, frozen whole: it never reads lm_head_init.
    "lm_head_init": ({"lm_head_init": "target_frozen"}, {"eagle3", "p_eagle"}),
    # Which tokens and positions every family trains on: a change retrains each.
    "the sequence mode": ({"sequence": {"mode": "head"}}, {"eagle3", "p_eagle", "dflash"}),
    "the sequence length": ({"sequence": {"length": 4096}}, {"eagle3", "p_eagle", "dflash"}),
    "the sink": ({"sequence": {"sink": 16}}, {"eagle3", "p_eagle", "dflash"}),
}


def job_settings(train: dict) -> dict[str, str]:
    """family -> its train_drafter job's settings param, for train.families' families."""
    config = validate_config({"train": train})
    whole = TrainSettings.from_config(config).to_json()
    return {f: train_job_settings_json(whole, config, f) for f in config["train"]["families"]}


@pytest.mark.parametrize("change", CHANGES, ids=list(CHANGES))
def test_a_key_changes_the_job_settings_of_the_families_that_read_it(change):
    values, expected = CHANGES[change]
    families = values.get("families", BASE["families"])
    before = job_settings({**BASE, "families": families, "p_eagle": values.get("p_eagle", {})})
    after = job_settings({**BASE, **values})
    changed = {f for f in families if before[f] != after[f]}
    assert changed == expected & set(families), change


def test_a_family_job_reads_back_its_view_and_a_left_out_key_fails_naming_it():
    config = validate_config({"train": BASE})
    whole = TrainSettings.from_config(config)
    for family in FAMILIES:
        settings, own = train_job_settings(train_job_settings_json(whole.to_json(), config, family))
        assert own.name == family
        assert settings == whole.of_family(family, own.own_settings())
        assert settings.of_family(family, own.own_settings()) == settings  # a view's view: itself
        left_out = set(FAMILY_SPECS[family].not_read[0]) | {
            f"drafter.{n}" for n in FAMILY_SPECS[family].not_read[1]
        }
        recorded = settings.recorded()
        assert not left_out & (set(recorded) | {f"drafter.{n}" for n in recorded["drafter"]})
    dflash = whole.of_family("dflash")
    assert dflash.lr == whole.lr and dflash.drafter.head_dim == whole.drafter.head_dim
    with pytest.raises(AttributeError, match=r"train\.ttt_steps is not among"):
        range(dflash.ttt_steps)
    with pytest.raises(AttributeError, match=r"train\.drafter\.fc_norm is not among"):
        bool(dflash.drafter.fc_norm)
    # The variants left out are not set over the target's config: DFlash's are its own.
    assert "fc_norm" not in dflash.drafter.overrides()
    assert whole.of_family("eagle3") == whole


def test_a_dflash_with_its_own_head_reads_lm_head_init_and_one_with_the_targets_does_not():
    def dflash_job(head: str, lm_head_init: str) -> str:
        train = {**BASE, "dflash": {"head": head}, "lm_head_init": lm_head_init}
        return job_settings(train)["dflash"]

    assert dflash_job("draft", "target") != dflash_job("draft", "random")
    assert dflash_job("target", "target") == dflash_job("target", "random")
    config = validate_config({"train": {**BASE, "lm_head_init": "random"}})
    job = train_job_settings_json(TrainSettings.from_config(config).to_json(), config, "dflash")
    settings, _ = train_job_settings(job)
    with pytest.raises(AttributeError, match=r"train\.lm_head_init is not among"):
        str(settings.lm_head_init)


def test_what_a_family_leaves_out_are_fields_of_the_train_settings():
    train = {f.name for f in dataclasses.fields(TrainSettings)}
    drafter = {f.name for f in dataclasses.fields(DrafterSettings)}
    for family in FAMILIES:
        own, in_drafter = FAMILY_SPECS[family].not_read
        assert set(own) <= train and set(in_drafter) <= drafter, family
    assert FAMILY_SPECS["eagle3"].not_read == ((), ())


def test_p_eagle_defaults_to_its_references_operating_point():
    """speculators' P-EAGLE and the paper: 4 layers, 4 depths, a trained (mask) embedding."""
    config = validate_config({"train": {"families": ["p_eagle"]}})
    own = FAMILY_SPECS["p_eagle"].settings.from_config(config)
    assert (own.depths, own.num_hidden_layers, own.train_mask_embedding) == (4, 4, True)
    with pytest.raises(ValueError, match="num_hidden_layers"):
        validate_config({"train": {"p_eagle": {"num_hidden_layers": 0}}})
    # Each is the P-EAGLE job's own: it reruns that job alone.
    for own_key in ({"num_hidden_layers": 2}, {"train_mask_embedding": False}):
        before, after = job_settings(BASE), job_settings({**BASE, "p_eagle": own_key})
        assert {f for f in FAMILIES if before[f] != after[f]} == {"p_eagle"}


def test_a_family_evaluation_tracks_the_ks_it_is_measured_at_not_evaluate_ks():
    def evaluated(ks: list[int]) -> dict[str, EvaluateSettings]:
        train = {**BASE, "p_eagle": {"depths": 3}, "dflash": {"block_size": 4}}
        config = validate_config({"train": train, "evaluate": {"ks": ks}})
        whole = EvaluateSettings.from_config(config).to_json()
        jobs = {f: evaluate_job_settings_json(whole, config, f) for f in FAMILIES}
        assert jobs["eagle3"] == whole  # EAGLE-3's param as before families
        return {f: EvaluateSettings.from_json(text) for f, text in jobs.items()}

    before, after = evaluated([1, 3]), evaluated([1, 3, 5])
    # DFlash up to block_size - 1 = 3, as P-EAGLE up to its depths.
    assert [before[f].ks for f in FAMILIES] == [(1, 3), (1, 3), (1, 3)]
    assert after["eagle3"].ks == (1, 3, 5)
    assert after["p_eagle"] == before["p_eagle"] and after["dflash"] == before["dflash"]
    assert evaluated([5])["p_eagle"].ks == (3,)  # none up to its depths: its depths
    assert evaluated([5])["dflash"].ks == (3,)  # none up to block_size - 1: that
    assert evaluated([2])["p_eagle"].ks == (2,) == evaluated([2])["dflash"].ks
