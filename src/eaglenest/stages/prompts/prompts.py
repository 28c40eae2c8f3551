"""The prompts stage: turn a prompt source into a fixed, ordered, sharded list of chat prompts.

A source is the demo task families, local .jsonl/.json/.parquet files, a local dataset directory
or a Hugging Face hub dataset (sources.py). Every row is normalised to chat `messages` (all turns
up to and including the last user turn: the target regenerates the answer), identified by a
content hash (normalise.py), deduplicated, and ordered by a seeded hash of its row position
(listing.py). That order never depends on `max_samples`, which only decides how many shards of
`shard_size` prompts the run has (shards.py), so raising it adds shards and leaves the existing
ones byte-for-byte the same.

Two steps, so a large source is read and normalised once per run, not once per shard:

    prepare_prompts    source -> prompts/all.parquet (every usable prompt, in order)
                               + prompts/report.json (rows read, rows skipped by reason)
    write_prompt_shard all.parquet -> prompts/{shard}.parquet (rows [start, stop) of the list)

`write_prompt_shard` without `prepared` builds the list itself (up to `max_samples`); that suits
small sources such as the demo and tests, and gives the same shards.

Rows that cannot be used are skipped and counted by reason (see SKIP_REASONS); a source with no
usable row is an error that names the source and the counts.
"""

from __future__ import annotations

import itertools
import json
import logging
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from eaglenest.common.io import atomic_path, write_json
from eaglenest.run.shards import bounds, prompt_options
from eaglenest.settings.prompts import PromptOptions
from eaglenest.stages.prompts.listing import ROWS_PER_CHUNK, SkipTally, iter_prompts
from eaglenest.stages.prompts.sources import PromptSource, PromptSourceError, open_source

# polars and pandera (with pandas) are imported where frames are made: the rules import the
# prompts package at parse time, and every cluster job parses the workflow again.
if TYPE_CHECKING:
    import polars as pl

log = logging.getLogger(__name__)

# Parquet metadata key of what all.parquet was made from: the package name, as when the stage was
# one module, so prepared lists keep their bytes.
_PREPARED_KEY = "eaglenest.stages.prompts"


def prepare_prompts(
    config: Mapping[str, Any] | PromptOptions, out: str | Path, report: str | Path | None = None
) -> dict[str, Any]:
    """Write every usable prompt of the source, in list order, to `out` (all.parquet) and the
    counts to `report`; return the report. Fails when no row is usable, or when fewer than
    max_samples are and allow_short is false (early, before any shard job runs)."""
    import pyarrow.parquet as pq

    options = prompt_options(config)
    source = open_source(options)
    tally = SkipTally()
    n_prompts = 0
    with atomic_path(out) as tmp:
        writer = None
        try:
            rows = iter_prompts(source, options, tally)
            while chunk := list(itertools.islice(rows, ROWS_PER_CHUNK)):
                table = validate_prompts(_frame(chunk), out).to_arrow()
                if writer is None:
                    # Shard jobs check this, so a stale all.parquet cannot feed a changed config.
                    stamp = {"source": source.label, "settings": options.list_settings()}
                    metadata = {_PREPARED_KEY: json.dumps(stamp, sort_keys=True)}
                    writer = pq.ParquetWriter(tmp, table.schema.with_metadata(metadata))
                writer.write_table(table)
                n_prompts += len(chunk)
        finally:
            if writer is not None:
                writer.close()
        if n_prompts == 0:
            raise _no_usable_prompt(source, tally)
        if n_prompts < options.max_samples and not options.allow_short:
            why = f"{tally.rows_read} rows read, {tally.summary()}"
            raise PromptSourceError(_too_few(options, source.label, n_prompts, why))
    summary = {
        "source": source.label,
        "rows": source.n_rows,
        "settings": options.list_settings(),
        **tally.as_dict(),
    }
    log.info(
        "%s: %d prompts from %d rows, %s", source.label, n_prompts, source.n_rows, tally.summary()
    )
    if report is not None:
        write_json(report, summary)
    return summary


def write_prompt_shard(
    config: Mapping[str, Any] | PromptOptions,
    shard: str,
    out: str | Path,
    prepared: str | Path | None = None,
) -> dict[str, Any]:
    """Write rows [start, stop) of the ordered list (see shard_bounds) to `out`, validated;
    return (and log) what the shard holds.

    With `prepared` (all.parquet from prepare_prompts) the shard is sliced from it; without, the
    list is built here up to max_samples, giving the same rows. When the list is shorter than
    max_samples this fails, unless prompts.allow_short, in which case the shard is short or
    empty (an empty file with the schema's columns).
    """
    import polars as pl

    from eaglenest.formats.prompts import empty_prompts_frame

    options = prompt_options(config)
    start, stop = bounds(options, shard)
    if prepared is not None:
        label = _check_prepared(prepared, options)
        prepared_rows = pl.scan_parquet(prepared)
        n_listed = prepared_rows.select(pl.len()).collect().item()
        frame = prepared_rows.slice(start, stop - start).collect()
        why = f"the rows skipped are counted in the report written with {prepared}"
    else:
        source = open_source(options)
        tally = SkipTally()
        listed = list(itertools.islice(iter_prompts(source, options, tally), options.max_samples))
        if not listed:
            raise _no_usable_prompt(source, tally)
        n_listed = len(listed)
        frame = _frame(listed[start:stop])
        label, why = source.label, f"{tally.rows_read} rows read, {tally.summary()}"
    if n_listed < options.max_samples and not options.allow_short:
        raise PromptSourceError(f"prompt shard {shard}: {_too_few(options, label, n_listed, why)}")
    frame = validate_prompts(frame.cast(empty_prompts_frame().schema), out)
    with atomic_path(out) as tmp:
        frame.write_parquet(tmp)
    summary = {
        "shard": shard,
        "start": start,
        "stop": stop,
        "prompts": frame.height,
        "short": frame.height < stop - start,
        "listed": min(n_listed, options.max_samples),
        "sources": dict(sorted(Counter(frame["source"].to_list()).items())),
    }
    log.info("prompt shard %s: %s", shard, json.dumps(summary, sort_keys=True))
    return summary


def validate_prompts(frame: pl.DataFrame, path: str | Path) -> pl.DataFrame:
    """Check `frame` against PromptsSchema; the error names the file and the failing rows."""
    import pandera.errors

    from eaglenest.formats.prompts import PromptsSchema

    try:
        return PromptsSchema.validate(frame, lazy=True)
    except (pandera.errors.SchemaError, pandera.errors.SchemaErrors) as err:
        raise ValueError(f"{path}: prompts do not match PromptsSchema: {err}") from err


def _check_prepared(path: str | Path, options: PromptOptions) -> str:
    """The source label of a prepared list; fails when it was made with other list settings."""
    import pyarrow.parquet as pq

    metadata = pq.read_schema(path).metadata or {}
    raw = metadata.get(_PREPARED_KEY.encode())
    if raw is None:
        raise PromptSourceError(f"{path}: not a prepared prompt list (no {_PREPARED_KEY} metadata)")
    stamp = json.loads(raw)
    expected = json.loads(json.dumps(options.list_settings()))  # tuples -> lists, like the stamp
    if stamp["settings"] != expected:
        changed = sorted(
            key
            for key in set(stamp["settings"]) | set(expected)
            if stamp["settings"].get(key) != expected.get(key)
        )
        raise PromptSourceError(
            f"{path} was prepared with other prompts settings ({', '.join(changed)} differ); "
            "prepare it again (its rule's params should be prepared_params_json(config))"
        )
    return stamp["source"]


def _frame(rows: list[dict[str, Any]]) -> pl.DataFrame:
    import polars as pl

    from eaglenest.formats.prompts import empty_prompts_frame

    if not rows:
        return empty_prompts_frame()
    return pl.DataFrame(rows, schema=empty_prompts_frame().schema)


def _no_usable_prompt(source: PromptSource, tally: SkipTally) -> PromptSourceError:
    hint = ""
    if tally.skipped.get("unknown_schema"):
        hint = "; set prompts.format or prompts.columns to the source's columns"
    return PromptSourceError(
        f"prompts source {source.label!r} has no usable prompt: {tally.rows_read} rows read, "
        f"{tally.summary()}{hint}"
    )


def _too_few(options: PromptOptions, label: str, n_prompts: int, why: str) -> str:
    return (
        f"prompts source {label!r} has {n_prompts} usable prompts but prompts.max_samples is "
        f"{options.max_samples} ({why}); lower prompts.max_samples to {n_prompts} or set "
        "prompts.allow_short: true"
    )
