"""Settings of the prompts stage: the `prompts:` section with the run seed, and the kind of source
it names. Light to import: Snakemake builds the prompt rules' params from it while it parses."""

from __future__ import annotations

import glob
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

from eaglenest.settings import Settings

LOCAL_SUFFIXES = (".jsonl", ".ndjson", ".json", ".parquet")
# The demo prompt sources and the task suite (eaglenest.demo.tasks) each draws from.
DEMO_SOURCES = {"demo": "short", "demo-long": "long", "demo-cite": "cite"}
# Shards a run may have: Snakemake lists every shard's jobs while it parses (each cluster job
# parses again), so 1e20 prompts exhausted a login node's memory before any message; five-digit
# ids ("00000") name 100,000. prompts.max_samples' own maximum is the schema's (10^9). Its cost,
# ~8 GiB and a quarter hour a command by bench/dag.py's figures, is what the refusal bounds;
# `eaglenest plan` warns past a minute and 2 GB (eaglenest.run.planning_cost).
MAX_SHARDS = 100_000


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
    # `demo-cite` only: the target's shape and seed (demo_target.cite, demo_target.seed), which
    # draw its prompts (eaglenest.demo.cite_tasks); None for every other source.
    demo_cite: Mapping[str, Any] | None

    LEFT_OUT_AT = MappingProxyType({"demo_cite": None})

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> PromptOptions:
        """Only `seed` and `prompts` are read; a list (several source files) becomes a tuple."""
        prompts = config["prompts"]
        left = ("columns", "seed", "demo_cite")
        names = [name for name in cls.__dataclass_fields__ if name not in left]
        demo = config.get("demo_target") or {}
        cite = None
        if prompts["source"] == "demo-cite":
            cite = {**demo.get("cite", {}), "seed": demo.get("seed", 0)}
        return cls(
            **{name: _as_tuple(prompts[name]) for name in names},
            columns=dict(prompts["columns"]),
            seed=config["seed"],
            demo_cite=cite,
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
        if self.demo_cite is not None:
            settings["demo_cite"] = dict(sorted(self.demo_cite.items()))
        if self.shuffle or kind == "demo":  # the demo draws its prompts with the seed
            settings["seed"] = self.seed
        return settings


def _as_tuple(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


def _jsonable(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def source_kind(source: str | Sequence[str]) -> str:
    """`demo`, `files` (local .jsonl/.json/.parquet files or globs) or `dataset` (a local dataset
    directory or a hub name, both read with datasets.load_dataset)."""
    if not isinstance(source, str):
        return "files"
    if source in DEMO_SOURCES:
        return "demo"
    path = Path(source)
    if path.is_dir():
        return "dataset"
    if path.is_file() or glob.has_magic(source) or path.suffix.lower() in LOCAL_SUFFIXES:
        return "files"
    return "dataset"


def check_shard_count(config: Mapping[str, Any]) -> None:
    """At most MAX_SHARDS shards, refused naming both keys before anything lists them."""
    prompts = config.get("prompts") or {}
    samples, size = prompts.get("max_samples"), prompts.get("shard_size")
    if not isinstance(samples, int | float) or not isinstance(size, int | float) or size < 1:
        return  # the schema has named what is wrong
    shards = -(-int(samples) // int(size))
    if shards > MAX_SHARDS:
        raise ValueError(
            f"config keys 'prompts.max_samples' {int(samples):,} and 'prompts.shard_size' "
            f"{int(size):,} make {shards:,} shards; a run has at most {MAX_SHARDS:,}: raise "
            "shard_size or lower max_samples"
        )
