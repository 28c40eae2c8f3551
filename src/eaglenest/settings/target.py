"""The `target` section, one object for every stage: which model, where its files are, how they
load, how its chat template is asked and what its think tokens are.

Each stage's settings hold it as their `target` field, as a view of the fields that stage's code
reads (`view`), so a change of another field reruns nothing there: a new served name does not
re-extract the target head. The other fields of a view are `NotTracked` (eaglenest.settings):
left out of the JSON a rule compares, and an error when used, so code that starts reading a field
its stage does not track fails in the tests instead of silently never rerunning.
tests/unit/settings/test_settings.py checks the other direction: a field a rule tracks but whose code never
reads it fails there.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

from eaglenest.settings import Settings


@dataclass(frozen=True)
class TargetSettings(Settings):
    PARTIAL = True
    SECTION = "target"

    model: str  # the served name: what requests ask for
    path: str | None  # local directory or hub name of the weights (None: served only)
    tokenizer: str | None  # else path's
    trust_remote_code: bool
    chat_template_kwargs: dict[str, Any]  # e.g. {"thinking": true}, in every request and render
    think_tokens: dict[str, Any]  # start, end, start_id, end_id
    reasoning_parser: str | None  # the server's --reasoning-parser, when the config names it

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> TargetSettings:
        target = config["target"]
        values = {f.name: target[f.name] for f in fields(cls)}
        return cls(**{**values, "think_tokens": dict(values["think_tokens"])})

    @classmethod
    def view(cls, config: Mapping[str, Any], *names: str) -> TargetSettings:
        """The target of a validated config with only the named fields; the others NotTracked."""
        unknown = sorted(set(names) - {f.name for f in fields(cls)})
        if unknown:
            raise ValueError(f"TargetSettings has no fields {unknown}")
        whole = cls.from_config(config)
        return replace(
            whole, **{f.name: cls.not_tracked(f.name) for f in fields(cls) if f.name not in names}
        )
