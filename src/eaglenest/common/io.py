"""File helpers shared by every stage: atomic writes so a killed job never leaves a file that
looks complete, with the permissions a plain `open` would give (the umask's, not mkstemp's 0600:
run directories are often shared on a cluster)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any


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


@contextlib.contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path beside `path`; rename it onto `path` only if the block succeeds.

    The file has the permissions a plain `open` gives (see `temp_beside`)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_beside(path)
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
