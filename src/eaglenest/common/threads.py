"""The CPU threads a job may use, applied to every library that sizes a thread pool.

Snakemake gives a `script:` job OMP_NUM_THREADS (and the BLAS variables) equal to its rule's
`threads`, which torch follows; polars (POLARS_MAX_THREADS) and the tokenizers' Rust pool
(RAYON_NUM_THREADS) do not read it, and both size their pools once, when they load. So an adapter
calls `use_threads(snakemake.threads)` before it imports anything else of ours: on a machine whose
cores jobs share, a job with more threads than its cores makes every parallel step wait for its
slowest thread (measured: a training step of the demo target took 4-15 s instead of 0.7 s beside
another torch job on 2 cores).

Imports nothing heavy: torch is set only when it is already loaded (it reads OMP_NUM_THREADS
when it loads later), so the job pays for no import it does not make.
"""

from __future__ import annotations

import os
import sys

# The variables a job's thread count goes to; processes the job starts (the embedded server,
# vLLM, torchrun) inherit them.
THREAD_VARIABLES = (
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "OPENBLAS_NUM_THREADS",
    "POLARS_MAX_THREADS",
    "RAYON_NUM_THREADS",
    "EAGLENEST_THREADS",
)


def use_threads(threads: int) -> int:
    """Make this process, and what it starts, use `threads` CPU threads (a job's
    snakemake.threads; 0, a job that only waits on HTTP, gets 1). Returns the number applied."""
    threads = max(1, int(threads))
    for name in THREAD_VARIABLES:
        os.environ[name] = str(threads)
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(threads)
    return threads


def job_threads(default: int | None = None) -> int:
    """The threads `use_threads` gave this process's job (inherited by its children), else
    `default`, else every core."""
    value = os.environ.get("EAGLENEST_THREADS")
    return max(1, int(value) if value else default or os.cpu_count() or 1)
