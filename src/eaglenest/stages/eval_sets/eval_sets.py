"""The stage that turns one standard evaluation set (an entry of `evaluate.sets`) into the run's
evaluation prompts: its local file read in its format, every row checked, written as
`eval_sets/{set}.parquet` (eaglenest.formats.eval_sets) with a small report. A set is a
benchmark: a row that cannot be used fails the set (naming file, row and field), never drops
silently, so the figures are on the whole set or not at all."""

from __future__ import annotations

import collections
import logging
from pathlib import Path

from eaglenest.common.io import atomic_path, sha256_file, write_json
from eaglenest.formats.eval_sets import eval_set_frame
from eaglenest.settings.eval_sets import EvalSetLimits, EvalSetSettings
from eaglenest.stages.eval_sets.files import EvalSetError, SetFileRow, read_records
from eaglenest.stages.eval_sets.formats import READERS, RowRefused, check_columns, detect
from eaglenest.stages.eval_sets.lengths import check_lengths

log = logging.getLogger(__name__)
# How many refused rows one error lists (the count says how many more).
LISTED_REFUSALS = 10


def load_eval_set_rows(settings: EvalSetSettings) -> tuple[list[dict], str]:
    """The rows of a set (dicts of the eval_sets columns) and the format they were read as;
    raises EvalSetError listing every refused row."""
    path = Path(settings.path)
    where = f"evaluate.sets {settings.name!r}: {settings.path}"
    if not path.is_file():
        raise EvalSetError(f"{where}: file not found (from {Path.cwd()})")
    records, columns = read_records(path)
    if not records:
        raise EvalSetError(f"{where}: the file holds no rows")
    format_name = detect(columns, where) if settings.format == "auto" else settings.format
    check_columns(format_name, columns, where)
    rows, refusals = _rows(records, settings.name, format_name)
    refusals += _duplicate_ids(rows)
    if refusals:
        listed = "\n  ".join(refusals[:LISTED_REFUSALS])
        more = len(refusals) - LISTED_REFUSALS
        raise EvalSetError(
            f"{where} (read as {format_name}): {len(refusals)} of {len(records)} rows refused:"
            f"\n  {listed}" + (f"\n  ... and {more} more" if more > 0 else "")
        )
    return rows, format_name


def _rows(records: list[SetFileRow], name: str, format_name: str) -> tuple[list[dict], list[str]]:
    reader = READERS[format_name]
    rows, refusals = [], []
    for record in records:
        try:
            if not isinstance(record.values, dict):
                raise RowRefused("<row>", f"expected an object, got {type(record.values).__name__}")
            prompt = reader(record.values, record.source_row)
        except RowRefused as refused:
            refusals.append(f"{record.where}: {refused}")
            continue
        rows.append(
            {
                "set": name,
                "id": prompt.id,
                "category": prompt.category,
                "system": prompt.system,
                "turns": prompt.turns,
                "source_row": record.source_row,
                "where": record.where,
            }
        )
    return rows, refusals


def _duplicate_ids(rows: list[dict]) -> list[str]:
    first: dict[str, str] = {}
    refusals = []
    for row in rows:
        if row["id"] in first:
            refusals.append(
                f"{row['where']}: id {row['id']!r} is already the id of {first[row['id']]}; "
                "a set's ids are unique (figures are kept per prompt)"
            )
        first.setdefault(row["id"], row["where"])
    return refusals


def prepare_eval_set(
    settings: EvalSetSettings,
    out: str | Path,
    report: str | Path,
    limits: EvalSetLimits | None = None,
) -> None:
    """Read, check and write one set: `out` the validated parquet, `report` what it holds (rows,
    turns, categories, the format read, the source file's sha256). With `limits`, every row's
    turns are checked against the target's positions first (stages/eval_sets/lengths.py)."""
    rows, format_name = load_eval_set_rows(settings)
    if limits is not None:
        check_lengths(settings, rows, limits)
    frame = eval_set_frame([{k: v for k, v in row.items() if k != "where"} for row in rows])
    with atomic_path(out) as tmp:
        frame.write_parquet(tmp)
    categories = collections.Counter(row["category"] for row in rows)
    write_json(
        report,
        {
            "set": settings.name,
            "path": settings.path,
            "format": format_name,
            "sha256": sha256_file(settings.path),
            "prompts": len(rows),
            "turns": sum(len(row["turns"]) for row in rows),
            "multi_turn_prompts": sum(len(row["turns"]) > 1 for row in rows),
            "with_system": sum(row["system"] is not None for row in rows),
            "categories": dict(sorted(categories.items())),
        },
    )
    log.info("%s: %d prompts (%s) from %s", settings.name, len(rows), format_name, settings.path)
