"""Reading a prompt source: the demo task families, local .jsonl/.json/.parquet files (globs and
lists of them), a local dataset directory or a Hugging Face hub dataset, opened for random access
by row position. Nothing is normalised here (see normalise.py)."""

from __future__ import annotations

import glob
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from eaglenest.run.shards import prompt_options
from eaglenest.settings.prompts import DEMO_SOURCES, LOCAL_SUFFIXES, PromptOptions, source_kind
from eaglenest.stages.prompts.normalise import Unparsable


class PromptSourceError(ValueError):
    """The prompt source cannot be read or gives too few usable prompts; the message says why."""


def local_source_files(config: Mapping[str, Any]) -> list[str]:
    """The local files a `files` source reads (globs expanded), for the `input:` of the rule that
    reads the source, so editing them reruns it; [] for the demo, directories and the hub."""
    options = prompt_options(config)
    if source_kind(options.source) != "files":
        return []
    return _expand_files(options.source)


def _expand_files(source: str | Sequence[str]) -> list[str]:
    entries = [source] if isinstance(source, str) else list(source)
    files: list[str] = []
    for entry in entries:
        if glob.has_magic(entry):
            matches = sorted(p for p in glob.glob(entry, recursive=True) if Path(p).is_file())
            if not matches:
                raise PromptSourceError(f"prompts.source: no file matches {entry!r}")
            files.extend(matches)
        elif Path(entry).is_file():
            files.append(entry)
        else:
            raise PromptSourceError(f"prompts.source: file not found: {entry!r}")
    for path in files:
        if not path.lower().endswith(LOCAL_SUFFIXES):
            raise PromptSourceError(
                f"prompts.source: {path!r} is not one of {', '.join(LOCAL_SUFFIXES)}"
            )
    return files


@dataclass
class _Part:
    """One table of rows: a file, a dataset split or the demo pool."""

    name: str  # what goes into the `source` column
    n_rows: int
    take: Callable[[list[int]], list[Any]]  # records at these positions, in that order
    source_index: np.ndarray | None = None  # row position -> source_index, when not the identity
    row_sources: list[str] | None = None  # row position -> `source`, when it varies per row


@dataclass
class PromptSource:
    """Rows of one or more parts, addressed by a global row position (parts in order)."""

    label: str  # for messages and reports
    parts: list[_Part]
    offsets: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        self.offsets = np.cumsum([0] + [part.n_rows for part in self.parts])

    @property
    def n_rows(self) -> int:
        return int(self.offsets[-1])

    def take(self, positions: np.ndarray) -> list[tuple[Any, str, int]]:
        """(record, source, source_index) for each global row position, in the given order."""
        part_of = np.searchsorted(self.offsets, positions, side="right") - 1
        rows: list[tuple[Any, str, int] | None] = [None] * len(positions)
        for part_number in np.unique(part_of):
            part = self.parts[part_number]
            where = np.flatnonzero(part_of == part_number)
            local = (positions[where] - self.offsets[part_number]).tolist()
            for slot, position, record in zip(where, local, part.take(local)):
                index = position if part.source_index is None else int(part.source_index[position])
                name = part.name if part.row_sources is None else part.row_sources[position]
                rows[slot] = (record, name, index)
        return rows  # type: ignore[return-value]


def open_source(options: PromptOptions) -> PromptSource:
    """Open `prompts.source` for random access (nothing is normalised yet)."""
    kind = source_kind(options.source)
    if kind == "demo":
        return PromptSource("demo", [_demo_part(options)])
    if kind == "files":
        files = _expand_files(options.source)
        return PromptSource(", ".join(files), [_file_part(path, options) for path in files])
    return PromptSource(_dataset_label(options), [_dataset_part(options)])


def _demo_part(options: PromptOptions) -> _Part:
    # Imported here: the demo module is only needed by the demo source.
    from eaglenest.demo.tasks import heldout_examples

    suite = DEMO_SOURCES[options.source]
    # A fixed pool, so the shuffled order does not depend on max_samples.
    if suite == "cite":
        from eaglenest.demo.cite_tasks import cite_examples, shape_of

        cite = options.demo_cite or {}
        examples = cite_examples(
            shape_of(cite), cite.get("seed", 0), options.seed, options.demo_pool_size
        )
    else:
        examples = heldout_examples(options.seed, options.demo_pool_size, suite)
    records = [{"prompt": example.prompt} for example in examples]
    return _Part(
        name="demo",
        n_rows=len(records),
        take=lambda rows: [records[i] for i in rows],
        row_sources=[f"demo:{example.family}" for example in examples],
    )


def _wanted_columns(options: PromptOptions, available: Sequence[str], where: str) -> list[str]:
    """The columns of a table that normalising can read. Converting only those to Python skips
    the (often long) answers; a table with none of them fails here, naming its columns."""
    columns = options.columns
    formats = {
        "sharegpt": [columns["conversations"]],
        "messages": [columns["messages"]],
        "prompt": [columns["prompt"], columns["instruction"]],
    }
    main = [c for f, names in formats.items() if options.format in ("auto", f) for c in names]
    wanted = [c for c in main if c in available]
    if not wanted:
        raise PromptSourceError(
            f"{where}: no column of prompts.format {options.format} ({', '.join(main)}); it has "
            f"{', '.join(available) or 'no columns'}; set prompts.format or prompts.columns"
        )
    extra = [columns["input"], columns["system"]] if options.format in ("auto", "prompt") else []
    return wanted + [c for c in extra if c in available and c not in wanted]


def _file_part(path: str, options: PromptOptions) -> _Part:
    lower = path.lower()
    if lower.endswith(".parquet"):
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(path)
        except Exception as err:  # pyarrow raises several types; the user needs the file name
            raise PromptSourceError(f"{path}: cannot read parquet: {err}") from err
        table = table.select(_wanted_columns(options, table.column_names, path))
        return _Part(path, table.num_rows, lambda rows: table.take(rows).to_pylist())
    if lower.endswith((".jsonl", ".ndjson")):
        records, line_numbers = _read_json_lines(path)
    else:
        records, line_numbers = _read_json(path)
    return _Part(
        path,
        len(records),
        lambda rows: [records[i] for i in rows],
        source_index=None if line_numbers is None else np.asarray(line_numbers, dtype=np.int64),
    )


def _read_json_lines(path: str) -> tuple[list[Any], list[int]]:
    """Records and their 0-based line numbers (the `source_index`); blank lines are not rows. A
    line that is not UTF-8 or not JSON is counted as unparsable, with its line number."""
    records: list[Any] = []
    line_numbers: list[int] = []
    with open(path, "rb") as stream:
        for line_number, raw in enumerate(stream):
            if not raw.strip():
                continue
            try:
                records.append(json.loads(raw.decode("utf-8")))
            except UnicodeDecodeError as err:
                records.append(Unparsable(f"line {line_number + 1}: not UTF-8: {err}"))
            except (json.JSONDecodeError, RecursionError) as err:
                records.append(Unparsable(f"line {line_number + 1}: {err}"))
            line_numbers.append(line_number)
    return records, line_numbers


def _read_json(path: str) -> tuple[list[Any], list[int] | None]:
    """A .json file: a list of rows, or an object holding one list (e.g. {"data": [...]});
    a .json file that is really JSON Lines is read as such."""
    raw = Path(path).read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        line = raw[: err.start].count(b"\n") + 1
        raise PromptSourceError(
            f"{path}: line {line}: not UTF-8 ({err.reason} at byte {err.start})"
        ) from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        if err.msg == "Extra data":
            return _read_json_lines(path)
        raise PromptSourceError(f"{path}: not valid JSON: {err}") from err
    if isinstance(data, Mapping):
        lists = [key for key, value in data.items() if isinstance(value, list)]
        if len(lists) != 1:
            raise PromptSourceError(
                f"{path}: expected a list of rows or an object with one list of rows; found "
                f"an object with keys {', '.join(map(str, data)) or 'none'}"
            )
        data = data[lists[0]]
    if not isinstance(data, list):
        raise PromptSourceError(f"{path}: expected a list of rows, found {type(data).__name__}")
    return data, None


def _dataset_label(options: PromptOptions) -> str:
    name = options.source if options.subset is None else f"{options.source}/{options.subset}"
    return f"{name}:{options.split}"


def _dataset_part(options: PromptOptions) -> _Part:
    import datasets

    data_files = options.data_files  # as the config gave it: a list, not the settings' tuple
    try:
        dataset = datasets.load_dataset(
            options.source,
            options.subset,
            split=options.split,
            revision=options.revision,
            data_files=list(data_files) if isinstance(data_files, tuple) else data_files,
            cache_dir=options.cache_dir,
        )
    except Exception as err:  # datasets raises many types; say which source and split failed
        raise PromptSourceError(
            f"prompts.source: cannot load dataset {options.source!r} (subset {options.subset!r},"
            f" split {options.split!r}): {type(err).__name__}: {err}"
        ) from err
    label = _dataset_label(options)
    dataset = dataset.select_columns(_wanted_columns(options, dataset.column_names, label))
    # The arrow view takes a list of rows at once and skips per-row Python formatting.
    table_view = dataset.with_format("arrow")
    return _Part(label, len(dataset), lambda rows: table_view[rows].to_pylist())
