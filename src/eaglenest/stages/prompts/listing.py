"""The ordered prompt list: every row of the source normalised, deduplicated by id, and ordered by
a seeded hash of its row position. The order never depends on `max_samples`, so a longer list
starts with the shorter one."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from eaglenest.settings.prompts import PromptOptions
from eaglenest.stages.prompts.normalise import SKIP_REASONS, RowSkipped, normalise_record, prompt_id
from eaglenest.stages.prompts.sources import PromptSource

ROWS_PER_CHUNK = 4096  # rows fetched from the source at once, and rows per written chunk
_EXAMPLES_PER_REASON = 3
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
    for start in range(0, len(order), ROWS_PER_CHUNK):
        for record, name, index in source.take(order[start : start + ROWS_PER_CHUNK]):
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
