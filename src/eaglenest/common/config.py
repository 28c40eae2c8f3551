"""Config loading and validation against config/schema.yaml (JSON schema with defaults).

The Snakefile and the CLI both go through `validate_config`, so a misspelled key or a wrong type
fails the same way everywhere: with the dotted key in the message.
"""

from __future__ import annotations

import copy
import difflib
import functools
from pathlib import Path
from typing import Any, TypeVar

import jsonschema
import yaml

REPO_ROOT = Path(__file__).resolve().parents[3]
DEFAULT_SCHEMA = REPO_ROOT / "config" / "schema.yaml"
SettingsT = TypeVar("SettingsT")


class ConfigError(ValueError):
    """A config value is missing, unknown or of the wrong type; the message names the key."""


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
    # Parsing the schema is the slow part (~30 ms), and the workflow validates the prompts
    # section once per shard (bench/dag.py); keyed by the text, so an edited schema is reparsed.
    return DefaultingValidator(yaml.safe_load(schema_text))


def validate_config(config: dict[str, Any], schema_path: str | Path = DEFAULT_SCHEMA) -> dict:
    """Validate `config` in place, filling defaults; raise ConfigError naming every bad key."""
    validator = _validator(Path(schema_path).read_text())
    errors = sorted(validator.iter_errors(config), key=lambda e: list(e.absolute_path))
    if errors:
        lines = "\n  ".join(_describe(e) for e in errors)
        raise ConfigError(f"invalid config ({schema_path}):\n  {lines}")
    from eaglenest.settings.hidden_states import check_store
    from eaglenest.settings.train import check_families, drafter_window
    from eaglenest.settings.urls import check_distinct

    try:
        check_distinct([e["url"] for e in config.get("endpoints") or []])
        drafter_window((config.get("train") or {}).get("drafter") or {})
        check_families(config.get("train") or {})
        check_store(config)
    except ValueError as err:
        raise ConfigError(f"invalid config ({schema_path}): {err}") from None
    return config


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
        update = yaml.safe_load(Path(path).read_text()) or {}
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
