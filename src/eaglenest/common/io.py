"""File helpers shared by every stage: atomic writes so a killed job never leaves a file that
looks complete, with the permissions a plain `open` would give (the umask's, not mkstemp's 0600:
run directories are often shared on a cluster).

A killed job (SIGKILL, power loss) cannot remove its temporary file, and a hidden-state shard's
is shard-sized: so before a new one is made, the earlier ones beside the same output are removed,
except any a live writer holds (each writer holds an flock on its temporary file until done; the
kernel drops it when the writer dies)."""

from __future__ import annotations

import contextlib
import fcntl
import glob
import hashlib
import json
import os
import re
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

TEMP_PATTERN = r"\.{name}\.[0-9a-f]{{8}}\.tmp"


def temp_beside(path: Path, directory: bool = False) -> Path:
    """Create and return a new empty file (or directory) `.{name}.{random}.tmp` beside `path`.

    Created like `open(..., "w")` and `mkdir` create: mode 0666 (0777) less the umask, default
    ACLs applied by the kernel; `tempfile.mkstemp`/`mkdtemp` make them 0600/0700, which a
    rename would carry onto the output and lock everyone else out of a shared run directory.
    """
    for _ in range(100):
        candidate = path.parent / f".{path.name}.{secrets.token_hex(4)}.tmp"
        try:
            if directory:
                os.mkdir(candidate, 0o777)
            else:
                os.close(os.open(candidate, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
        except FileExistsError:
            continue
        return candidate
    raise FileExistsError(f"no free temporary name beside {path}")


def _lock_held(path: Path) -> int | None:
    """An open descriptor holding an exclusive flock on `path`, or None when another process
    holds one (or the file went away)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def remove_stale_temps(path: Path) -> list[Path]:
    """Remove the temporary siblings of `path` (`.{name}.{hex}.tmp`) no live writer holds."""
    pattern = re.compile(TEMP_PATTERN.format(name=re.escape(path.name)))
    removed = []
    for sibling in path.parent.glob(f".{glob.escape(path.name)}.*.tmp"):
        if not pattern.fullmatch(sibling.name):
            continue
        fd = _lock_held(sibling)
        if fd is None:
            continue
        try:
            if sibling.is_dir() and not sibling.is_symlink():
                shutil.rmtree(sibling)
            else:
                sibling.unlink()
            removed.append(sibling)
        finally:
            os.close(fd)
    return removed


@contextlib.contextmanager
def held_temp_beside(path: Path, directory: bool = False) -> Iterator[Path]:
    """`temp_beside`, after removing stale siblings, with an flock held on it for the block."""
    remove_stale_temps(path)
    tmp = temp_beside(path, directory)
    fd = os.open(tmp, os.O_RDONLY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield tmp
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path beside `path`; rename it onto `path` only if the block succeeds.

    The file has the permissions a plain `open` gives (see `temp_beside`)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with held_temp_beside(path) as tmp:
        try:
            yield tmp
            os.replace(tmp, path)
        finally:
            if tmp.exists():
                tmp.unlink()


def sha256_file(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def library_versions() -> dict[str, str]:
    """Versions recorded in the metadata of what a stage writes."""
    import torch
    import transformers

    import eaglenest

    return {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "eaglenest": eaglenest.__version__,
    }


def write_json(path: str | Path, data: Any) -> None:
    """Write JSON atomically, sorted and indented so diffs between runs are readable."""
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


def read_json(path: str | Path) -> Any:
    return json.loads(Path(path).read_text())
