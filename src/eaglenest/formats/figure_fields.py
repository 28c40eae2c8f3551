"""The machinery of the figure files' records (train_report.py, metrics.py): a typed field of a
JSON object, the checks of its kind, and reading and writing a record as that object.

A record is a frozen dataclass whose fields are declared with `typed(kind)`: what the report
reads, checked against its kind when read (a `FigureFileError` naming the file and the key).
Every other key of the object is kept verbatim in the record's `more`, and which typed keys were
null or absent in the file is remembered, so a record read and written again is the object it
was read from, key for key. A record the stage builds writes its typed keys when they hold a
value, and those of its class's `ALWAYS` (written as null when None) in every case.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, TypeVar


class FigureFileError(ValueError):
    """A figure file is malformed; the message names the file and what is wrong (the report's
    `ReportInputError`)."""


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_number_list(value: Any) -> bool:
    return isinstance(value, list) and all(_is_number(v) for v in value)


# kind -> (its check, how an error names it)
CHECKS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "number": (_is_number, "a number"),
    "int": (lambda v: isinstance(v, int) and not isinstance(v, bool), "an integer"),
    "numbers": (_is_number_list, "a list of numbers"),
    "str": (lambda v: isinstance(v, str), "a string"),
    "strs": (lambda v: isinstance(v, list) and all(isinstance(s, str) for s in v), "strings"),
    "bool": (lambda v: isinstance(v, bool), "true or false"),
    "object": (lambda v: isinstance(v, dict), "an object"),
    "any": (lambda v: True, "anything"),
}


def check_fields(
    data: Any, where: str, required: dict[str, str], optional: dict[str, str] | None = None
) -> None:
    """Raise FigureFileError unless `data` has the required keys with the right kinds (and the
    optional ones, when present and not null, too)."""
    if not isinstance(data, dict):
        raise FigureFileError(f"{where}: expected a JSON object, got {type(data).__name__}")
    for key, kind in {**required, **(optional or {})}.items():
        if key not in data or data[key] is None:
            if key in required:
                raise FigureFileError(f"{where}: missing {key!r} ({CHECKS[kind][1]})")
            continue
        check, description = CHECKS[kind]
        if not check(data[key]):
            shown = json.dumps(data[key])[:80]
            raise FigureFileError(f"{where}: {key!r} must be {description}, got {shown}")


def read_json_object(path: str | Path) -> dict[str, Any]:
    """A file's JSON object; a FigureFileError naming the file when it is none."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise FigureFileError(f"{path}: not readable as JSON ({err})") from err
    if not isinstance(data, dict):
        raise FigureFileError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


# ---------------------------------------------------------------------------------------------
# Typed fields and records
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Nested:
    """How a typed field's JSON value becomes its Python value and back (a record, a map of
    records...): `load(value, where)`, `dump(value)`."""

    load: Callable[[Any, str], Any]
    dump: Callable[[Any], Any]


def typed(kind: str, *, required: bool = False, nested: Nested | None = None) -> Any:
    """A record's field for the JSON key of its name, of `kind` (CHECKS); a required one has no
    default, an optional one None."""
    metadata = {"kind": kind, "required": required, "nested": nested}
    if required:
        return field(metadata=metadata)
    return field(default=None, metadata=metadata)


def _typed_fields(cls: type) -> list[tuple[dataclasses.Field, str]]:
    return [(f, f.name) for f in dataclasses.fields(cls) if "kind" in f.metadata]


R = TypeVar("R")


def record_from_json(cls: type[R], data: Any, where: str) -> R:
    """`data` (a JSON object) as a `cls` record, every typed key checked: a FigureFileError
    at `where` names what is wrong. A nested value's errors name its place (`where key` at a
    file's top level, `where.key` below)."""
    required = {key: f.metadata["kind"] for f, key in _typed_fields(cls) if f.metadata["required"]}
    optional = {key: f.metadata["kind"] for f, key in _typed_fields(cls) if key not in required}
    check_fields(data, where, required, optional)
    values: dict[str, Any] = {}
    nulls, absent = set(), set()
    for f, key in _typed_fields(cls):
        if key not in data:
            absent.add(key)
            continue
        value = data[key]
        if value is None:
            nulls.add(key)
        elif f.metadata["nested"] is not None:
            joined = f"{where} {key}" if cls.TOP else f"{where}.{key}"
            value = f.metadata["nested"].load(value, joined)
        values[f.name] = value
    keys = {key for _, key in _typed_fields(cls)}
    more = {key: value for key, value in data.items() if key not in keys}
    return cls(**values, more=more, nulls=frozenset(nulls), absent=frozenset(absent))


def record_to_json(record: Any) -> dict[str, Any]:
    """The record as its JSON object (record_from_json's inverse)."""
    always = record.ALWAYS
    data = dict(record.more)
    for f, key in _typed_fields(type(record)):
        value = getattr(record, f.name)
        if value is None:
            if key in record.nulls or (key in always and key not in record.absent):
                data[key] = None
            continue
        nested = f.metadata["nested"]
        data[key] = nested.dump(value) if nested is not None else value
    return data


@dataclass(frozen=True, kw_only=True)
class Record:
    """What every figure record has: its untyped keys verbatim (`more`), the typed keys the file
    held as null or left out (`nulls`, `absent`: an exact round trip), `from_json(data, where)`
    and `to_json()`. Subclasses are frozen dataclasses of `typed` fields."""

    ALWAYS: ClassVar[frozenset[str]] = frozenset()
    TOP: ClassVar[bool] = False  # a file's top level: its keys' errors read `where key`

    more: dict[str, Any] = field(default_factory=dict)
    nulls: frozenset[str] = field(default=frozenset(), repr=False, compare=False)
    absent: frozenset[str] = field(default=frozenset(), repr=False, compare=False)

    @classmethod
    def from_json(cls, data: Any, where: str = "figures") -> Any:
        return record_from_json(cls, data, where)

    def to_json(self) -> dict[str, Any]:
        return record_to_json(self)


def record_of(cls: type | Callable[[], type]) -> Nested:
    """A nested record (a JSON object); `cls` may be a function returning the record's class
    (a record nested in its own class)."""

    def load(value: Any, where: str) -> Any:
        record = cls if isinstance(cls, type) else cls()
        return record.from_json(value, where)

    return Nested(load, lambda value: value.to_json())


def records_by_key(cls: type) -> Nested:
    """A JSON object of records by key (K, name, depth): errors name `where[key]`."""

    def load(value: dict[str, Any], where: str) -> dict[str, Any]:
        return {key: cls.from_json(each, f"{where}[{key}]") for key, each in value.items()}

    return Nested(load, lambda value: {key: each.to_json() for key, each in value.items()})


def nested_by_key(inner: Nested) -> Nested:
    """A JSON object of `inner` values by key (a name's records by K)."""

    def load(value: dict[str, Any], where: str) -> dict[str, Any]:
        out = {}
        for key, each in value.items():
            check_fields(each, f"{where}[{key}]", {})
            out[key] = inner.load(each, f"{where}[{key}]")
        return out

    return Nested(load, lambda value: {key: inner.dump(each) for key, each in value.items()})
