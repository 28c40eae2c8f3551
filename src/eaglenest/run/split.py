"""The one split of a run's shards: held out or trained on, and of each, stored as files or
fetched from the capture servers (`hidden.store`). The rules (rules/common.smk), `eaglenest plan`
(run/plan.py) and experiments/ all call `split_shards`, so they cannot disagree.

Cheap (no data is read): Snakemake calls it at parse time, and every cluster job parses the
workflow again.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eaglenest.run.shards import shard_bounds, shard_ids
from eaglenest.run.store import (
    budget_warnings,
    estimated_sample_bytes,
    measured_shard_bytes,
    shards_that_fit,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ShardSplit:
    """How a run's shards divide: held out (never trained on, evaluated) or trained on, and of
    each, those whose states are stored as files (hidden/{shard}.safetensors); the others'
    states are fetched from the capture servers by the jobs that read them (`hidden.store`)."""

    training: tuple[str, ...]
    heldout: tuple[str, ...]
    stored_training: tuple[str, ...]
    stored_heldout: tuple[str, ...]

    @property
    def shards(self) -> tuple[str, ...]:
        return tuple(sorted(self.training + self.heldout))

    @property
    def stored(self) -> tuple[str, ...]:
        return self.stored_training + self.stored_heldout

    def stored_among(self, shards: Iterable[str]) -> list[str]:
        return [s for s in shards if s in self.stored]

    def fetched_among(self, shards: Iterable[str]) -> list[str]:
        """Those of `shards` whose states the capture servers give."""
        return [s for s in shards if s not in self.stored]


def heldout_shards(config: Mapping[str, Any], shards: list[str]) -> list[str]:
    """The held-out shards of `train.eval_shards` (the last N, or a list of ids), refused when
    it names shards the run does not have or holds out every one."""
    wanted = config["train"]["eval_shards"]
    if isinstance(wanted, int):
        heldout = shards[len(shards) - wanted :] if wanted else []
    else:
        unknown = sorted(set(wanted) - set(shards))
        if unknown:
            raise ValueError(
                f"config key 'train.eval_shards' names shards {unknown} that this run does "
                f"not have (shards: {shards[0]}..{shards[-1]})"
            )
        heldout = [s for s in shards if s in wanted]
    if len(heldout) == len(shards):
        raise ValueError(
            f"config key 'train.eval_shards' holds out every shard ({len(shards)}): "
            "nothing is left to train on"
        )
    return heldout


def split_shards(
    config: Mapping[str, Any],
    store: str | None = None,
    cache_gb: float | None = None,
    hidden_size: int | None = None,
    warn: bool = True,
) -> ShardSplit:
    """The one split of a validated config's shards, which the rules, `eaglenest plan` and
    experiments/ all use. `store` and `cache_gb` default to the config's `hidden.store` and
    `hidden.cache_gb` (the plan asks for every mode); `hidden_size` to the target's (budget only).

    budget stores the first training shards whose estimated states fit in `cache_gb` together
    (run/store.py: the shard's samples at half of `generation.max_tokens` each), decided from
    the config alone so that every parse plans the same DAG; held-out shards are stored only
    with `files`, as evaluation reads them once. A fixed split, not a cache: `warn` logs when
    no shard fits and how the stored shards written so far weigh (run/store.budget_warnings)."""
    shards = shard_ids(config)
    heldout = heldout_shards(config, shards)
    training = [s for s in shards if s not in heldout]
    store = store or config["hidden"]["store"]
    if store == "files":
        return ShardSplit(tuple(training), tuple(heldout), tuple(training), tuple(heldout))
    kept = 0
    if store == "budget":
        budget = config["hidden"]["cache_gb"] if cache_gb is None else cache_gb
        sizes = training_shard_bytes(config, training, hidden_size)
        kept = shards_that_fit(budget, sizes)
    split = ShardSplit(tuple(training), tuple(heldout), tuple(training[:kept]), ())
    if store == "budget" and warn:
        for note in budget_notes(config, split, budget, hidden_size):
            log.warning("%s", note)
    return split


def training_shard_bytes(
    config: Mapping[str, Any], training: list[str], hidden_size: int | None = None
) -> list[float]:
    """The estimated hidden-state bytes of each training shard (run/store.py)."""
    per_sample = estimated_sample_bytes(config, hidden_size)
    return [per_sample * len(range(*shard_bounds(config, s))) for s in training]


def budget_notes(
    config: Mapping[str, Any], split: ShardSplit, cache_gb: float, hidden_size: int | None = None
) -> list[str]:
    """run/store.budget_warnings for a budget split, with the stored shards' files already
    written in the run's hidden/ (relative to the working directory, as the rules' paths)."""
    sizes = training_shard_bytes(config, list(split.training), hidden_size)
    hidden_dir = Path("results") / config["run"] / "hidden"
    measured = measured_shard_bytes(hidden_dir, split.stored_training)
    return budget_warnings(cache_gb, sizes, list(split.stored_training), measured)
