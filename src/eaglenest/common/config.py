"""Config loading and validation against config/schema.yaml (JSON schema with defaults).

The Snakefile and the CLI both go through `validate_config`, so a misspelled key or a wrong type
fails the same way everywhere: with the dotted key in the message.
"""

from __future__ import annotations

import copy
import difflib
import functools
import json
import math
import os
from pathlib import Path
from typing import Any, TypeVar

import jsonschema
import yaml

# ConfigError has its home beside the file reader; importers keep finding it here.
from eaglenest.common.config_file import ConfigError, check_shape, read_config_file

REPO_ROOT = Path(__file__).resolve().parents[3]
DEFAULT_SCHEMA = REPO_ROOT / "config" / "schema.yaml"
SettingsT = TypeVar("SettingsT")


def _with_defaults(validator_class):
    validate_properties = validator_class.VALIDATORS["properties"]

    def set_defaults(validator, properties, instance, schema):
        if isinstance(instance, dict):
            for name, subschema in properties.items():
                if "default" in subschema and name not in instance:
                    instance[name] = copy.deepcopy(subschema["default"])
        yield from validate_properties(validator, properties, instance, schema)

    return jsonschema.validators.extend(validator_class, {"properties": set_defaults})


DefaultingValidator = _with_defaults(jsonschema.Draft7Validator)


def _key_path(error: jsonschema.ValidationError) -> str:
    parts = [str(p) for p in error.absolute_path]
    return ".".join(parts) if parts else "<top level>"


def _describe(error: jsonschema.ValidationError) -> str:
    where = _key_path(error)
    if error.validator == "additionalProperties":
        allowed = sorted(error.schema.get("properties", {}))
        unknown = sorted(set(error.instance) - set(allowed))
        hints = []
        for key in unknown:
            close = difflib.get_close_matches(key, allowed, n=1)
            full = f"{where}.{key}" if where != "<top level>" else key
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            hints.append(f"unknown config key '{full}'{hint}")
        return "; ".join(hints) + f"; allowed here: {', '.join(allowed)}"
    if error.validator == "type":
        return (
            f"config key '{where}' must be of type {error.validator_value}, "
            f"got {type(error.instance).__name__} {error.instance!r}"
        )
    if error.validator == "required":
        return f"config section '{where}' is missing a required key: {error.message}"
    return f"config key '{where}': {error.message}"


@functools.lru_cache(maxsize=8)
def _validator(schema_text: str) -> jsonschema.protocols.Validator:
    # Parsing the schema is the slow part, and the workflow validates the prompts section once
    # per shard (bench/dag.py); keyed by the text, so an edited schema is reparsed. libyaml's
    # loader where PyYAML has it: 15 ms instead of 130 ms of every snakemake command here.
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    return DefaultingValidator(yaml.load(schema_text, Loader=loader))


def validate_config(config: dict[str, Any], schema_path: str | Path = DEFAULT_SCHEMA) -> dict:
    """Validate `config` in place, filling defaults; raise ConfigError naming every bad key.
    What depends on where the jobs run is checked once Snakemake knows (`check_executor`), the
    vLLM interpreter when the workflow reads the config (common/vllm_python.py)."""
    validator = _validator(Path(schema_path).read_text())
    try:
        # Before the schema and the finite-number check walk it, both recursively and each
        # value as often as an alias repeats it.
        check_shape(config)
        # Before the schema: an infinite number past a key's maximum is said as not finite.
        check_finite(config)
    except ValueError as err:
        raise ConfigError(f"invalid config ({schema_path}): {err}") from None
    errors = sorted(validator.iter_errors(config), key=lambda e: list(e.absolute_path))
    if errors:
        lines = "\n  ".join(_describe(e) for e in errors)
        raise ConfigError(f"invalid config ({schema_path}):\n  {lines}")
    from eaglenest.settings.eval_sets import check_eval_sets
    from eaglenest.settings.evaluate import check_compare
    from eaglenest.settings.hidden_states import check_store
    from eaglenest.settings.prompts import check_shard_count
    from eaglenest.settings.report import check_report_device
    from eaglenest.settings.train import check_families, check_sequence, drafter_window
    from eaglenest.settings.urls import check_config_urls

    try:
        check_config_urls(config)
        drafter_window((config.get("train") or {}).get("drafter") or {})
        check_families(config.get("train") or {})
        check_sequence(config.get("train") or {})
        check_store(config)
        check_shard_count(config)
        check_aux_layers(config)
        check_eval_sets(config)
        check_compare(config)
        check_report_device(config)
    except ValueError as err:
        raise ConfigError(f"invalid config ({schema_path}): {err}") from None
    return config


def check_finite(config: Any, where: str = "") -> None:
    """Every number of the config finite: JSON schema's `minimum` lets NaN through (every
    comparison with it is false), so `.nan` or `.inf` would pass any key the schema bounds: a
    wait that never ends, a cache of NaN GB read as no budget, a temperature sent to a server."""
    if isinstance(config, dict):
        for key, value in config.items():
            check_finite(value, f"{where}.{key}" if where else str(key))
    elif isinstance(config, list):
        for i, value in enumerate(config):
            check_finite(value, f"{where}[{i}]")
    elif isinstance(config, float) and not math.isfinite(config):
        raise ValueError(f"config key '{where}' is {config}: give a finite number")


def target_layers(config: dict[str, Any]) -> int | None:
    """The target's decoder layers, where the config tells them without loading anything: the
    demo's section, else a local target's config.json (its text_config's, for a multimodal one);
    None when neither is at hand (a hub id, a target not built yet)."""
    if (config.get("demo_target") or {}).get("enabled"):
        return (config.get("demo_target") or {}).get("num_layers")
    path = (config.get("target") or {}).get("path")
    if not path or not (Path(path) / "config.json").is_file():
        return None
    try:
        model = json.loads((Path(path) / "config.json").read_text())
    except ValueError:
        return None
    layers = (model.get("text_config") or model).get("num_hidden_layers")
    return layers if isinstance(layers, int) else None


def check_aux_layers(config: dict[str, Any]) -> None:
    """The captured layers (hidden.aux_layer_ids, else the union of train.families' defaults)
    and each family's subset of them (train.aux_layer_ids), checked before any job where the
    target's layers are known: each below N, a family's layer among the captured ones. Where
    vLLM runs (hidden.backend or evaluate.engine vllm) distinct: its engine dies on the first
    request of a capture whose layers repeat ("expanded size (4) must match (3)"), and vLLM's
    default (2, N//2, N-3) repeats one below 7 layers."""
    hidden, train = config.get("hidden") or {}, config.get("train") or {}
    families = train.get("families") or ["eagle3"]
    chosen, layers = hidden.get("aux_layer_ids"), target_layers(config)
    if chosen is None and layers is None:
        return
    from eaglenest.settings.families import (
        captured_layer_ids,
        check_captured,
        family_layer_ids,
        layer_rules,
    )

    rules = layer_rules(families, train.get("aux_layer_ids"))
    captured = captured_layer_ids(chosen, rules, layers)
    if chosen is not None:
        where = "set"
    elif rules == ("vllm",):
        where = f"null, so vLLM's default (2, N//2, N-3) for the target's {layers} layers"
    else:
        where = (
            f"null, so train.families {list(families)}' defaults for the target's {layers} layers"
        )
    if layers is not None and not all(i < layers for i in captured):
        raise ValueError(
            f"config key 'hidden.aux_layer_ids' is {where}: {list(captured)} names a layer past "
            f"the target's {layers} (ids 0 to {layers - 1})"
        )
    for family in families:
        subset = (train.get("aux_layer_ids") or {}).get(family)
        if layers is not None:
            family_layer_ids(family, subset, captured, layers)
        elif subset is not None:
            check_captured(family, subset, captured)
    engine = (config.get("evaluate") or {}).get("engine")
    if hidden.get("backend") != "vllm" and engine != "vllm":
        return  # transformers' hooks take any layers; the crash is vLLM's
    if len(set(captured)) != len(captured):
        raise ValueError(
            f"config key 'hidden.aux_layer_ids' is {where}: {list(captured)} repeats a layer, on "
            "which vLLM's capture engine dies; give distinct layer ids"
        )


def check_executor(config: dict[str, Any], executor: str | None) -> None:
    """What the config asks of the executor that runs its jobs (Snakemake's executor plugin's
    name, known only when the run starts: rules/common.smk's onstart, before any job): `train.nodes
    > 1` runs under SLURM only (stages/train/distributed.py); a local run stopped at its train
    job, after every stage before it. Inside a SLURM allocation SLURM_JOB_ID is set."""
    nodes = (config.get("train") or {}).get("nodes", 1)
    if executor is None or nodes <= 1 or executor in ("dryrun", "touch"):  # no job runs
        return
    if executor.startswith("slurm") or "SLURM_JOB_ID" in os.environ:
        return
    raise ConfigError(
        f"config key 'train.nodes' is {nodes}: training over several nodes runs under SLURM "
        f"(`--profile profiles/slurm`), and this run's executor is {executor}; set train.nodes 1"
    )


def settings_from_sections(settings_class: type[SettingsT], **sections: Any) -> SettingsT:
    """A stage's settings (eaglenest.settings) for a config of only these sections, validated:
    every other value is the schema's default. For tests and tools that run a stage outside the
    workflow."""
    return settings_class.from_config(validate_config(copy.deepcopy(sections)))


def merged_config(paths: list[str]) -> dict[str, Any]:
    """The config Snakemake runs with for `--configfile paths...`: each file updates the one
    before it section by section, then the schema's defaults; the demo's target is built at
    results/{run}/target (rules/common.smk). For commands run beside the workflow
    (`serve-capture`, `plan`)."""
    config: dict[str, Any] = {}
    for path in paths:
        update = read_config_file(path)
        for key, value in update.items():
            if isinstance(value, dict) and isinstance(config.get(key), dict):
                config[key] = _updated(config[key], value)
            else:
                config[key] = value
    validate_config(config)
    if config["demo_target"]["enabled"] and not config["target"]["path"]:
        config["target"]["path"] = f"results/{config['run']}/target"
    return config


def _updated(base: dict, update: dict) -> dict:
    out = dict(base)
    for key, value in update.items():
        both = isinstance(value, dict) and isinstance(out.get(key), dict)
        out[key] = _updated(out[key], value) if both else value
    return out
