"""A finished run's outputs, one digest a file, leaving out what measures time (wall, seconds,
latency, rates, timestamps, paths, versions), so that two runs of the same inputs by two versions
of the code compare equal where they computed the same things (a refactoring's check):

    python experiments/fingerprint.py results/demo > after.txt; diff before.txt after.txt

Tensors are compared bit for bit, frames row by row, JSON key by key (floats to 6 digits).
Pictures and HTML are listed without a digest."""

from __future__ import annotations

import hashlib
import json
import re
import sys
from pathlib import Path

import torch

TIMEY = re.compile(
    r"(^|_)(s|wall|seconds|latency|time|timestamp|started|finished|created|elapsed|duration"
    r"|per_s|tokens_per_s|per_second|speedup|speed_up|date|host|pid|path|paths|workdir|log)"
    r"($|_)|_s$|_s_|rate|busy|wait|throughput|versions?$|cpu",
    re.IGNORECASE,
)


def clean(value):
    if isinstance(value, dict):
        return {k: clean(v) for k, v in sorted(value.items()) if not TIMEY.search(str(k))}
    if isinstance(value, list):
        return [clean(v) for v in value]
    if isinstance(value, float):
        return round(value, 6)
    return value


def digest(path: Path) -> str:
    h = hashlib.sha256()
    if path.suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
            for name in sorted(f.keys()):
                t = f.get_tensor(name)
                h.update(name.encode() + str(t.dtype).encode() + str(tuple(t.shape)).encode())
                h.update(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        h.update(json.dumps(clean({k: v for k, v in meta.items()}), sort_keys=True).encode())
    elif path.suffix == ".parquet":
        import polars as pl

        frame = pl.read_parquet(path)
        unstable = ("raw", "response", "usage", "endpoint")  # server ids, dates, counts of time
        keep = [c for c in frame.columns if not TIMEY.search(c) and c not in unstable]
        h.update(json.dumps(keep).encode())
        rows = clean(frame.select(keep).to_dicts())
        h.update(json.dumps(rows, sort_keys=True, default=str).encode())
    elif path.suffix == ".json":
        h.update(json.dumps(clean(json.loads(path.read_text())), sort_keys=True).encode())
    elif path.suffix == ".jsonl":
        for line in path.read_text().splitlines():
            h.update(json.dumps(clean(json.loads(line)), sort_keys=True).encode())
    else:
        return "-"
    return h.hexdigest()[:16]


if __name__ == "__main__":
    root = Path(sys.argv[1])
    for path in sorted(p for p in root.rglob("*") if p.is_file() and "journal" not in p.parts):
        print(f"{digest(path)}  {path.relative_to(root)}")
