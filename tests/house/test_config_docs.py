"""config/README.md is what `eaglenest config-docs` makes from config/schema.yaml, and the
generator lists every key of a schema, described or not."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from eaglenest.common.config_docs import (
    REGENERATE,
    load_schema,
    render_config_docs,
    schema_keys,
)

REPO = Path(__file__).resolve().parents[2]
CONFIG_README = REPO / "config" / "README.md"

TINY = {
    "description": "a tiny config",
    "type": "object",
    "properties": {
        "run": {"type": "string", "default": "demo", "description": "name of the run"},
        "server": {
            "type": "object",
            "default": {},
            "description": "the server",
            "properties": {
                "dialect": {"type": "string", "enum": ["vllm", "sglang"], "default": "vllm"},
                "faults": {
                    "type": "object",
                    "default": {},
                    "properties": {
                        "hang": {"type": "number", "minimum": 0, "maximum": 1, "default": 0}
                    },
                },
            },
        },
        "endpoints": {
            "type": "array",
            "default": [],
            "items": {
                "type": "object",
                "required": ["url"],
                "properties": {
                    "url": {"type": "string", "description": "base URL | with or without /v1"},
                    "api_key_env": {"type": ["string", "null"], "default": None},
                },
            },
        },
    },
}


def test_config_readme_is_what_the_schema_makes():
    expected = render_config_docs(load_schema())
    assert CONFIG_README.exists(), f"config/README.md is missing; regenerate it: {REGENERATE}"
    assert CONFIG_README.read_text() == expected, (
        f"config/README.md is not what config/schema.yaml makes; regenerate it: {REGENERATE}"
    )


def test_every_schema_key_is_in_the_config_readme():
    text = CONFIG_README.read_text()
    for key in schema_keys(load_schema()):
        assert f"`{key.path}`" in text, key.path


def test_the_command_prints_what_the_library_renders():
    printed = subprocess.run(
        [sys.executable, "-m", "eaglenest.cli", "config-docs"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert printed == render_config_docs(load_schema())


def test_a_tiny_schema_lists_every_key_with_its_type_default_and_description():
    keys = {key.path: key for key in schema_keys(TINY)}
    assert list(keys) == [
        "run",
        "server",
        "server.dialect",
        "server.faults",
        "server.faults.hang",
        "endpoints",
        "endpoints[].url",
        "endpoints[].api_key_env",
    ]
    assert keys["run"].default == '`"demo"`' and keys["run"].description == "name of the run"
    assert keys["server.dialect"].type == 'string: `"vllm"`, `"sglang"`'
    assert keys["server.faults.hang"].type == "number (>= 0, <= 1)"
    assert keys["endpoints[].url"].default == "required"
    assert keys["endpoints[].url"].description == "base URL \\| with or without /v1"
    assert keys["endpoints[].api_key_env"].type == "string \\| null"
    assert keys["endpoints[].api_key_env"].default == "`null`"
    assert [path for path, key in keys.items() if not key.description] == [
        "server.dialect",
        "server.faults",
        "server.faults.hang",
        "endpoints",
        "endpoints[].api_key_env",
    ]


def test_a_tiny_schema_renders_one_section_per_top_level_object_or_list():
    text = render_config_docs(TINY)
    headings = [line for line in text.splitlines() if line.startswith("## ")]
    assert headings == ["## Top level", "## `server`", "## `endpoints`"]
    assert "a tiny config" in text and "the server" in text
    assert "| `server.faults.hang` | number (>= 0, <= 1) | `0` |  |" in text
    assert '| `run` | string | `"demo"` | name of the run |' in text
    assert REGENERATE in text
