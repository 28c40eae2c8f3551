"""Drafters trained elsewhere (`evaluate.compare`): vLLM's speculative method read from each
drafter's config.json as vLLM would serve it (the speculators format, the Hugging Face EAGLE-3,
P-EAGLE and DFlash layouts, this project's own export), the K a DFlash drafter drafts at, and
the config check (vLLM only; a directory without config.json refused, naming the key). They are
decoded beside the run's own drafter in tests/engine/test_vllm_acceptance.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eaglenest.common.config import ConfigError, validate_config
from eaglenest.settings.compared_drafters import CompareError, compared_drafter
from eaglenest.settings.evaluate import compare_drafters


def drafter(tmp_path: Path, name: str, config: dict) -> Path:
    directory = tmp_path / name
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(config))
    return directory


CASES = {
    "speculators_eagle3": ({"speculators_model_type": "eagle3"}, {"method": "eagle3"}, None),
    "speculators_peagle": (
        {"speculators_model_type": "peagle", "mask_token_id": 5},
        {"method": "eagle3", "parallel_drafting": True},
        None,
    ),
    "speculators_dflash": (
        {"speculators_model_type": "dflash", "block_size": 8},
        {"method": "dflash"},
        (3, 7),  # a block of 8 serves both, as the run's own DFlash
    ),
    "eaglenest_export": (
        {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama"},
        {"method": "eagle3"},
        None,
    ),
    "hf_eagle3_qwen3": ({"architectures": ["Eagle3Qwen3ForCausalLM"]}, {"method": "eagle3"}, None),
    "hf_p_eagle": (
        {
            "architectures": ["Eagle3Qwen3ForCausalLM"],
            "parallel_drafting": True,
            "mask_token_id": 9,
        },
        {"method": "eagle3", "parallel_drafting": True},
        None,
    ),
    "z_lab_dflash": (
        {"architectures": ["DFlashDraftModel"], "dflash_config": {"block_size": 4}},
        {"method": "dflash"},
        (3,),  # a block of 4: K up to 3
    ),
    "eagle1": ({"architectures": ["EagleLlamaForCausalLM"]}, {"method": "eagle"}, None),
}


@pytest.mark.parametrize("name", CASES)
def test_the_method_is_read_from_the_drafters_config(tmp_path: Path, name: str):
    config, method, block_ks = CASES[name]
    directory = drafter(tmp_path, name, config)
    read = compared_drafter(directory)
    assert read.method == method
    assert read.ks((3, 7)) == (block_ks or (3, 7))
    assert read.speculative_config("/d", 3) == {
        **method,
        "model": "/d",
        "num_speculative_tokens": 3,
    }


def test_a_drafter_vllm_would_not_serve_is_refused_naming_the_key(tmp_path: Path):
    medusa = drafter(tmp_path, "medusa", {"architectures": ["MedusaModel"]})
    with pytest.raises(CompareError, match=r"'evaluate.compare.m'.*cannot tell vLLM's speculative"):
        compared_drafter(medusa, "evaluate.compare.m")
    unknown = drafter(tmp_path, "unknown", {"speculators_model_type": "mlp"})
    with pytest.raises(CompareError, match="speculators_model_type 'mlp' is not one of"):
        compared_drafter(unknown)
    no_block = drafter(tmp_path, "dflash", {"architectures": ["DFlashDraftModel"]})
    with pytest.raises(CompareError, match="without a block_size"):
        compared_drafter(no_block)


def test_the_config_check_needs_the_engine_and_a_config_json(tmp_path: Path):
    present = drafter(tmp_path, "present", {"speculators_model_type": "eagle3"})
    (present / "model.safetensors").write_bytes(b"")
    config = {"evaluate": {"engine": "vllm", "compare": {"published": str(present)}}}
    assert compare_drafters(validate_config(config)) == {"published": str(present)}
    with pytest.raises(ConfigError, match="evaluate.compare': drafters trained elsewhere are"):
        validate_config({"evaluate": {"compare": {"published": str(present)}}})
    missing = {"evaluate": {"engine": "vllm", "compare": {"gone": str(tmp_path / "gone")}}}
    with pytest.raises(ConfigError, match="evaluate.compare.gone'.*has no config.json"):
        validate_config(missing)
    with pytest.raises(ConfigError, match="evaluate.compare"):
        validate_config({"evaluate": {"engine": "vllm", "compare": {"a/b": str(present)}}})


MALFORMED = {
    "a list": ([{"architectures": ["Eagle3"]}], "holds a JSON list, not an object"),
    "null": (None, "holds a JSON NoneType, not an object"),
    "numbers": ({"architectures": [1, 2]}, "field 'architectures' is [1, 2], not a list of"),
    "a mapping": ({"architectures": {"Eagle3": 1}}, "field 'architectures' is {'Eagle3': 1}, not"),
    "a typed list": ({"speculators_model_type": ["eagle3"]}, "'speculators_model_type' is ['e"),
    "a string": ({"dflash_config": "block 8"}, "field 'dflash_config' is 'block 8', not an obj"),
    "a huge block": (
        {"speculators_model_type": "dflash", "block_size": 10**9},
        "block_size 1,000,000,000 is past 64",
    ),
}


@pytest.mark.parametrize("case", MALFORMED)
def test_a_malformed_compared_config_is_refused_by_the_config_check(tmp_path, case):
    """Each was a bare TypeError or AttributeError in the compare job, after generation (or read
    as EAGLE-3, or asked vLLM for 999,999,999 speculative tokens): now a dry run refuses it."""
    config, said = MALFORMED[case]
    directory = tmp_path / "d"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(config))
    (directory / "model.safetensors").write_bytes(b"")
    run = {"evaluate": {"engine": "vllm", "compare": {"other": str(directory)}}}
    with pytest.raises(ConfigError, match="config key 'evaluate.compare.other'") as err:
        validate_config(run)
    assert said in str(err.value)


def test_a_compared_directory_without_weights_or_that_loops_is_refused(tmp_path):
    bare = drafter(tmp_path, "bare", {"speculators_model_type": "eagle3"})
    run = {"evaluate": {"engine": "vllm", "compare": {"bare": str(bare)}}}
    with pytest.raises(ConfigError, match=r"'evaluate.compare.bare'.*holds no weights"):
        validate_config(run)
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    run = {"evaluate": {"engine": "vllm", "compare": {"loop": str(tmp_path / "a")}}}
    with pytest.raises(ConfigError, match=r"'evaluate.compare.loop'.*symbolic link to nothing"):
        validate_config(run)
