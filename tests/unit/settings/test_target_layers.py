"""The target layers: what the capture keeps (hidden.aux_layer_ids, else the union of
train.families' defaults), which of them each family reads (train.aux_layer_ids), what is refused
before any job, and what `hidden.store: budget` and `eaglenest plan` weigh a token at. Defaults
hand-computed: vLLM's (2, N//2, N-3); z-lab's build_target_layer_ids(N, 5) = round(1 + i(N-4)/4),
i = 0..4, "output of layer i", one more in the project's "input of decoder layer i"."""

from __future__ import annotations

import copy
import json

import pytest
from support.workflow import SMALL_DEMO

from eaglenest.common.config import ConfigError, validate_config
from eaglenest.settings.families import captured_layer_ids, family_layer_ids, layer_rules


def demo(**sections) -> dict:
    """The small demo's config (an 8-layer target, its layers known before any job), with these
    sections over it, validated."""
    raw = copy.deepcopy(SMALL_DEMO)
    for name, values in sections.items():
        raw[name] = {**raw.get(name, {}), **values}
    return validate_config(raw)


@pytest.mark.parametrize(
    ("layers", "families", "captured"),
    [
        (8, ["eagle3"], (2, 4, 5)),
        (8, ["p_eagle"], (2, 4, 5)),
        (8, ["dflash"], (2, 3, 4, 5, 6)),  # z-lab: 1, 2, 3, 4, 5
        (8, ["eagle3", "p_eagle", "dflash"], (2, 3, 4, 5, 6)),
        (36, ["eagle3"], (2, 18, 33)),
        (36, ["dflash"], (2, 10, 18, 26, 34)),  # z-lab's Qwen3-8B drafters: 1, 9, 17, 25, 33
        (36, ["eagle3", "dflash"], (2, 10, 18, 26, 33, 34)),
        (61, ["eagle3", "p_eagle"], (2, 30, 58)),
        # z-lab: 1, 15.25, 29.5, 43.75, 58 rounded (half to even, as Python's round) 1, 15, 30, 44, 58
        (61, ["dflash", "eagle3"], (2, 16, 30, 31, 45, 58, 59)),
    ],
)
def test_the_default_capture_is_the_union_of_the_families_defaults(layers, families, captured):
    assert captured_layer_ids(None, layer_rules(families), layers) == captured


def test_vllms_default_alone_is_captured_as_vllm_gives_it():
    """Below 7 layers vLLM's default repeats a layer, out of order: kept as every run kept it."""
    assert captured_layer_ids(None, layer_rules(["eagle3"]), 6) == (2, 3, 3)
    assert captured_layer_ids([5, 1, 3], layer_rules(["dflash"]), 8) == (5, 1, 3)  # as set


def test_each_family_reads_its_own_layers_of_the_capture_in_the_captured_order():
    union = (2, 3, 4, 5, 6)
    assert family_layer_ids("eagle3", None, union, 8) == (2, 4, 5)
    assert family_layer_ids("p_eagle", None, union, 8) == (2, 4, 5)
    assert family_layer_ids("dflash", None, union, 8) == union
    assert family_layer_ids("dflash", [6, 3], union, 8) == (3, 6)  # the capture's order
    # A capture set for another choice: a family whose default is not all in it reads it whole
    # (what every family read before families chose).
    assert family_layer_ids("dflash", None, (2, 4, 5), 8) == (2, 4, 5)
    assert family_layer_ids("eagle3", None, (1, 2, 3), 8) == (1, 2, 3)
    with pytest.raises(ValueError, match=r"train.aux_layer_ids.eagle3 \[2, 7\]: layers \[7\] are "
                                         r"not captured; hidden.aux_layer_ids captures"):  # fmt: skip
        family_layer_ids("eagle3", [2, 7], union, 8)


def test_a_shallow_targets_capture_is_read_whole_not_as_its_repeated_default():
    """A 5-layer target's vLLM default is (2, 2, 2): of a capture of [2, 3, 4] the drafter
    read layer 2 alone, where the features a written target holds ahead lie in layer 4."""
    assert family_layer_ids("eagle3", None, (2, 3, 4), 5) == (2, 3, 4)
    assert family_layer_ids("p_eagle", None, (1, 2, 3), 4) == (1, 2, 3)  # (2, 2, 1) by default
    assert family_layer_ids("eagle3", [2], (2, 3, 4), 5) == (2,)  # chosen: as chosen
    assert family_layer_ids("eagle3", None, (2, 3, 3), 6) == (2, 3, 3)  # vLLM's, as captured


def test_a_layer_no_capture_holds_is_refused_before_any_job_naming_both_keys():
    keys = r"train.aux_layer_ids.dflash \[2, 7\]: layers \[7\] .*hidden.aux_layer_ids"
    families = {"families": ["eagle3", "dflash"]}
    with pytest.raises(ConfigError, match=keys):
        demo(train={**families, "aux_layer_ids": {"dflash": [2, 7]}})
    with pytest.raises(ConfigError, match=r"train.aux_layer_ids.eagle3 \[6\]: layers \[6\]"):
        demo(hidden={"aux_layer_ids": [2, 4, 5]}, train={"aux_layer_ids": {"eagle3": [6]}})
    # A target whose layers are not known here (a hub id): a set capture is still checked.
    hub = {"enabled": False}
    with pytest.raises(ConfigError, match=keys):
        demo(demo_target=hub, target={"path": "org/a-hub-id"}, hidden={"aux_layer_ids": [2, 4, 5]},
             train={**families, "aux_layer_ids": {"dflash": [2, 7]}})  # fmt: skip
    with pytest.raises(ConfigError, match=r"\[2, 4, 8\] names a layer past the target's 8"):
        demo(hidden={"aux_layer_ids": [2, 4, 8]})
    with pytest.raises(ConfigError, match="hidden.aux_layer_ids"):  # the schema: 3 at least
        demo(hidden={"aux_layer_ids": [2, 4]})
    demo(hidden={"aux_layer_ids": [1, 2, 3, 4, 5, 6, 7]}, train={"aux_layer_ids": {"eagle3": [7]}})


def test_the_default_runs_params_are_todays_and_a_family_choosing_its_layers_recaptures_nothing():
    """With train.families [eagle3] the capture's, the head's and the EAGLE-3 job's settings
    are byte for byte what they were before families read layers of their own (these strings:
    main at e0da446), so a finished run reruns nothing; DFlash at its default widens the capture,
    DFlash choosing captured layers does not."""
    from eaglenest.settings.hidden_states import HiddenSettings, TargetHeadSettings
    from eaglenest.settings.train import TrainSettings, train_job_settings, train_job_settings_json

    config = demo()
    head = TargetHeadSettings.from_config(config).to_json()
    assert head == '{"aux_layer_ids": null, "target": {"path": null, "trust_remote_code": false}}'
    hidden = json.loads(HiddenSettings.from_config(config).to_json())
    assert "layer_rules" not in hidden and hidden["aux_layer_ids"] is None
    train = TrainSettings.from_config(config).to_json()
    assert train_job_settings_json(train, config, "eagle3") == train

    widened = demo(train={"families": ["eagle3", "dflash"]})
    assert json.loads(HiddenSettings.from_config(widened).to_json())["layer_rules"] == [
        "vllm",
        "z-lab",
    ]
    chosen = demo(train={"families": ["eagle3", "dflash"], "aux_layer_ids": {"dflash": [2, 4]}})
    assert (
        HiddenSettings.from_config(chosen).to_json() == HiddenSettings.from_config(config).to_json()
    )
    # EAGLE-3 choosing its layers: its job tracks them, read back as they were chosen.
    own = demo(train={"aux_layer_ids": {"eagle3": [2, 5]}})
    text = train_job_settings_json(TrainSettings.from_config(own).to_json(), own, "eagle3")
    assert text != train and train_job_settings(text)[1].aux_layer_ids == (2, 5)


def test_budget_and_plan_weigh_a_token_with_the_captured_layers():
    """hidden 64, bf16 aux and final_hidden, + 8 bytes of id and 1 of mask: (n + 1) x 64 x 2 + 9;
    the small demo's eval reads vLLM's three, DFlash's default widens the capture to five."""
    from eaglenest.run.plan import Assumptions, Rates, plan_run
    from eaglenest.run.store import captured_layer_count, hidden_bytes_per_token

    three, five = demo(), demo(train={"families": ["eagle3", "dflash"]})
    assert captured_layer_count(three) == 3 and captured_layer_count(five) == 5
    assert hidden_bytes_per_token(three, 64) == 4 * 64 * 2 + 9 == 521
    assert hidden_bytes_per_token(five, 64) == 6 * 64 * 2 + 9 == 777
    set_five = demo(hidden={"aux_layer_ids": [1, 2, 3, 5, 7]})
    assert hidden_bytes_per_token(set_five, 64) == 777
    plan = plan_run(five, Assumptions(80, 64, Rates(1, 1, 1), 1.0))
    assert plan.hidden_bytes_per_token == 777
