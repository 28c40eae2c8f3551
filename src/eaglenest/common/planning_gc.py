"""Python's garbage collector while Snakemake plans a large DAG.

Planning thousands of shards builds hundreds of thousands of objects (jobs, files, wildcards) that
all live until the run ends. Python's full collections rescan every one of them each time the
heap has grown by a quarter, and free nothing: 4-4.5 s of a 5,000-shard dry run on this 2-core
machine (about 11%; see bench/dag.py). The workflow postpones full collections while it is parsed
and planned, then, once the DAG exists (Snakemake's `onstart`), moves the DAG out of the
collector's reach (`gc.freeze`) and restores the usual thresholds for the run itself.

Young-generation collections are left alone: they are cheap and free the short-lived cycles.
"""

from __future__ import annotations

import gc

# Full collections wait for this many young-generation (1) collections instead of 10: none happen
# while a DAG of 15,000 jobs is planned (about 600 young collections), some still do in a long run.
PLANNING_FULL_COLLECTION_THRESHOLD = 1000


def postpone_full_collections() -> tuple[int, int, int]:
    """Raise the full-collection threshold for planning; return the thresholds it replaced."""
    saved = gc.get_threshold()
    gc.set_threshold(saved[0], saved[1], max(saved[2], PLANNING_FULL_COLLECTION_THRESHOLD))
    return saved


def resume_full_collections(saved: tuple[int, int, int]) -> None:
    """Freeze what exists (the planned DAG, which lives to the end) and restore `saved`."""
    gc.freeze()
    gc.set_threshold(*saved)
