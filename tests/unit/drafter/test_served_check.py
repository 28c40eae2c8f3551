"""The served check (eaglenest.drafter.served_check, `eaglenest check-drafter`): each
configuration cliff built on purpose on a small drafter exported by the project's own code is
refused or flagged with the key that fixes it, and the same drafters exported for their target
pass. The target configs are a Qwen3's (rope_parameters) and a Kimi-K2.5-shaped one (a
DeepSeek-V3 text_config with YaRN x64 from 4,096, as its config.json writes it)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from support.drafter_sizes import CONFIG

from eaglenest.cli import main
from eaglenest.demo.kimi_layout import kimi_config
from eaglenest.drafter.dflash.export import export_dflash
from eaglenest.drafter.dflash.model import DFlashConfig, DFlashDrafter, target_rope_scaling
from eaglenest.drafter.eagle3.export import export_drafter
from eaglenest.drafter.eagle3.model import Eagle3Drafter
from eaglenest.drafter.export_files import TrainedFor
from eaglenest.drafter.p_eagle.export import export_p_eagle
from eaglenest.drafter.p_eagle.model import PEagleDrafter
from eaglenest.drafter.served_check import (
    FLAG,
    REFUSE,
    DrafterRefused,
    check_drafter,
    enforce,
)

MASK = 49
POSITIONS = 4096  # CONFIG's max_position_embeddings
QWEN3 = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "max_position_embeddings": POSITIONS,
    "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
}
KIMI_YARN = {
    "type": "yarn",
    "factor": 64.0,
    "original_max_position_embeddings": 4096,
    "beta_fast": 1.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}
KIMI_POSITIONS = 262_144
KIMI = kimi_config(
    {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "max_position_embeddings": KIMI_POSITIONS,
        "rope_theta": 50000.0,
        "rope_scaling": KIMI_YARN,
    }
)
TRAINED = TrainedFor(trained_positions=POSITIONS, served_length=POSITIONS)


def eagle3(out: Path, config=CONFIG, trained: TrainedFor = TRAINED) -> Path:
    torch.manual_seed(0)
    export_drafter(Eagle3Drafter(config), out, dtype="float32", trained=trained)
    return out


def p_eagle(out: Path, config=CONFIG, trained: TrainedFor = TRAINED) -> Path:
    torch.manual_seed(0)
    model = PEagleDrafter(config, MASK, num_hidden_layers=2)
    export_p_eagle(model, out, depths=3, dtype="float32", trained=trained)
    return out


def dflash_config(rope_scaling: dict | None = None, **sizes) -> DFlashConfig:
    base = replace(CONFIG, **sizes)
    return DFlashConfig.from_drafter(
        base, num_hidden_layers=2, block_size=4, mask_token_id=MASK, rope_scaling=rope_scaling
    )


def dflash(out: Path, config: DFlashConfig | None = None, trained: TrainedFor = TRAINED) -> Path:
    torch.manual_seed(0)
    export_dflash(DFlashDrafter(config or dflash_config()), out, "float32", trained=trained)
    return out


def kimi_dflash(out: Path, rope_scaling: dict | None) -> Path:
    """A DFlash sized for Kimi-K2.5's positions and base, with `rope_scaling` as trained."""
    config = dflash_config(rope_scaling, rope_theta=50000.0, max_position_embeddings=KIMI_POSITIONS)
    return dflash(out, config, TrainedFor(KIMI_POSITIONS, KIMI_POSITIONS))


def edit_config(drafter: Path, edit) -> Path:
    path = drafter / "config.json"
    config = json.loads(path.read_text())
    edit(config)
    path.write_text(json.dumps(config))
    return drafter


def keys(findings) -> list[tuple[str, str]]:
    return [(f.severity, f.key) for f in findings]


@pytest.mark.parametrize("export", [eagle3, p_eagle, dflash])
def test_a_drafter_exported_for_its_target_passes(tmp_path, export):
    assert check_drafter(export(tmp_path / "drafter"), QWEN3) == []


def test_a_dflash_with_the_kimi_targets_yarn_and_positions_passes_beside_it(tmp_path):
    scaling = target_rope_scaling(SimpleNamespace(rope_scaling=KIMI_YARN))
    assert check_drafter(kimi_dflash(tmp_path / "d", scaling), KIMI) == []


def test_a_dflash_with_positions_below_the_served_length_is_refused(tmp_path):
    drafter = dflash(tmp_path / "d")
    findings = check_drafter(drafter, QWEN3, served_length=2 * POSITIONS, family="dflash")
    assert keys(findings) == [(REFUSE, "train.drafter.max_position_embeddings")]
    message = findings[0].message
    assert str(drafter / "config.json") in message
    assert f"max_position_embeddings {POSITIONS}" in message and str(2 * POSITIONS) in message
    assert check_drafter(drafter, QWEN3, served_length=POSITIONS) == []
    # vLLM 0.33 raises a DFlash draft's too, but not a YaRN draft's.
    assert check_drafter(drafter, QWEN3, 2 * POSITIONS, vllm_version=(0, 33, 0)) == []
    scaling = target_rope_scaling(SimpleNamespace(rope_scaling=KIMI_YARN))
    yarn = kimi_dflash(tmp_path / "yarn", scaling)
    refused = check_drafter(yarn, KIMI, 2 * KIMI_POSITIONS, vllm_version=(0, 33, 0))
    assert keys(refused) == [(REFUSE, "train.drafter.max_position_embeddings")]


def test_an_eagle3_below_the_served_length_is_raised_by_vllm_but_flagged_if_trained_short(
    tmp_path,
):
    served = 4 * POSITIONS
    long = eagle3(tmp_path / "long", trained=TrainedFor(3 * POSITIONS, POSITIONS))
    assert check_drafter(long, QWEN3, served_length=served) == []
    short = eagle3(tmp_path / "short", trained=TrainedFor(POSITIONS, POSITIONS))
    findings = check_drafter(short, QWEN3, served_length=served)
    assert keys(findings) == [(FLAG, "train.sequence.length")]
    assert str(POSITIONS) in findings[0].message and str(served) in findings[0].message
    # An export without a record of its training (a drafter made elsewhere): not flagged.
    unknown = eagle3(tmp_path / "unknown", trained=TrainedFor())
    assert check_drafter(unknown, QWEN3, served_length=served) == []


def test_a_rope_theta_unlike_the_targets_is_refused(tmp_path):
    drafter = eagle3(tmp_path / "d", replace(CONFIG, rope_theta=1e6))
    findings = check_drafter(drafter, QWEN3)
    assert keys(findings) == [(REFUSE, "train.drafter.rope_theta")]
    assert "1000000.0" in findings[0].message and "10000.0" in findings[0].message


def test_an_unscaled_drafter_beside_a_yarn_target_is_refused(tmp_path):
    """Kimi-K2.5's layout: the target's schedule is in its text_config, as DeepSeek-V3 names it
    (`type: yarn` in rope_scaling)."""
    sized = replace(CONFIG, rope_theta=50000.0, max_position_embeddings=KIMI_POSITIONS)
    trained = TrainedFor(KIMI_POSITIONS, KIMI_POSITIONS)
    findings = check_drafter(eagle3(tmp_path / "e", sized, trained), KIMI)
    assert keys(findings) == [(REFUSE, "train.families")]
    assert "rope_type default" in findings[0].message and "rope_type yarn" in findings[0].message
    assert "factor 64.0" in findings[0].message
    findings = check_drafter(kimi_dflash(tmp_path / "d", None), KIMI)
    assert keys(findings) == [(REFUSE, "target.path")]


def test_a_yarn_factor_unlike_the_targets_is_refused(tmp_path):
    scaling = target_rope_scaling(SimpleNamespace(rope_scaling={**KIMI_YARN, "factor": 32.0}))
    findings = check_drafter(kimi_dflash(tmp_path / "d", scaling), KIMI)
    assert keys(findings) == [(REFUSE, "target.path")] and "factor 32.0" in findings[0].message


def without_window(config: dict) -> None:
    del config["layer_types"], config["sliding_window"]


WINDOW_EDITS = {
    # EAGLE-3 trained with a window of 16, its layer_types stripped: served with full attention.
    "eagle3 stripped": (eagle3, {"sliding_window": 16}, without_window),
    # Another window than trained.
    "eagle3 wider": (eagle3, {"sliding_window": 16}, lambda c: c.update(sliding_window=2048)),
    # P-EAGLE's second layer named full: vLLM windows only the first.
    "p_eagle one layer": (
        p_eagle,
        {"sliding_window": 16},
        lambda c: c.update(layer_types=["sliding_attention", "full_attention"]),
    ),
    # A full-attention EAGLE-3 exported with a window it never trained.
    "eagle3 added": (
        eagle3,
        {},
        lambda c: c.update(layer_types=["sliding_attention"], sliding_window=2048),
    ),
    # DFlash trained with full attention, one layer sliding in config.json (sized or not).
    "dflash sliding": (
        dflash,
        None,
        lambda c: c.update(
            layer_types=["sliding_attention", "full_attention"],
            use_sliding_window=True,
            sliding_window=8,
        ),
    ),
    "dflash sliding unsized": (
        dflash,
        None,
        lambda c: c.update(layer_types=["sliding_attention", "full_attention"], sliding_window=8),
    ),
    "dflash use_swa": (
        dflash,
        None,
        lambda c: c["dflash_config"].update(use_swa=True, swa_window_size=2048),
    ),
}


@pytest.mark.parametrize("case", list(WINDOW_EDITS))
def test_a_window_vllm_would_not_serve_as_trained_is_refused(tmp_path, case):
    export, window, edit = WINDOW_EDITS[case]
    config = None if window is None else replace(CONFIG, **window)
    drafter = export(tmp_path / "d") if config is None else export(tmp_path / "d", config)
    assert check_drafter(drafter, QWEN3) == []  # as exported: served as trained
    findings = check_drafter(edit_config(drafter, edit), QWEN3)
    assert keys(findings) == [(REFUSE, "train.drafter.sliding_window")]
    assert str(drafter / "config.json") in findings[0].message


def test_refusals_raise_naming_the_key_unless_flagged(tmp_path):
    drafter = dflash(tmp_path / "d", trained=TrainedFor(100, POSITIONS))
    findings = check_drafter(drafter, QWEN3, served_length=2 * POSITIONS)
    assert keys(findings) == [
        (REFUSE, "train.drafter.max_position_embeddings"),
        (FLAG, "train.sequence.length"),
    ]
    with pytest.raises(DrafterRefused, match="train.drafter.max_position_embeddings") as error:
        enforce(findings, REFUSE, "the run")
    assert "train.sequence.length" not in str(error.value)  # a flag never stops a run
    recorded = enforce(findings, FLAG, "the run")
    assert [f["key"] for f in recorded] == [f.key for f in findings]
    assert enforce(findings[1:], REFUSE, "the run") == [findings[1].to_json()]


def test_check_drafter_exits_1_on_a_refusal_and_names_the_key(tmp_path, capsys):
    drafter = dflash(tmp_path / "d")
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps(QWEN3))
    arguments = ["check-drafter", "--drafter", str(drafter), "--target", str(target)]
    assert main(arguments) == 0
    assert "no configuration cliff" in capsys.readouterr().out
    assert main([*arguments, "--served-length", str(2 * POSITIONS)]) == 1
    printed = capsys.readouterr().out
    assert printed.startswith("refuse\ttrain.drafter.max_position_embeddings\t")
    assert main([*arguments, "--served-length", str(2 * POSITIONS), "--vllm-version", "0.33"]) == 0
