"""The served check in the evaluate stage (evaluate.py `check_served`, before anything is
decoded): a cliff stops an evaluation that serves the drafter in vLLM (evaluate.engine vllm,
evaluate.served_check refuse), naming the key; `flag` records it in metrics.json's
`served_check` and measures anyway (a cliff built on purpose), as does an evaluation without an
engine; `off` checks nothing. The served length is vllm.max_model_len, else the target's; the
version the one installed for vllm.python."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from support.drafter_sizes import CONFIG

from eaglenest.common.config import settings_from_sections, validate_config
from eaglenest.drafter.dflash.export import export_dflash
from eaglenest.drafter.dflash.model import DFlashConfig, DFlashDrafter
from eaglenest.drafter.export_files import TrainedFor
from eaglenest.drafter.served_check import DrafterRefused
from eaglenest.formats.metrics import EvalMetrics
from eaglenest.settings.evaluate import EvaluateSettings
from eaglenest.settings.vllm import VllmRuntime
from eaglenest.stages.evaluate.evaluate import check_served

POSITIONS = CONFIG.max_position_embeddings
KEY = "train.drafter.max_position_embeddings"


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    """A DFlash exported for a Qwen3 target of its own positions."""
    root = tmp_path_factory.mktemp("served")
    target = root / "target"
    target.mkdir()
    rope = {"rope_theta": CONFIG.rope_theta, "rope_type": "default"}
    target_config = {"model_type": "qwen3", "max_position_embeddings": POSITIONS}
    (target / "config.json").write_text(json.dumps({**target_config, "rope_parameters": rope}))
    config = DFlashConfig.from_drafter(CONFIG, num_hidden_layers=1, block_size=4, mask_token_id=1)
    torch.manual_seed(0)
    trained = TrainedFor(POSITIONS, POSITIONS)
    export_dflash(DFlashDrafter(config), root / "drafter", "float32", trained=trained)
    return {"target": target, "drafter": root / "drafter"}


def settings(files: dict, **evaluate) -> EvaluateSettings:
    target = {"path": str(files["target"])}
    return settings_from_sections(EvaluateSettings, evaluate=evaluate, target=target)


def runtime(max_model_len: int | None) -> VllmRuntime:
    return settings_from_sections(VllmRuntime, vllm={"max_model_len": max_model_len})


def test_a_cliff_stops_an_evaluation_in_vllm_naming_the_key(files):
    served = runtime(2 * POSITIONS)  # past the DFlash's positions, which vLLM 0.32 never raises
    with pytest.raises(DrafterRefused, match=KEY) as error:
        check_served(files["drafter"], "dflash", settings(files, engine="vllm"), served)
    assert "evaluate.served_check: flag" in str(error.value)
    assert check_served(files["drafter"], "dflash", settings(files, engine="vllm"), None) == []
    assert (
        check_served(files["drafter"], "dflash", settings(files, engine="vllm"), runtime(None))
        == []
    )


@pytest.mark.parametrize("evaluate", [{"engine": "vllm", "served_check": "flag"}, {"engine": None}])
def test_flagged_or_without_an_engine_the_findings_are_recorded(files, evaluate):
    findings = check_served(
        files["drafter"], "dflash", settings(files, **evaluate), runtime(2 * POSITIONS)
    )
    assert [(f["severity"], f["key"]) for f in findings] == [("refuse", KEY)]


def test_off_checks_nothing_and_yamls_off_is_off(files):
    assert (
        check_served(files["drafter"], "dflash", settings(files, served_check="off"), runtime(2))
        is None
    )
    off = validate_config({"evaluate": {"served_check": False}})  # YAML's unquoted off
    assert EvaluateSettings.from_config(off).served_check == "off"


def test_metrics_json_carries_the_findings():
    finding = {"severity": "flag", "key": "train.sequence.length", "message": "trained short"}
    simulated = {"3": {"acceptance_length": 2.0, "conditional_acceptance": [0.5, 0.5, 0.5]}}
    metrics = EvalMetrics.from_json({"ks": [3], "simulated": simulated, "served_check": [finding]})
    assert metrics.to_json()["served_check"] == [finding]
