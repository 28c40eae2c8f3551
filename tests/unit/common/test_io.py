"""Atomic writes: all or nothing, with the permissions a plain open gives (shared run dirs)."""

import os
import stat
from pathlib import Path

import polars as pl
import pytest

from eaglenest.common.io import atomic_path, temp_beside, write_json


@pytest.fixture
def umask():
    """Set the process umask for one test; the old one comes back after it."""
    previous = os.umask(0o022)
    yield lambda mask: os.umask(mask)
    os.umask(previous)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.mark.parametrize(("mask", "expected"), [(0o022, 0o644), (0o002, 0o664), (0o077, 0o600)])
def test_atomic_files_get_the_umask_mode_not_mkstemps_0600(tmp_path, umask, mask, expected):
    umask(mask)
    with atomic_path(tmp_path / "a.txt") as tmp:
        tmp.write_text("a")
    write_json(tmp_path / "b.json", {"b": 1})
    with atomic_path(tmp_path / "c.parquet") as tmp:
        pl.DataFrame({"c": [1]}).write_parquet(tmp)
    for name in ("a.txt", "b.json", "c.parquet"):
        assert mode(tmp_path / name) == expected, name
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "b.json", "c.parquet"]


def test_replacing_a_file_gives_the_new_one_the_umask_mode(tmp_path, umask):
    target = tmp_path / "x.json"
    target.write_text("{}")
    target.chmod(0o600)
    umask(0o002)
    write_json(target, {"x": 1})
    assert mode(target) == 0o664


def test_temp_directories_get_the_umask_mode(tmp_path, umask):
    umask(0o002)
    made = temp_beside(tmp_path / "d", directory=True)
    assert made.is_dir() and made.name.startswith(".d.") and made.name.endswith(".tmp")
    assert mode(made) == 0o775


def test_a_failed_block_leaves_neither_file_nor_temp(tmp_path):
    target = tmp_path / "out.txt"
    with pytest.raises(RuntimeError), atomic_path(target) as tmp:
        tmp.write_text("half")
        raise RuntimeError("killed")
    assert list(tmp_path.iterdir()) == []
