"""Reading an evaluation set's local file into records, each with where it stands in the file (a
JSON Lines line, from 1; a parquet row, from 0), so every refusal can name it. Nothing is
interpreted here (see formats.py)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class EvalSetError(ValueError):
    """An evaluation set cannot be used as it is; the message names the file, row and field."""


@dataclass(frozen=True)
class Record:
    """One row of a set's file, as read."""

    source_row: int  # JSON Lines: the line (from 1); parquet: the row (from 0)
    where: str  # "line 3" or "row 2", for messages
    values: Any  # the row: a dict, or whatever a JSON line held


def read_records(path: str | Path) -> tuple[list[Record], list[str]]:
    """The rows of a .jsonl or .parquet file and its columns (a JSON Lines file's: the keys of
    its first object row). A line that is not JSON is refused, naming it."""
    path = Path(path)
    if path.suffix.lower() == ".parquet":
        return _parquet_records(path)
    if path.suffix.lower() == ".jsonl":
        records = _jsonl_records(path)
        first = next((r.values for r in records if isinstance(r.values, dict)), {})
        return records, list(first)
    raise EvalSetError(f"{path}: not a .jsonl or .parquet file")


def _parquet_records(path: Path) -> tuple[list[Record], list[str]]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as err:  # pyarrow raises several types; the user needs the file name
        raise EvalSetError(f"{path}: cannot read parquet: {err}") from err
    rows = table.to_pylist()
    return [Record(i, f"row {i}", row) for i, row in enumerate(rows)], table.column_names


def _jsonl_records(path: Path) -> list[Record]:
    records = []
    with open(path, "rb") as stream:
        for number, raw in enumerate(stream, start=1):
            if not raw.strip():
                continue  # a blank line (often the last) is not a row
            try:
                values = json.loads(raw.decode("utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError) as err:
                raise EvalSetError(f"{path}: line {number}: not a JSON object: {err}") from None
            records.append(Record(number, f"line {number}", values))
    return records
