"""Which GPUs a job uses when several GPU jobs share one machine (`profiles/gpu-node`).

Snakemake's `--resources gpu=N` only counts: it lets N GPU jobs run at once but does not say which
GPU each one gets, so every job would see (and `device_map="auto"` would spread over) all of them.
A job claims GPUs with an exclusive `flock` on one file per GPU index, then sets
`CUDA_VISIBLE_DEVICES` before CUDA starts. The kernel drops the locks when the process ends, also
when it is killed, so a crashed job never keeps a GPU.

Nothing is claimed when a scheduler already chose the devices (SLURM and Kubernetes set
`CUDA_VISIBLE_DEVICES`) or the machine has no GPU.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

log = logging.getLogger(__name__)

LOCK_DIR = Path(tempfile.gettempdir()) / "eaglenest-gpu-locks"


def visible_gpu_count() -> int:
    """GPUs of this machine, from nvidia-smi (asking torch would start CUDA before we choose)."""
    if shutil.which("nvidia-smi") is None:
        return 0
    listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, check=False)
    return sum(line.startswith("GPU ") for line in listed.stdout.splitlines())


class GpuClaim:
    """Held while it lives (its open files hold the locks): `with claim_gpus(n):` around a job's
    work, or `release()`."""

    def __init__(self, indices: list[int], handles: list):
        self.indices = indices
        self._handles = handles  # open files holding the locks

    def release(self) -> None:
        for handle in self._handles:
            handle.close()
        self._handles = []

    def __enter__(self) -> GpuClaim:  # noqa: PYI034
        return self

    def __exit__(self, *_exc) -> None:
        self.release()


def claim_gpus(
    count: int,
    *,
    total: int | None = None,
    lock_dir: Path = LOCK_DIR,
    timeout_s: float = 3600.0,
    environ: dict[str, str] | None = None,
) -> GpuClaim:
    """Lock `count` free GPU indices (waiting up to timeout_s) and point CUDA_VISIBLE_DEVICES at
    them in `environ` (os.environ by default). The locks last as long as the returned claim."""
    environ = os.environ if environ is None else environ
    if count <= 0 or environ.get("CUDA_VISIBLE_DEVICES") is not None:
        return GpuClaim([], [])
    total = visible_gpu_count() if total is None else total
    if total == 0:
        return GpuClaim([], [])
    if count > total:
        raise RuntimeError(f"this job needs {count} GPUs but the machine has {total}")
    lock_dir.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + timeout_s
    while True:
        handles, indices = [], []
        for index in range(total):
            handle = open(lock_dir / f"gpu{index}.lock", "w")  # noqa: SIM115 (held while claimed)
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                handle.close()
                continue
            handles.append(handle)
            indices.append(index)
            if len(indices) == count:
                environ["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, indices))
                log.info("claimed GPU(s) %s", environ["CUDA_VISIBLE_DEVICES"])
                return GpuClaim(indices, handles)
        for handle in handles:  # not enough free: let go and wait, so two jobs never deadlock
            handle.close()
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {count} free GPU(s) of {total} after {timeout_s:.0f} s")
        time.sleep(1.0)
