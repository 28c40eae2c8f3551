"""The typed settings of every stage, built from the validated config, and their JSON form.

Each stage's settings are a frozen dataclass (`Settings`) with one `from_config(config)`: the only
place that says which config values the stage runs with. Fields have no defaults: every default
is in config/schema.yaml, filled in by `validate_config`. A rule passes
`Stage.from_config(config).to_json()` as its `settings` param (sorted JSON: a param that changes
only when a value does), and its script hands `Stage.from_json(...)` to the library, so the
object the library runs with is the object Snakemake compares to decide a rerun. What a job needs
but what shapes none of its outputs (how to reach the endpoints, how hard to try) is a second
object, passed as a param that Snakemake does not record (`untracked` in rules/common.smk).

One module per stage, each light to import: the Snakefile builds every rule's params from them
while it parses, and a stage's code version then hashes its own settings, not every stage's.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from typing_extensions import Self


class Settings:
    """Base of the stages' settings dataclasses: construction from config, JSON both ways."""

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> Self:
        """The settings of a validated config (defaults filled in by config/schema.yaml)."""
        raise NotImplementedError

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Self:
        return cls.from_dict(json.loads(text))

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> Self:
        """From `dataclasses.asdict` of these settings, or its JSON parsed: nested settings and
        tuples (lists in JSON) come back as they were."""
        hints = typing.get_type_hints(cls)
        fields = dataclasses.fields(cls)  # type: ignore[arg-type]
        return cls(**{f.name: _revived(hints[f.name], values[f.name]) for f in fields})


def _revived(hint: Any, value: Any) -> Any:
    if value is None:
        return None
    union = typing.get_origin(hint) in (typing.Union, types.UnionType)
    for option in typing.get_args(hint) if union else (hint,):
        if isinstance(option, type) and issubclass(option, Settings) and isinstance(value, dict):
            return option.from_dict(value)
        if typing.get_origin(option) is tuple and isinstance(value, list):
            return tuple(value)
    return value
