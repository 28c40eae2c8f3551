"""Config validation: defaults fill in, bad keys and types fail naming the key (the library; in
Snakemake: tests/workflow/test_config_errors_in_snakemake.py)."""

import copy
from pathlib import Path

import pytest
import yaml

from eaglenest.common.config import ConfigError, merged_config, validate_config

REPO = Path(__file__).resolve().parents[3]


def demo_config() -> dict:
    return yaml.safe_load((REPO / "config" / "config.yaml").read_text())


def test_defaults_fill_every_section():
    config = validate_config(demo_config())
    assert config["probe"]["max_tokens"] == 256
    assert config["server"]["faults"]["error_500"] == 0
    assert config["target"]["think_tokens"]["start"] == "<think>"


def test_misspelled_key_is_named_with_a_suggestion():
    config = demo_config()
    config["probe"]["max_tokenz"] = 10
    with pytest.raises(ConfigError) as err:
        validate_config(config)
    assert "probe.max_tokenz" in str(err.value)
    assert "did you mean 'max_tokens'" in str(err.value)


def test_wrong_type_is_named():
    config = demo_config()
    config["server"]["max_batch_size"] = "lots"
    with pytest.raises(ConfigError) as err:
        validate_config(config)
    assert "server.max_batch_size" in str(err.value)
    assert "integer" in str(err.value)


def test_unknown_top_level_section_is_named():
    config = demo_config()
    config["genration"] = {}
    with pytest.raises(ConfigError, match="unknown config key 'genration'"):
        validate_config(config)


def test_example_configs_are_valid():
    for path in sorted((REPO / "config" / "examples").glob("*.yaml")):
        config = merged_config([path])  # as `--configfile <path>` runs
        assert config["endpoints"], f"{path.name} should point at real endpoints"
        assert not config["server"]["enabled"]


def over(base: dict, change: dict) -> dict:
    """`change` merged into `base` key by key, nested sections too, as `--configfile` does."""
    out = copy.deepcopy(base)
    for key, value in change.items():
        nested = isinstance(value, dict) and isinstance(out.get(key), dict)
        out[key] = over(out[key], value) if nested else copy.deepcopy(value)
    return out


TEST_CONFIGS = sorted((REPO / "config" / "tests").glob("*.yaml"))
# What a test config exists to change; the rest is demo-small's (its small demo target included,
# which the workflow tests build once and copy into each run).
OWN_SECTIONS = ("run", "server", "probe")
# Configs of another target, run end to end on their own (tests/engine/):
# DeepSeek-V3, the same in Kimi-K2.5's layout, the long-reasoning and collapsing demos' targets.
OWN_TARGET = (
    "deepseek-v3",
    "kimi-k2.5-layout",
    "long-reasoning",
    "depth-collapse",
    "depth-collapse-study",
)


@pytest.mark.parametrize("path", TEST_CONFIGS, ids=[p.stem for p in TEST_CONFIGS])
def test_test_configs_are_valid_over_the_demo_config(path):
    own = yaml.safe_load(path.read_text())
    config = validate_config(over(demo_config(), own))
    assert config["run"] == path.stem  # its own results/, logs/ and benchmarks/
    if path.stem in OWN_TARGET:  # another architecture, or the long tasks
        target = config["demo_target"]
        assert (target["architecture"], target["tasks"]) != ("qwen3", "short")
        return
    small = yaml.safe_load((REPO / "config" / "tests" / "demo-small.yaml").read_text())
    shared = {k: v for k, v in own.items() if k not in OWN_SECTIONS}
    assert shared == {k: v for k, v in small.items() if k not in OWN_SECTIONS}


def test_validation_does_not_mutate_defaults_between_calls():
    first = validate_config(demo_config())
    first["probe"]["prompt"] = "changed"
    second = validate_config(copy.deepcopy(demo_config()))
    assert second["probe"]["prompt"] != "changed"


@pytest.mark.parametrize(
    ("section", "key", "value"),
    [("vllm", "capture_wait_s", ".nan"), ("vllm", "capture_wait_s", ".inf"),
     ("generation", "temperature", ".nan"), ("generation", "temperature", ".inf"),
     ("generation", "top_p", ".nan"), ("hidden", "cache_gb", ".nan"),
     ("hidden", "cache_gb", ".inf")],
)  # fmt: skip
def test_every_number_that_is_not_finite_is_refused_by_key(section, key, value):
    """JSON schema's `minimum` lets NaN through (every comparison with it is false): a wait that
    never ends, a NaN budget read as none, a temperature sent to servers and to vLLM."""
    config = demo_config()
    config[section] = {**config.get(section, {}), key: yaml.safe_load(value)}
    match = rf"config key '{section}.{key}' is -?(nan|inf): give a finite number"
    with pytest.raises(ConfigError, match=match):
        validate_config(config)


def test_a_number_in_a_list_is_checked_too():
    config = demo_config()
    config["train"] = {**config.get("train", {}), "adam_betas": [0.9, float("nan")]}
    with pytest.raises(ConfigError, match=r"'train.adam_betas\[1\]' is nan"):
        validate_config(config)


TOO_MANY = "is greater than the maximum of 1000000000"
TOO_MANY_SHARDS = "make 10,000,000 shards; a run has at most 100,000"


@pytest.mark.parametrize(
    ("samples", "size", "match"),
    [
        (10**20, 100, rf"'prompts.max_samples': 100000000000000000000 {TOO_MANY}"),
        (1e20, 100, rf"'prompts.max_samples': 1e\+20 {TOO_MANY}"),
        (
            10**8,
            10,
            rf"'prompts.max_samples' 100,000,000 and 'prompts.shard_size' 10 {TOO_MANY_SHARDS}",
        ),
    ],
)
def test_sizes_past_their_maximum_are_refused_naming_keys_and_limit(samples, size, match):
    """Snakemake lists every shard while it parses: 1e20 prompts exhausted memory first."""
    config = demo_config()
    config["prompts"] = {**config.get("prompts", {}), "max_samples": samples, "shard_size": size}
    with pytest.raises(ConfigError, match=match):
        validate_config(config)


def test_aux_layers_that_repeat_are_refused_before_any_job(tmp_path):
    """vLLM's capture engine dies on the first request of repeated aux layers; the default
    (2, N//2, N-3) repeats one below 7 layers (6 -> 2, 3, 3)."""
    config = demo_config()
    config["demo_target"]["num_layers"] = 6
    validate_config(copy.deepcopy(config))  # transformers' capture: any layers
    config["hidden"] = {"backend": "vllm"}
    with pytest.raises(ConfigError, match=r"default \(2, N//2, N-3\) for the target's 6 layers: "
                                          r"\[2, 3, 3\] repeats a layer"):  # fmt: skip
        validate_config(copy.deepcopy(config))
    config["hidden"] = {"backend": "vllm", "aux_layer_ids": [1, 2, 3]}
    validate_config(copy.deepcopy(config))
    config["demo_target"]["num_layers"] = 7
    config["hidden"] = {"aux_layer_ids": [1, 4, 4]}
    config["evaluate"] = {"engine": "vllm"}
    with pytest.raises(ConfigError, match=r"'hidden.aux_layer_ids' is set: \[1, 4, 4\] repeats"):
        validate_config(copy.deepcopy(config))
    # A target on disk: its config.json (a multimodal one's text_config) tells its layers.
    (tmp_path / "config.json").write_text('{"text_config": {"num_hidden_layers": 5}}')
    config = demo_config()
    config["demo_target"]["enabled"] = False
    config["target"]["path"] = str(tmp_path)
    config["hidden"] = {"backend": "vllm"}
    with pytest.raises(ConfigError, match=r"target's 5 layers: \[2, 2, 2\]"):
        validate_config(copy.deepcopy(config))
    config["target"]["path"] = "org/a-hub-id"  # not on disk: the engine's own check later
    validate_config(config)


def test_several_training_nodes_need_slurm_before_any_job(monkeypatch):
    from eaglenest.common.config import check_executor

    config = validate_config(demo_config())
    config["train"]["nodes"] = 4
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    with pytest.raises(ConfigError, match=r"'train.nodes' is 4: .* executor is local"):
        check_executor(config, "local")
    for executor in ("slurm", "slurm-jobstep", "dryrun", None):
        check_executor(config, executor)
    monkeypatch.setenv("SLURM_JOB_ID", "123")  # inside an allocation
    check_executor(config, "local")
    config["train"]["nodes"] = 1
    monkeypatch.delenv("SLURM_JOB_ID")
    check_executor(config, "local")


def test_a_run_name_too_long_for_a_file_name_is_refused_by_the_schema():
    """300 characters passed every check and failed at the first job: "File name too long"."""
    config = demo_config()
    config["run"] = "r" * 300
    with pytest.raises(ConfigError, match=r"config key 'run': 'r+' is too long"):
        validate_config(config)
    config["run"] = "r" * 100
    validate_config(config)


@pytest.mark.parametrize(
    "key",
    ["p_eagle.depths", "p_eagle.num_hidden_layers", "dflash.block_size",
     "dflash.num_hidden_layers", "dflash.max_anchors", "ttt_steps", "sequence.length",
     "max_batch_tokens", "drafter.intermediate_size", "drafter.num_attention_heads",
     "drafter.head_dim"],
)  # fmt: skip
def test_an_absurd_training_size_is_refused_by_the_schema(key: str):
    """1e9 passed every check and failed in the train job."""
    config = demo_config()
    section, name = key.rsplit(".", 1) if "." in key else ("", key)
    train = config.setdefault("train", {})
    (train.setdefault(section, {}) if section else train)[name] = 1_000_000_000
    with pytest.raises(ConfigError, match=rf"config key 'train.{key}': 1000000000 is greater"):
        validate_config(config)
