"""The typed settings of every stage, built from the validated config, and their JSON form.

Each stage's settings are a frozen dataclass (`Settings`) with one `from_config(config)`: the only
place that says which config values the stage runs with. Fields have no defaults: every default
is in config/schema.yaml, filled in by `validate_config`. A rule passes
`Stage.from_config(config).to_json()` as its `settings` param (sorted JSON: a param that changes
only when a value does), and its script hands `Stage.from_json(...)` to the library, so the
object the library runs with is the object Snakemake compares to decide a rerun. What a job needs
but what shapes none of its outputs (how to reach the endpoints, how hard to try) is a second
object, passed as a param that Snakemake does not record (`untracked` in rules/common.smk).

The target (settings/target.py) is one object that every stage's settings hold as their `target`
field, each as a view of the fields its code reads (`TargetSettings.view`): the others are
`NotTracked`, left out of the JSON, and fail when used.

One module per stage, each light to import: the Snakefile builds every rule's params from them
while it parses, and a stage's code version then hashes its own settings, not every stage's.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

if TYPE_CHECKING:
    from typing_extensions import Self


class NotTracked:
    """A field a settings object leaves out (a view's other fields, see TargetSettings.view and
    TrainSettings.of_family): any use of it is an error naming the config key. One instance per
    key, so views compare equal."""

    _instances: typing.ClassVar[dict[str, NotTracked]] = {}

    def __new__(cls, name: str) -> Self:
        if name not in cls._instances:
            instance = super().__new__(cls)
            instance.name = name  # type: ignore[attr-defined]
            cls._instances[name] = instance
        return cls._instances[name]  # type: ignore[return-value]

    def __getnewargs__(self) -> tuple[str]:
        return (self.name,)

    def _fail(self, *_: Any, **__: Any) -> NoReturn:
        raise AttributeError(
            f"{self.name} is not among the fields this job's settings track: add it to their "
            "view in src/eaglenest/settings/ (TargetSettings.view, TrainSettings.of_family): a "
            "change of it must rerun the job"
        )

    __bool__ = __str__ = __fspath__ = __iter__ = __len__ = __getitem__ = __eq__ = _fail
    __hash__ = __getattr__ = _fail  # type: ignore[assignment]
    # Used as a number (range(ttt_steps), step_weight ** i): the same error, not a TypeError.
    __index__ = __int__ = __float__ = __lt__ = __le__ = __gt__ = __ge__ = _fail
    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = _fail
    __truediv__ = __rtruediv__ = __pow__ = __rpow__ = _fail

    def __repr__(self) -> str:
        return f"NotTracked({self.name!r})"

    def __deepcopy__(self, memo: dict) -> NotTracked:
        return self


def _tracked_items(items: list[tuple[str, Any]]) -> dict[str, Any]:
    return {k: v for k, v in items if not isinstance(v, NotTracked)}


class Settings:
    """Base of the stages' settings dataclasses: construction from config, JSON both ways."""

    # Whether from_dict may leave fields out (a view): they become NotTracked.
    PARTIAL = False
    # The config section of the fields (NotTracked names the key: "target.path").
    SECTION = ""
    # Fields added after runs were made -> the value at which they are left out of the JSON (and
    # filled back by from_dict): the value that does what the runs did, so they rerun nothing.
    LEFT_OUT_AT: typing.ClassVar[Mapping[str, Any]] = types.MappingProxyType({})

    @classmethod
    def not_tracked(cls, name: str) -> NotTracked:
        """The field `name` left out of a view."""
        return NotTracked(f"{cls.SECTION}.{name}" if cls.SECTION else name)

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> Self:
        """The settings of a validated config (defaults filled in by config/schema.yaml)."""
        raise NotImplementedError

    def with_target_path(self, path: str | Path) -> Self:
        """These settings with their target (a TargetSettings field) at `path`: for tools that
        run a stage over a finished run's files."""
        target = dataclasses.replace(self.target, path=str(path))  # type: ignore[attr-defined]
        return dataclasses.replace(self, target=target)  # type: ignore[type-var]

    def to_json(self) -> str:
        values = dataclasses.asdict(self, dict_factory=_tracked_items)
        left_out = [
            k for k, v in self.LEFT_OUT_AT.items() if _json_form(values.get(k, v)) == _json_form(v)
        ]
        return json.dumps({k: v for k, v in values.items() if k not in left_out}, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Self:
        return cls.from_dict(json.loads(text))

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> Self:
        """From `dataclasses.asdict` of these settings, or its JSON parsed: nested settings and
        tuples (lists in JSON) come back as they were."""
        hints = typing.get_type_hints(cls)
        fields = dataclasses.fields(cls)  # type: ignore[arg-type]
        values = {**cls.LEFT_OUT_AT, **values}
        if cls.PARTIAL:
            values = {f.name: cls.not_tracked(f.name) for f in fields} | dict(values)
        return cls(**{f.name: _revived(hints[f.name], values[f.name]) for f in fields})


def _json_form(value: Any) -> Any:
    """A value as JSON holds it (a tuple as a list)."""
    return list(value) if isinstance(value, tuple) else value


def _revived(hint: Any, value: Any) -> Any:
    if value is None or isinstance(value, NotTracked):
        return value
    union = typing.get_origin(hint) in (typing.Union, types.UnionType)
    for option in typing.get_args(hint) if union else (hint,):
        if isinstance(option, type) and issubclass(option, Settings) and isinstance(value, dict):
            return option.from_dict(value)
        if typing.get_origin(option) is tuple and isinstance(value, list):
            return tuple(value)
    return value
