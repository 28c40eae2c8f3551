"""Reading an evaluation set's local file into records, each with where it stands in the file (a
JSON Lines line, from 1; a parquet row, from 0), so every refusal can name it. Nothing is
interpreted here (see formats.py)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# The most a set may hold: standard sets have hundreds to a few thousand rows of a few KB; a
# prompt longer than the target's context is refused later, by the target's own count.
MAX_ROWS = 100_000
MAX_LINE_BYTES = 4 << 20
ROWS_PER_BATCH = 256  # parquet rows read at a time, each checked before the next batch


class EvalSetError(ValueError):
    """An evaluation set cannot be used as it is; the message names the file, row and field."""


@dataclass(frozen=True)
class SetFileRow:
    """One row of a set's file, as read."""

    source_row: int  # JSON Lines: the line (from 1); parquet: the row (from 0)
    where: str  # "line 3" or "row 2", for messages
    values: Any  # the row: a dict, or whatever a JSON line held


def read_records(path: str | Path) -> tuple[list[SetFileRow], list[str]]:
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


def _parquet_records(path: Path) -> tuple[list[SetFileRow], list[str]]:
    import pyarrow.parquet as pq

    try:
        source = pq.ParquetFile(path)
        _check_rows(path, source.metadata.num_rows)
        _check_row_groups(path, source.metadata)
        records, first = [], 0
        # In small batches, each row's size checked as it comes: a set with one 20 MB prompt
        # took 31 s and 4.8 GB before it was refused, loaded whole.
        for batch in source.iter_batches(batch_size=ROWS_PER_BATCH):
            for i, row in enumerate(batch.to_pylist(), start=first):
                records.append(SetFileRow(i, f"row {i}", row))
                _check_row_bytes(path, records[-1])
            first += batch.num_rows
        columns = source.schema_arrow.names
    except EvalSetError:
        raise
    except Exception as err:  # pyarrow raises several types; the user needs the file name
        raise EvalSetError(f"{path}: cannot read parquet: {err}") from err
    for record in records:
        _check_text(path, record)
    return records, columns


def _check_row_groups(path: Path, metadata) -> None:
    """From the footer alone: a row group holding more than MAX_LINE_BYTES per row has a row
    past the bound (at least one row is above the mean)."""
    for group in range(metadata.num_row_groups):
        rows = metadata.row_group(group)
        if rows.num_rows and rows.total_byte_size > MAX_LINE_BYTES * rows.num_rows:
            raise EvalSetError(
                f"{path}: row group {group} holds {rows.total_byte_size:,} bytes in "
                f"{rows.num_rows} rows: a row is longer than {MAX_LINE_BYTES:,} bytes, the most "
                "a set's row may hold"
            )


def _check_row_bytes(path: Path, record: SetFileRow) -> None:
    size = len(
        json.dumps(record.values, ensure_ascii=False, default=str).encode("utf-8", "replace")
    )
    if size > MAX_LINE_BYTES:
        raise EvalSetError(
            f"{path}: {record.where}: longer than {MAX_LINE_BYTES:,} bytes, the most a set's row "
            "may hold"
        )


def _jsonl_records(path: Path) -> list[SetFileRow]:
    records = []
    with open(path, "rb") as stream:
        number = 0
        # readline with a bound: a line of 20 MB was read, parsed and tokenised (29 s, 4.4 GB)
        while raw := stream.readline(MAX_LINE_BYTES + 1):
            number += 1
            if len(raw) > MAX_LINE_BYTES and not raw.endswith(b"\n"):
                raise EvalSetError(
                    f"{path}: line {number}: longer than {MAX_LINE_BYTES:,} bytes, the most a "
                    "set's row may hold"
                )
            if not raw.strip():
                continue  # a blank line (often the last) is not a row
            records.append(SetFileRow(number, f"line {number}", _json_line(path, number, raw)))
            _check_rows(path, len(records))
            _check_text(path, records[-1])
    return records


def _json_line(path: Path, number: int, raw: bytes) -> Any:
    try:
        return json.loads(raw.decode("utf-8").rstrip("\r\n"))
    except UnicodeDecodeError as err:
        raise EvalSetError(f"{path}: line {number}: not UTF-8 ({err.reason})") from None
    except json.JSONDecodeError as err:
        # err's own text says "line 1 column 5" of the one line parsed: the file's line alone
        raise EvalSetError(
            f"{path}: line {number}: not a JSON object: {err.msg} (column {err.colno})"
        ) from None
    except RecursionError:
        raise EvalSetError(
            f"{path}: line {number}: nested too deeply to be a set's row (lists or objects "
            "inside each other past Python's recursion limit)"
        ) from None


def _check_rows(path: Path, rows: int) -> None:
    if rows > MAX_ROWS:
        raise EvalSetError(f"{path}: more than {MAX_ROWS:,} rows, the most a set may hold")


def _check_text(path: Path, record: SetFileRow) -> None:
    """Text that UTF-8 cannot write (a lone surrogate, "\\ud800" in JSON) refused here, naming
    the row, rather than by the parquet writer with no file or row."""
    try:
        json.dumps(record.values, ensure_ascii=False, default=str).encode("utf-8")
    except UnicodeEncodeError as err:
        raise EvalSetError(
            f"{path}: {record.where}: holds text that is not valid Unicode ({err.reason} at "
            f"character {err.start} of the row): a lone surrogate escape such as \\ud800"
        ) from None
    except RecursionError:
        raise EvalSetError(f"{path}: {record.where}: nested too deeply to be a set's row") from None
