"""Reading report.device.file, bench/gpu_check.py's device_timings.json, as every other input is
read: a regular file under MAX_FILE_BYTES (a FIFO is never opened: reading one waits for a
writer forever), JSON of the shape bench/_device_timings.py writes, and every figure the choice
counts in a finite number, checked before the report sees it. Each refusal is a ValueError
naming the file and the key inside it.

The shape (keys not listed here are kept by the bench for people and not read):

    {"device_timings": {"device": "NVIDIA H200",
                        "by_batch": {"1": {"drafter_ratio": 0.02,
                                           "verify_cost": {"3": 1.01, "7": 1.03}}, ...}}}

Batch sizes and K are written as canonical positive integers ("8", never "08"): the report looks
a K up as str(k), so "007" would silently drop out of the choice.
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
from pathlib import Path
from typing import Any

KEY = "report.device"
# The bench writes a few KB; a bound far above that keeps a wrong path (a dataset, a 3 GB log)
# from being read whole at every parse of the workflow.
MAX_FILE_BYTES = 1 << 20
CANONICAL_INTEGER = re.compile(r"[1-9][0-9]*")


class DeviceFileError(ValueError):
    """report.device.file cannot be used as it is; the message names the file and the key."""


def is_number(value: Any) -> bool:
    """A finite int or float, not a bool (bool is a subclass of int: `true` would read as 1)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def is_positive_integer_key(key: Any) -> bool:
    """ "1", "32": the spelling str(int) gives back, so a lookup by str(k) finds it."""
    return isinstance(key, str) and CANONICAL_INTEGER.fullmatch(key) is not None


def read_bounded_json(path: str | Path, where: str) -> Any:
    """The JSON value of the regular file `path`, at most MAX_FILE_BYTES (ValueError naming
    `where`). The type and size come from stat before the file is opened; the open does not
    block and is checked again (a FIFO swapped in between is still never read)."""
    try:
        found = os.stat(path)
        _check_regular(found, where)
        descriptor = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        with os.fdopen(descriptor, "rb") as stream:
            _check_regular(os.fstat(stream.fileno()), where)
            raw = stream.read(MAX_FILE_BYTES + 1)
    except OSError as err:
        raise DeviceFileError(f"{where}: cannot be read ({err.strerror})") from None
    if len(raw) > MAX_FILE_BYTES:
        raise DeviceFileError(
            f"{where}: larger than {MAX_FILE_BYTES:,} bytes, the most it may hold"
        )
    try:
        return json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as err:
        raise DeviceFileError(f"{where}: not UTF-8 ({err.reason} at byte {err.start})") from None
    except json.JSONDecodeError as err:
        raise DeviceFileError(f"{where}: not JSON: {err}") from None
    except RecursionError:
        raise DeviceFileError(f"{where}: nested too deeply to be a device timings file") from None


def _check_regular(found: os.stat_result, where: str) -> None:
    if not stat.S_ISREG(found.st_mode):
        raise DeviceFileError(f"{where}: not a regular file (a FIFO, device or folder is not read)")
    if found.st_size > MAX_FILE_BYTES:
        raise DeviceFileError(
            f"{where}: {found.st_size:,} bytes, larger than {MAX_FILE_BYTES:,}, the most it may "
            "hold (bench/gpu_check.py writes a few KB)"
        )


def read_timings_file(path: str | Path, batch: int) -> dict[str, Any]:
    """The figures of bench/gpu_check.py's device_timings file at `batch`: name, drafter_ratio,
    verify_cost (ValueError naming report.device.file and the key that is wrong or missing)."""
    where = f"{KEY}.file ({path})"
    data = read_bounded_json(path, where)
    timings = data.get("device_timings", data) if isinstance(data, dict) else None
    if not isinstance(timings, dict) or not isinstance(timings.get("by_batch"), dict):
        # A config error: ValueError, as the rest.
        raise DeviceFileError(f"{where}: no device_timings.by_batch (bench/gpu_check.py's step)")
    by_batch = timings["by_batch"]
    for key in by_batch:
        if not is_positive_integer_key(key):
            raise DeviceFileError(
                f"{where}: device_timings.by_batch: {key!r} is not a batch size written as an "
                "integer (1, 8, 32)"
            )
    device = timings.get("device", "device")
    if not isinstance(device, str):
        raise DeviceFileError(
            f"{where}: device_timings.device: {device!r} is not a name (a string)"
        )
    if str(batch) not in by_batch:
        raise DeviceFileError(
            f"{KEY}.batch: {batch} is not among the file's batch sizes {sorted(by_batch, key=int)}"
        )
    return {
        "name": f"{device}, batch {batch}",
        **_batch_figures(by_batch[str(batch)], batch, where),
    }


def _batch_figures(at: Any, batch: int, where: str) -> dict[str, Any]:
    """drafter_ratio and verify_cost of one by_batch entry, their shape checked (their values
    are checked with the config's, in settings/report.py's check_timings)."""
    key = f"device_timings.by_batch.{batch}"
    if not isinstance(at, dict):
        raise DeviceFileError(
            f"{where}: {key}: {type(at).__name__} {_short(at)}, not an object of drafter_ratio "
            "and verify_cost"
        )
    costs = at.get("verify_cost")
    if costs is None:
        costs = {}
    if not isinstance(costs, dict):
        raise DeviceFileError(
            f"{where}: {key}.verify_cost: {type(costs).__name__} {_short(costs)}, not an object "
            "of K -> cost"
        )
    for k, cost in costs.items():
        if not is_positive_integer_key(k):
            raise DeviceFileError(
                f"{where}: {key}.verify_cost: {k!r} is not a K written as an integer (3, 7, 15)"
            )
        if not is_number(cost):
            raise DeviceFileError(
                f"{where}: {key}.verify_cost.{k}: {_short(cost)} is not a finite number"
            )
    ratio = at.get("drafter_ratio")
    if ratio is not None and not is_number(ratio):
        raise DeviceFileError(
            f"{where}: {key}.drafter_ratio: {_short(ratio)} is not a finite number"
        )
    return {"drafter_ratio": ratio, "verify_cost": costs}


def _short(value: Any) -> str:
    """The value as the file spells it (true, NaN), cut short."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError, RecursionError):
        text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
