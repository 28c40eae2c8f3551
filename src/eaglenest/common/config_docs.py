"""config/README.md from config/schema.yaml: every key (dotted path), its type, default and
description, grouped by top-level section, so the key reference cannot drift from the schema.

    eaglenest config-docs > config/README.md
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from eaglenest.common.config import DEFAULT_SCHEMA

REGENERATE = "eaglenest config-docs > config/README.md"
# Constraints shown beside the type, in the order they are written.
BOUNDS = {
    "minimum": ">=",
    "exclusiveMinimum": ">",
    "maximum": "<=",
    "exclusiveMaximum": "<",
    "minLength": "length >=",
    "minItems": "items >=",
    "maxItems": "items <=",
}


@dataclass(frozen=True)
class KeyDoc:
    """One config key: its dotted path (`[]` for an item of a list), type, default, description."""

    path: str
    type: str
    default: str
    description: str


def _type_of(schema: dict[str, Any]) -> str:
    kinds = schema.get("type", "any")
    text = " | ".join(kinds) if isinstance(kinds, list) else str(kinds)
    if "items" in schema and "type" in schema["items"]:
        text += f" of {_type_of(schema['items'])}"
    if "enum" in schema:
        text += ": " + ", ".join(f"`{json.dumps(value)}`" for value in schema["enum"])
    bounds = [f"{sign} {schema[name]}" for name, sign in BOUNDS.items() if name in schema]
    if "pattern" in schema:
        bounds.append(f"matching `{schema['pattern']}`")
    return text + (f" ({', '.join(bounds)})" if bounds else "")


def _default_of(schema: dict[str, Any], required: bool) -> str:
    if "default" not in schema:
        return "required" if required else ""
    return f"`{json.dumps(schema['default'])}`"


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _children(schema: dict[str, Any]) -> tuple[str, dict[str, Any]] | None:
    """The keys below a key: an object's properties, or those of a list's object items."""
    if "properties" in schema:
        return "", schema
    items = schema.get("items")
    if isinstance(items, dict) and "properties" in items:
        return "[]", items
    return None


def schema_keys(schema: dict[str, Any], prefix: str = "") -> list[KeyDoc]:
    """Every key below `schema` in schema order, depth first, each nested key after its parent."""
    found = _children(schema)
    if found is None:
        return []
    suffix, parent = found
    required = set(parent.get("required", []))
    keys = []
    for name, sub in parent["properties"].items():
        path = f"{prefix}{suffix}.{name}" if prefix else name
        default = _default_of(sub, name in required)
        description = _cell(sub.get("description", ""))
        keys.append(KeyDoc(path, _cell(_type_of(sub)), default, description))
        keys.extend(schema_keys(sub, path))
    return keys


def _table(keys: list[KeyDoc]) -> list[str]:
    lines = ["| key | type | default | description |", "|---|---|---|---|"]
    lines += [f"| `{k.path}` | {k.type} | {k.default} | {k.description} |" for k in keys]
    return lines


def render_config_docs(schema: dict[str, Any], source: str = "config/schema.yaml") -> str:
    """The Markdown reference of `schema`: top-level scalar keys first, then one section per
    top-level object or list, each with its description and a table of all its keys."""
    lines = [
        "# Configuration keys",
        "",
        f"Generated from `{source}` by `{REGENERATE}`; do not edit by hand",
        "(`tests/house/test_config_docs.py` fails when this file is not what the schema makes).",
        "",
    ]
    if schema.get("description"):
        lines += [_cell(schema["description"]), ""]
    keys = schema_keys(schema)
    sections = [k for k in keys if "." not in k.path and _children(schema["properties"][k.path])]
    top = [k for k in keys if "." not in k.path and k not in sections]
    if top:
        lines += ["## Top level", "", *_table(top), ""]
    for section in sections:
        lines += [f"## `{section.path}`", ""]
        if section.description:
            lines += [section.description, ""]
        members = [k for k in keys if k.path.startswith((section.path + ".", section.path + "[]"))]
        lines += [*_table(members), ""]
    return "\n".join(lines)


def load_schema(path: str | Path = DEFAULT_SCHEMA) -> dict[str, Any]:
    return yaml.safe_load(Path(path).read_text())


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = f"print config/README.md for a schema ({REGENERATE})"
    parser.add_argument("--schema", default=str(DEFAULT_SCHEMA), help="the JSON schema (YAML)")


def run(args: argparse.Namespace) -> int:
    print(render_config_docs(load_schema(args.schema)), end="")
    return 0
