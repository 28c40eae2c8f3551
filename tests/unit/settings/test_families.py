"""The family table (eaglenest.settings.families): the paths each family's files take, the K it
is served at, and what of a config it refuses, as the stages and the rules read them."""

import pytest

from eaglenest.settings.families import (
    FAMILIES,
    FAMILY_SPECS,
    block_served_k,
    family_of_suffix,
    family_spec,
    family_suffix,
)
from eaglenest.settings.train import check_families


def test_the_table_lists_the_families_in_the_order_every_listing_shows():
    assert FAMILIES == ("eagle3", "p_eagle", "dflash")
    assert all(FAMILY_SPECS[name].name == name for name in FAMILIES)


def test_eagle3_keeps_its_paths_and_the_others_add_their_name():
    assert [family_suffix(f) for f in FAMILIES] == ["", "_p_eagle", "_dflash"]
    assert [family_of_suffix(family_suffix(f)) for f in FAMILIES] == list(FAMILIES)
    with pytest.raises(ValueError, match="is not one of eagle3, p_eagle, dflash"):
        family_suffix("medusa")
    with pytest.raises(ValueError, match="no drafter family's suffix"):
        family_of_suffix("_medusa")


def test_a_spec_is_found_by_its_name_or_is_itself():
    spec = family_spec("dflash")
    assert family_spec(spec) is spec and spec.title == "DFlash" and spec.parallel


def test_each_family_is_served_at_its_own_ks():
    configured = (1, 3, 5)
    assert FAMILY_SPECS["eagle3"].served_ks(configured, None) == configured
    assert FAMILY_SPECS["p_eagle"].served_ks(configured, 3) == (1, 3)  # up to its depths
    assert FAMILY_SPECS["p_eagle"].served_ks((5,), 3) == (3,)  # none: its depths
    # DFlash: up to block_size - 1 (vLLM 0.32 drafts any K of a DFlash block), else that.
    assert FAMILY_SPECS["dflash"].served_ks(configured, 4) == (1, 3)
    assert FAMILY_SPECS["dflash"].served_ks((5, 7), 4) == (3,) == (block_served_k(4),)


@pytest.mark.parametrize(
    "train, refused",
    [
        ({"families": ["dflash"], "drafter": {"sliding_window": 64}}, "dflash with"),
        ({"families": ["p_eagle"], "ttt_inputs": "drafter"}, "p_eagle with"),
    ],
)
def test_a_family_refuses_what_vllm_would_not_serve_naming_the_keys(train, refused):
    with pytest.raises(ValueError, match=refused):
        check_families(train)


def test_eagle3_refuses_none_of_that():
    check_families({"families": ["eagle3"], "drafter": {"sliding_window": 64}})
    check_families({"families": ["eagle3"], "ttt_inputs": "drafter"})


@pytest.mark.parametrize("family", ["p_eagle", "dflash"])
def test_an_mla_eagle3_trains_beside_the_parallel_families(family):
    """train.drafter.attention is EAGLE-3's: P-EAGLE and DFlash beside it are llama/Qwen3
    attention (vLLM drafts in parallel with no MLA drafter), so an MLA target's run trains them
    too; what they refuse of their own stays refused beside an MLA EAGLE-3."""
    mla = {"attention": "mla", "kv_lora_rank": 16}
    check_families({"families": ["eagle3", family], "drafter": mla})
    assert {"attention", "kv_lora_rank"} <= set(FAMILY_SPECS[family].not_read[1])
    assert FAMILY_SPECS["eagle3"].not_read == ((), ())
    own = {"p_eagle": ({"ttt_inputs": "drafter"}, "p_eagle with train.ttt_inputs drafter")}
    own["dflash"] = ({"drafter": {"sliding_window": 64}}, "dflash with train.drafter.sliding")
    refused, message = own[family]
    with pytest.raises(ValueError, match=message):
        check_families({"families": ["eagle3", family], **refused})
