"""The run's shards: ids, bounds and the params JSON of the prompt rules (run/split.py divides
them).

Cheap (no data is read): Snakemake calls these at parse time, and every cluster job parses the
workflow again.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

from eaglenest.settings.prompts import PromptOptions


def prompt_options(config: Mapping[str, Any] | PromptOptions) -> PromptOptions:
    """The options themselves, or those of a validated config (validate_config)."""
    return config if isinstance(config, PromptOptions) else PromptOptions.from_config(config)


def shard_ids(config: Mapping[str, Any]) -> list[str]:
    """Shard ids of the run, from `prompts.max_samples` and `prompts.shard_size` alone (no data
    is read): ceil(max_samples / shard_size) ids "00000", "00001", ..."""
    options = prompt_options(config)
    return [f"{i:05d}" for i in range(math.ceil(options.max_samples / options.shard_size))]


def shard_bounds(config: Mapping[str, Any], shard: str) -> tuple[int, int]:
    """Positions [start, stop) of `shard` in the ordered prompt list; the last shard is short
    when max_samples is not a multiple of shard_size."""
    return bounds(prompt_options(config), shard)


def bounds(options: PromptOptions, shard: str) -> tuple[int, int]:
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
    return json.dumps(prompt_options(config).list_settings(), sort_keys=True)


def shard_params_json(config: Mapping[str, Any] | PromptOptions, shard: str) -> str:
    """Sorted JSON of the slice a shard holds: the `params` of the shard rule, so a change of
    max_samples reruns only the shard whose slice changed (the last one)."""
    options = prompt_options(config)
    start, stop = bounds(options, shard)
    return json.dumps({"start": start, "stop": stop}, sort_keys=True)
