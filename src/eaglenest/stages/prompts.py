"""The prompts stage: turn a prompt source into a fixed, ordered, sharded list of chat prompts.

A source is the demo task families, local .jsonl/.json/.parquet files, a local dataset directory
or a Hugging Face hub dataset. Every row is normalised to chat `messages` (all turns up to and
including the last user turn: the target regenerates the answer), identified by a content hash,
deduplicated, and ordered by a seeded hash of its row position. That order never depends on
`max_samples`, which only decides how many shards of `shard_size` prompts the run has, so raising
it adds shards and leaves the existing ones byte-for-byte the same.

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

import copy
import glob
import hashlib
import itertools
import json
import logging
import math
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from eaglenest.common.config import validate_config
from eaglenest.common.io import atomic_path, write_json
from eaglenest.settings import Settings

# polars and pandera (with pandas) are imported where frames are made: Snakemake imports this
# module at parse time for shard_ids(), and every cluster job parses the workflow again.
if TYPE_CHECKING:
    import polars as pl

log = logging.getLogger(__name__)

# Every reason a source row can be skipped; reports list all of them (zeros too) so they diff well.
SKIP_REASONS: tuple[str, ...] = (
    "invalid_json",  # a JSON Lines line that does not parse
    "unknown_schema",  # the row is not an object, or has none of the known/configured columns
    "malformed_turn",  # a turn that is not {role, content} / {from, value} with text content
    "unknown_role",  # a role other than system/user/assistant (or their aliases) before the end
    "non_text_content",  # a content part that is not text (image, audio, ...)
    "no_user_turn",
    "misplaced_system",  # a system turn after another turn: chat templates reject or misplace it
    "empty_text",  # a user or assistant turn with only whitespace
    "too_long",  # more characters than prompts.max_prompt_chars
    "duplicate",  # same messages as an earlier row (same id); the first one in list order wins
)

# Role spellings of the common datasets (ShareGPT uses human/gpt; some dumps use model/bot).
ROLE_ALIASES: dict[str, str] = {
    "system": "system",
    "developer": "system",
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "model": "assistant",
    "chatgpt": "assistant",
    "bot": "assistant",
}

LOCAL_SUFFIXES = (".jsonl", ".ndjson", ".json", ".parquet")
_ROWS_PER_CHUNK = 4096  # rows fetched from the source at once, and rows per written chunk
_EXAMPLES_PER_REASON = 3


class PromptSourceError(ValueError):
    """The prompt source cannot be read or gives too few usable prompts; the message says why."""


class RowSkipped(Exception):
    """Raised while normalising one row; `reason` is one of SKIP_REASONS."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


# ---------------------------------------------------------------------------------------------
# Settings and shard arithmetic (cheap: Snakemake calls these at parse time)
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PromptOptions(Settings):
    """The `prompts:` config section with its defaults filled in, plus the run seed.

    Not a rerun trigger as a whole: max_samples and shard_size decide how many shards exist, and
    raising them must neither rewrite the list nor rerun its existing shards. What of it shapes
    each file is `list_settings()` (the list) and `shard_params_json` (a shard's slice)."""

    source: str | tuple[str, ...]
    split: str
    subset: str | None
    revision: str | None
    data_files: str | tuple[str, ...] | None
    cache_dir: str | None
    format: str
    columns: Mapping[str, str]
    keep_system: bool
    max_prompt_chars: int | None
    shuffle: bool
    max_samples: int
    shard_size: int
    allow_short: bool
    demo_pool_size: int
    seed: int

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> PromptOptions:
        """Read the run config; only `seed` and `prompts` are looked at (validated, defaults
        filled by config/schema.yaml, so a typo in a key fails here with the key's name)."""
        # A deep copy: filling defaults must not change the caller's config.
        wanted = {k: config[k] for k in ("seed", "prompts") if config.get(k) is not None}
        section = validate_config(copy.deepcopy(wanted))
        prompts = section["prompts"]

        def as_tuple(value: Any) -> Any:
            return tuple(value) if isinstance(value, list) else value

        return cls(
            **{
                **{key: as_tuple(value) for key, value in prompts.items() if key != "columns"},
                "columns": dict(prompts["columns"]),
                "seed": section["seed"],
            }
        )

    def list_settings(self) -> dict[str, Any]:
        """The settings that decide the ordered prompt list (not how many shards are cut)."""
        settings = {
            "source": _jsonable(self.source),
            "format": self.format,
            "columns": dict(sorted(self.columns.items())),
            "keep_system": self.keep_system,
            "max_prompt_chars": self.max_prompt_chars,
            "shuffle": self.shuffle,
        }
        kind = source_kind(self.source)
        if kind == "dataset":
            settings.update(
                split=self.split,
                subset=self.subset,
                revision=self.revision,
                data_files=_jsonable(self.data_files),
            )
        if kind == "demo":
            settings["demo_pool_size"] = self.demo_pool_size
        if self.shuffle or kind == "demo":  # the demo draws its prompts with the seed
            settings["seed"] = self.seed
        return settings


def _options(config: Mapping[str, Any] | PromptOptions) -> PromptOptions:
    return config if isinstance(config, PromptOptions) else PromptOptions.from_config(config)


def _jsonable(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def shard_ids(config: Mapping[str, Any]) -> list[str]:
    """Shard ids of the run, from `prompts.max_samples` and `prompts.shard_size` alone (no data
    is read): ceil(max_samples / shard_size) ids "00000", "00001", ..."""
    options = PromptOptions.from_config(config)
    return [f"{i:05d}" for i in range(math.ceil(options.max_samples / options.shard_size))]


def shard_bounds(config: Mapping[str, Any], shard: str) -> tuple[int, int]:
    """Positions [start, stop) of `shard` in the ordered prompt list; the last shard is short
    when max_samples is not a multiple of shard_size."""
    options = PromptOptions.from_config(config)
    return _bounds(options, shard)


def _bounds(options: PromptOptions, shard: str) -> tuple[int, int]:
    n_shards = math.ceil(options.max_samples / options.shard_size)
    if not (shard.isdigit() and shard == f"{int(shard):05d}" and int(shard) < n_shards):
        raise ValueError(
            f"unknown prompt shard {shard!r}: this run has shards 00000..{n_shards - 1:05d} "
            f"(prompts.max_samples {options.max_samples}, prompts.shard_size "
            f"{options.shard_size})"
        )
    start = int(shard) * options.shard_size
    return start, min(start + options.shard_size, options.max_samples)


def prepared_params_json(config: Mapping[str, Any] | PromptOptions) -> str:
    """Sorted JSON of what decides the ordered list: the `params` of the rule that writes
    prompts/all.parquet. It leaves out max_samples and shard_size on purpose, so raising
    max_samples does not rewrite all.parquet (which would rerun every shard downstream)."""
    return json.dumps(_options(config).list_settings(), sort_keys=True)


def shard_params_json(config: Mapping[str, Any] | PromptOptions, shard: str) -> str:
    """Sorted JSON of the slice a shard holds: the `params` of the shard rule, so a change of
    max_samples reruns only the shard whose slice changed (the last one). Pass the PromptOptions
    read once when calling it per shard: validating the config each time costs ~3 ms a shard."""
    options = _options(config)
    start, stop = _bounds(options, shard)
    return json.dumps({"start": start, "stop": stop}, sort_keys=True)


def source_kind(source: str | Sequence[str]) -> str:
    """`demo`, `files` (local .jsonl/.json/.parquet files or globs) or `dataset` (a local dataset
    directory or a hub name, both read with datasets.load_dataset)."""
    if not isinstance(source, str):
        return "files"
    if source == "demo":
        return "demo"
    path = Path(source)
    if path.is_dir():
        return "dataset"
    if path.is_file() or glob.has_magic(source) or path.suffix.lower() in LOCAL_SUFFIXES:
        return "files"
    return "dataset"


def local_source_files(config: Mapping[str, Any]) -> list[str]:
    """The local files a `files` source reads (globs expanded), for the `input:` of the rule that
    reads the source, so editing them reruns it; [] for the demo, directories and the hub."""
    options = PromptOptions.from_config(config)
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


# ---------------------------------------------------------------------------------------------
# Normalising one row
# ---------------------------------------------------------------------------------------------


def prompt_id(messages: Sequence[Mapping[str, str]]) -> str:
    """First 16 hex digits of the sha256 of the canonical JSON of `messages` (only role and
    content, keys sorted), so the id depends on the conversation and nothing else."""
    canonical = [{"content": m["content"], "role": m["role"]} for m in messages]
    text = json.dumps(canonical, ensure_ascii=False, separators=(",", ":"), sort_keys=True)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


@dataclass(frozen=True)
class _Unparsable:
    """Stands in for a JSON Lines line that does not parse, so it is counted, not fatal."""

    detail: str


def normalise_record(record: Any, options: PromptOptions) -> tuple[list[dict[str, str]], str]:
    """Messages of one source row (system?, user, [assistant, user]...) and the format it was
    read as (`sharegpt`, `messages` or `prompt`); raises RowSkipped when the row is unusable."""
    if isinstance(record, _Unparsable):
        raise RowSkipped("invalid_json", record.detail)
    if not isinstance(record, Mapping):
        raise RowSkipped("unknown_schema", f"the row is a {type(record).__name__}, not an object")
    row_format, column = _pick_format(record, options)
    value = record[column]
    if row_format == "prompt" and isinstance(value, str):
        turns = _prompt_turns(record, column, options)
    else:  # a `prompt` column may also hold a list of turns
        if not isinstance(value, (list, tuple)):
            raise RowSkipped(
                "malformed_turn", f"column {column!r} holds a {type(value).__name__}, not turns"
            )
        turns = list(value)
    return _keep_until_last_user(turns, options), row_format


def _pick_format(record: Mapping[str, Any], options: PromptOptions) -> tuple[str, str]:
    columns = options.columns
    candidates = [
        ("sharegpt", columns["conversations"]),
        ("messages", columns["messages"]),
        ("prompt", columns["prompt"]),
        ("prompt", columns["instruction"]),
    ]
    if options.format != "auto":
        candidates = [c for c in candidates if c[0] == options.format]
    for row_format, column in candidates:
        # Tables (parquet, datasets) give every column to every row, null where absent.
        if record.get(column) is not None:
            return row_format, column
    wanted = ", ".join(column for _, column in candidates)
    present = ", ".join(sorted(map(str, record))) or "none"
    raise RowSkipped(
        "unknown_schema",
        f"no column of format {options.format} ({wanted}); the row has: {present}",
    )


def _prompt_turns(
    record: Mapping[str, Any], column: str, options: PromptOptions
) -> list[dict[str, Any]]:
    columns = options.columns
    text = record[column]
    extra = record.get(columns["input"]) if column == columns["instruction"] else None
    if isinstance(extra, str) and extra.strip():
        text = f"{text}\n\n{extra}"  # the Alpaca convention for instruction + input
    turns: list[dict[str, Any]] = []
    system = record.get(columns["system"])
    if isinstance(system, str):
        turns.append({"role": "system", "content": system})
    turns.append({"role": "user", "content": text})
    return turns


def _turn_role(turn: Any) -> str | None:
    """Canonical role of a {role, content} or {from, value} turn; None when unknown."""
    if not isinstance(turn, Mapping):
        return None
    role = turn.get("role") if turn.get("role") is not None else turn.get("from")
    return ROLE_ALIASES.get(role.strip().lower()) if isinstance(role, str) else None


def _turn_text(turn: Mapping[str, Any], position: int) -> str:
    content = turn.get("content") if turn.get("content") is not None else turn.get("value")
    if isinstance(content, str):
        return content
    if isinstance(content, (list, tuple)):  # OpenAI content parts
        texts = []
        for part in content:
            if isinstance(part, str):
                texts.append(part)
            elif isinstance(part, Mapping) and part.get("type", "text") == "text":
                if not isinstance(part.get("text"), str):
                    raise RowSkipped("malformed_turn", f"turn {position} has a text part no text")
                texts.append(part["text"])
            else:
                kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                raise RowSkipped("non_text_content", f"turn {position} has a {kind} part")
        return "\n".join(texts)  # vLLM joins text parts with a newline too
    raise RowSkipped("malformed_turn", f"turn {position} has no text content")


def _keep_until_last_user(turns: list[Any], options: PromptOptions) -> list[dict[str, str]]:
    roles = [_turn_role(turn) for turn in turns]
    if "user" not in roles:
        raise RowSkipped("no_user_turn", f"{len(turns)} turns, none from the user")
    last_user = len(roles) - 1 - roles[::-1].index("user")
    # Intermediate assistant turns stay: they are the context the last user turn refers to.
    messages: list[dict[str, str]] = []
    for position, (turn, role) in enumerate(zip(turns[: last_user + 1], roles)):
        if role is None:
            if not isinstance(turn, Mapping):
                raise RowSkipped("malformed_turn", f"turn {position} is not an object")
            raw = turn.get("role") if turn.get("role") is not None else turn.get("from")
            reason = "unknown_role" if raw is not None else "malformed_turn"
            raise RowSkipped(reason, f"turn {position} has role {raw!r}")
        text = _turn_text(turn, position)
        if role == "system":
            if not options.keep_system or not text.strip():
                continue  # an empty system prompt is the same as none
            if messages:
                raise RowSkipped("misplaced_system", f"turn {position} is a system turn")
        elif not text.strip():
            raise RowSkipped("empty_text", f"turn {position} ({role}) is empty")
        messages.append({"role": role, "content": text})
    n_chars = sum(len(m["content"]) for m in messages)
    if options.max_prompt_chars is not None and n_chars > options.max_prompt_chars:
        raise RowSkipped(
            "too_long",
            f"{n_chars} characters > prompts.max_prompt_chars {options.max_prompt_chars}",
        )
    return messages


# ---------------------------------------------------------------------------------------------
# Reading sources
# ---------------------------------------------------------------------------------------------


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

    # A fixed pool, so the shuffled order does not depend on max_samples.
    examples = heldout_examples(options.seed, options.demo_pool_size)
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
                records.append(_Unparsable(f"line {line_number + 1}: not UTF-8: {err}"))
            except (json.JSONDecodeError, RecursionError) as err:
                records.append(_Unparsable(f"line {line_number + 1}: {err}"))
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

    try:
        dataset = datasets.load_dataset(
            options.source,
            options.subset,
            split=options.split,
            revision=options.revision,
            data_files=_jsonable(options.data_files),
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


# ---------------------------------------------------------------------------------------------
# The ordered list
# ---------------------------------------------------------------------------------------------

_MASK64 = (1 << 64) - 1


def _splitmix64(values: np.ndarray) -> np.ndarray:
    """The splitmix64 finaliser: plain 64-bit integer arithmetic, identical on every platform
    and numpy version (numpy's own shuffles promise no stream stability)."""
    with np.errstate(over="ignore"):
        z = values + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def walk_order(n_rows: int, seed: int, shuffle: bool) -> np.ndarray:
    """Row positions in list order: by a hash of (seed, position) when shuffling, else as read.
    Each row's key depends only on the seed and its position, not on how many rows there are."""
    positions = np.arange(n_rows, dtype=np.uint64)
    if not shuffle:
        return positions.astype(np.int64)
    seed_key = _splitmix64(np.array([seed & _MASK64], dtype=np.uint64))[0]
    return np.argsort(_splitmix64(positions ^ seed_key), kind="stable").astype(np.int64)


@dataclass
class SkipTally:
    """What happened to the rows read: prompts kept per format, rows skipped per reason."""

    rows_read: int = 0
    kept_by_format: Counter = field(default_factory=Counter)
    skipped: Counter = field(default_factory=Counter)
    examples: dict[str, list[str]] = field(default_factory=dict)

    def skip(self, reason: str, where: str, detail: str) -> None:
        self.skipped[reason] += 1
        shown = self.examples.setdefault(reason, [])
        if len(shown) < _EXAMPLES_PER_REASON:
            shown.append(f"{where}: {detail}")

    def summary(self) -> str:
        counts = ", ".join(f"{r} {n}" for r, n in sorted(self.skipped.items())) or "none"
        firsts = "; ".join(f"{r}: {shown[0]}" for r, shown in sorted(self.examples.items()))
        return f"skipped {counts}" + (f" (e.g. {firsts})" if firsts else "")

    def as_dict(self) -> dict[str, Any]:
        return {
            "rows_read": self.rows_read,
            "prompts": sum(self.kept_by_format.values()),
            "prompts_by_format": dict(sorted(self.kept_by_format.items())),
            "skipped": {reason: self.skipped.get(reason, 0) for reason in SKIP_REASONS},
            "skipped_examples": dict(sorted(self.examples.items())),
        }


def iter_prompts(
    source: PromptSource, options: PromptOptions, tally: SkipTally
) -> Iterator[dict[str, Any]]:
    """Prompt rows (id, messages, source, source_index) in list order, counting skips in
    `tally`. Stopping early gives a prefix of the full list: the order is fixed up front."""
    order = walk_order(source.n_rows, options.seed, options.shuffle)
    seen: set[str] = set()
    for start in range(0, len(order), _ROWS_PER_CHUNK):
        for record, name, index in source.take(order[start : start + _ROWS_PER_CHUNK]):
            tally.rows_read += 1
            where = f"{name} row {index}"
            try:
                messages, row_format = normalise_record(record, options)
            except RowSkipped as skipped:
                tally.skip(skipped.reason, where, skipped.detail)
                continue
            pid = prompt_id(messages)
            if pid in seen:
                tally.skip("duplicate", where, f"same messages as prompt {pid}")
                continue
            seen.add(pid)
            tally.kept_by_format[row_format] += 1
            yield {"id": pid, "messages": messages, "source": name, "source_index": index}


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


def _frame(rows: list[dict[str, Any]]) -> pl.DataFrame:
    import polars as pl

    from eaglenest.formats.prompts import empty_prompts_frame

    if not rows:
        return empty_prompts_frame()
    return pl.DataFrame(rows, schema=empty_prompts_frame().schema)


def validate_prompts(frame: pl.DataFrame, path: str | Path) -> pl.DataFrame:
    """Check `frame` against PromptsSchema; the error names the file and the failing rows."""
    import pandera.errors

    from eaglenest.formats.prompts import PromptsSchema

    try:
        return PromptsSchema.validate(frame, lazy=True)
    except (pandera.errors.SchemaError, pandera.errors.SchemaErrors) as err:
        raise ValueError(f"{path}: prompts do not match PromptsSchema: {err}") from err


def read_prompts(path: str | Path) -> pl.DataFrame:
    """A prompts file (a shard or all.parquet), validated."""
    import polars as pl

    return validate_prompts(pl.read_parquet(path), path)


_PREPARED_KEY = "eaglenest.stages.prompts"  # parquet metadata key of what all.parquet was made from


def prepare_prompts(
    config: Mapping[str, Any] | PromptOptions, out: str | Path, report: str | Path | None = None
) -> dict[str, Any]:
    """Write every usable prompt of the source, in list order, to `out` (all.parquet) and the
    counts to `report`; return the report. Fails when no row is usable, or when fewer than
    max_samples are and allow_short is false (early, before any shard job runs)."""
    import pyarrow.parquet as pq

    options = _options(config)
    source = open_source(options)
    tally = SkipTally()
    n_prompts = 0
    with atomic_path(out) as tmp:
        writer = None
        try:
            rows = iter_prompts(source, options, tally)
            while chunk := list(itertools.islice(rows, _ROWS_PER_CHUNK)):
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

    options = _options(config)
    start, stop = _bounds(options, shard)
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
