"""The report's inputs: which run files there are (`RunFiles`), and reading and checking them.

Every file the report reads is read here, and checked against what the stage that writes it
promises: a file that is present but malformed is a `ReportInputError` naming the file (and the
line or key). Absent files are not errors: `RunFiles` leaves them out and the page says so.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import polars as pl

from eaglenest.formats.figure_fields import FigureFileError, check_fields, read_json_object
from eaglenest.formats.lengths import (
    CHAR_LENGTHS,
    COMPLETION_LEN,
    SAMPLE_LENGTH_COLUMNS,
    TOKEN_LENGTH_COLUMNS,
    read_shard_lengths,
)
from eaglenest.formats.metrics import CompareMetrics, EvalMetrics
from eaglenest.formats.train_report import TrainReport
from eaglenest.settings.families import FAMILIES
from eaglenest.stages.report.data import FamilyRun, RunData
from eaglenest.stages.report.family_files import FAMILY_FILES, family_files, family_of_path

# A file the report reads is malformed; the message names the file and what is wrong. The
# figure files' formats raise it (formats/figure_fields.py), and so does the reading here.
ReportInputError = FigureFileError


# ---------------------------------------------------------------------------------------------
# Which files: explicit lists (the rule's inputs), or found in a run directory
# ---------------------------------------------------------------------------------------------


def _paths(values: str | Path | Iterable[str | Path] | None) -> list[Path]:
    if isinstance(values, (str, Path)):
        return [Path(values)]
    return [Path(v) for v in values or []]


def _optional(value: str | Path | None) -> Path | None:
    return Path(value) if value else None


@dataclass
class RunFiles:
    """The files a report reads. Any list may be empty and any path None: that section is a note.

    Shard files are matched by their shard id (the file name up to the first dot). Benchmark tables
    (Snakemake's `benchmark:` of generate) are optional: those that do not exist are skipped.
    """

    prompts_report: Path | None = None
    probe: Path | None = None
    raw: list[Path] = field(default_factory=list)
    samples: list[Path] = field(default_factory=list)
    samples_reports: list[Path] = field(default_factory=list)
    tokens: list[Path] = field(default_factory=list)
    tokens_reports: list[Path] = field(default_factory=list)
    lengths: list[Path] = field(default_factory=list)
    hidden_summaries: list[Path] = field(default_factory=list)
    generate_benchmarks: list[Path] = field(default_factory=list)
    generate_activity: list[Path] = field(default_factory=list)
    draft_vocab: Path | None = None
    # Each drafter family's (drafter{suffix}/, eval{suffix}/: the folder names the family).
    train_metrics: list[Path] = field(default_factory=list)
    train_report: list[Path] = field(default_factory=list)
    eval_metrics: list[Path] = field(default_factory=list)
    drafter_config: list[Path] = field(default_factory=list)
    hidden_verify: Path | None = None  # hidden/verify.json, with hidden.verify_samples
    compare: list[Path] = field(default_factory=list)  # eval_compare/{name}.json (evaluate.compare)

    def __post_init__(self) -> None:
        optional = ("prompts_report", "probe", "draft_vocab", "hidden_verify")
        for name in optional:
            setattr(self, name, _optional(getattr(self, name)))
        lists = ("raw", "samples", "samples_reports", "tokens", "tokens_reports", "lengths")
        for name in (*lists, *FAMILY_FILES):
            setattr(self, name, _paths(getattr(self, name)))
        self.hidden_summaries = _paths(self.hidden_summaries)
        self.generate_benchmarks = _paths(self.generate_benchmarks)
        self.generate_activity = _paths(self.generate_activity)
        self.compare = _paths(self.compare)

    @classmethod
    def from_run_dir(
        cls,
        run_dir: str | Path,
        benchmarks_dir: str | Path | None = None,
        logs_dir: str | Path | None = None,
    ) -> RunFiles:
        """Every report input that exists in results/{run}/ (and benchmarks/{run}/, and the
        generate jobs' activity files in logs/{run}/)."""
        run_dir = Path(run_dir)

        def shard_files(folder: str, suffix: str) -> list[Path]:
            return sorted((run_dir / folder).glob(f"[0-9][0-9][0-9][0-9][0-9]{suffix}"))

        def existing(relative: str) -> Path | None:
            path = run_dir / relative
            return path if path.exists() else None

        benchmarks = []
        if benchmarks_dir is not None:
            benchmarks = sorted((Path(benchmarks_dir) / "generate").glob("*.tsv"))
        return cls(
            prompts_report=existing("prompts/report.json"),
            probe=existing("probe.json"),
            raw=shard_files("raw", ".parquet"),
            samples=shard_files("samples", ".parquet"),
            samples_reports=shard_files("samples", ".report.json"),
            tokens=shard_files("tokens", ".parquet"),
            tokens_reports=shard_files("tokens", ".report.json"),
            lengths=shard_files("tokens", ".lengths.parquet"),
            hidden_summaries=shard_files("hidden", ".json"),
            generate_benchmarks=benchmarks,
            generate_activity=sorted(Path(logs_dir).glob("generate_responses/[0-9]*.activity.json"))
            if logs_dir is not None
            else [],
            draft_vocab=existing("vocab/draft_vocab.json"),
            compare=sorted((run_dir / "eval_compare").glob("*.json")),
            **{kind: family_files(kind, FAMILIES, run_dir, []) for kind in FAMILY_FILES},
        )


def shard_of(path: Path) -> str:
    return path.name.split(".")[0]


# ---------------------------------------------------------------------------------------------
# Reading and checking files: every error names the file
# ---------------------------------------------------------------------------------------------


TRAIN_LINE_FIELDS = {"step": "int", "loss": "number", "acc": "numbers"}
TRAIN_LINE_OPTIONAL = {
    "epoch": "number",
    "lr": "number",
    "loss_tokens": "int",
    "skipped_outside_vocab": "int",
    "tokens_per_s": "number",
    "elapsed_s": "number",
}
DRAFT_VOCAB_FIELDS = {"coverage": "number", "draft_vocab_size": "int", "target_vocab_size": "int"}
DRAFT_VOCAB_OPTIONAL = {"loss_tokens": "int", "distinct_ids_seen": "int"}


def read_train_metrics(path: Path) -> tuple[list[dict], list[dict]]:
    """(train lines, held-out lines) of drafter/metrics.jsonl, each checked against the contract."""
    train, heldout = [], []
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise ReportInputError(f"{path}: not readable ({err})") from err
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{path} line {number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise ReportInputError(f"{where}: not JSON ({err})") from err
        check_fields(record, where, {"split": "str", **TRAIN_LINE_FIELDS}, TRAIN_LINE_OPTIONAL)
        if record["split"] == "train":
            train.append(record)
        elif record["split"] == "heldout":
            heldout.append(record)
        else:
            raise ReportInputError(
                f"{where}: 'split' must be train or heldout, got {record['split']!r}"
            )
    return train, heldout


def read_train_report(path: Path) -> dict[str, Any]:
    """drafter/train_report.json, read and checked by its format (formats/train_report.py)."""
    return TrainReport.read(path).to_json()


def read_draft_vocab(path: Path) -> dict[str, Any]:
    """vocab/draft_vocab.json: the draft vocabulary's size and its coverage of completion tokens."""
    summary = read_json_object(path)
    check_fields(summary, str(path), DRAFT_VOCAB_FIELDS, DRAFT_VOCAB_OPTIONAL)
    return summary


def read_eval_metrics(path: Path) -> dict[str, Any]:
    """eval/metrics.json, read and checked by its format (formats/metrics.py): simulated
    acceptance per K, live (or null), baselines, the engine's, by depth."""
    return EvalMetrics.read(path).to_json()


def _scan(path: Path, columns: list[str]) -> pl.DataFrame:
    try:
        frame = pl.read_parquet(path, columns=columns)
    except Exception as err:  # polars raises several kinds for a bad or foreign file
        raise ReportInputError(f"{path}: cannot read columns {columns} ({err})") from err
    return frame.with_columns(pl.lit(shard_of(path)).alias("shard"))


def concat_shards(paths: list[Path], read: Callable[[Path], pl.DataFrame]) -> pl.DataFrame | None:
    """The frames `read` makes of each file, one under the other; None without files."""
    frames = [read(p) for p in paths]
    return pl.concat(frames, how="vertical_relaxed") if frames else None


def read_raw(path: Path) -> pl.DataFrame:
    columns = ["latency_s", "prompt_tokens", "completion_tokens", "attempts", "error_kind"]
    return _scan(path, columns)


def read_sample_lengths(path: Path) -> pl.DataFrame:
    frame = _scan(path, ["reasoning", "content", "reasoning_field"])
    return frame.select("shard", "reasoning_field", *CHAR_LENGTHS)


def read_token_lengths(path: Path) -> pl.DataFrame:
    frame = _scan(path, TOKEN_LENGTH_COLUMNS)
    return frame.with_columns(COMPLETION_LEN)


def _read_lengths_file(path: Path) -> tuple[pl.DataFrame, pl.DataFrame]:
    try:
        samples, tokens = read_shard_lengths(path)
    except Exception as err:  # polars raises several kinds for a bad or foreign file
        raise ReportInputError(f"{path}: not a lengths file ({err})") from err
    shard = pl.lit(shard_of(path)).alias("shard")
    samples = samples.with_columns(shard).select("shard", *SAMPLE_LENGTH_COLUMNS)
    tokens = tokens.with_columns(shard).select(*TOKEN_LENGTH_COLUMNS, "shard", "completion_len")
    return samples, tokens


def read_lengths(files: RunFiles) -> tuple[pl.DataFrame | None, pl.DataFrame | None]:
    """Sample and token lengths: from the lengths files when there are any (the pipeline's
    report), else from the samples and tokens files (a run made before those files existed)."""
    if not files.lengths:
        return concat_shards(files.samples, read_sample_lengths), concat_shards(
            files.tokens, read_token_lengths
        )
    pairs = [_read_lengths_file(p) for p in files.lengths]
    return (
        pl.concat([s for s, _ in pairs], how="vertical_relaxed"),
        pl.concat([t for _, t in pairs], how="vertical_relaxed"),
    )


def read_benchmark_wall_s(path: Path) -> float:
    """Wall seconds of a Snakemake benchmark table (the mean over repeats)."""
    try:
        table = pl.read_csv(path, separator="\t")
        return float(table["s"].mean())
    except Exception as err:
        raise ReportInputError(f"{path}: not a Snakemake benchmark table ({err})") from err


def read_by_shard(paths: list[Path]) -> dict[str, dict]:
    """Per-shard JSON reports (or summaries), by shard id, in shard order."""
    return {shard_of(p): read_json_object(p) for p in sorted(paths)}


def _family_of(path: Path) -> str:
    try:
        return family_of_path(path)
    except ValueError as err:
        raise ReportInputError(str(err)) from err


def read_families(files: RunFiles) -> dict[str, FamilyRun]:
    """Each family's training and evaluation files, read and checked, in FAMILIES order."""
    runs: dict[str, FamilyRun] = {}
    for path in files.train_metrics:
        run = runs.setdefault(_family_of(path), FamilyRun())
        run.train_lines, run.heldout_lines = read_train_metrics(path)
    for path in files.train_report:
        runs.setdefault(_family_of(path), FamilyRun()).train_report = read_train_report(path)
    for path in files.eval_metrics:
        runs.setdefault(_family_of(path), FamilyRun()).eval = read_eval_metrics(path)
    for path in files.drafter_config:
        runs.setdefault(_family_of(path), FamilyRun()).drafter_config = read_json_object(path)
    return {family: runs[family] for family in FAMILIES if family in runs}


def load_run(files: RunFiles) -> RunData:
    """The run's files read and checked; its training and evaluation fields are the first
    family's (EAGLE-3 where it has one), every family's are in `families`."""
    families = read_families(files)
    family = next(iter(families), "eagle3")
    own = families.get(family, FamilyRun())
    sample_lengths, token_lengths = read_lengths(files)
    return RunData(
        prompts=read_json_object(files.prompts_report) if files.prompts_report else None,
        probe=read_json_object(files.probe) if files.probe else None,
        samples_reports=read_by_shard(files.samples_reports),
        tokens_reports=read_by_shard(files.tokens_reports),
        hidden=read_by_shard(files.hidden_summaries),
        raw=concat_shards(files.raw, read_raw),
        samples=sample_lengths,
        tokens=token_lengths,
        generate_wall_s={
            shard_of(p): read_benchmark_wall_s(p) for p in files.generate_benchmarks if p.exists()
        },
        generate_activity=read_by_shard([p for p in files.generate_activity if p.exists()]),
        draft_vocab=read_draft_vocab(files.draft_vocab) if files.draft_vocab else None,
        train_lines=own.train_lines,
        heldout_lines=own.heldout_lines,
        train_report=own.train_report,
        eval=own.eval,
        drafter_config=own.drafter_config,
        hidden_verify=read_json_object(files.hidden_verify) if files.hidden_verify else None,
        family=family,
        families=families,
        compare={path.stem: CompareMetrics.read(path).to_json() for path in files.compare},
    )
