"""A bad config fails Snakemake before any job runs, naming the key (real Snakemake, dry run, in a
temp copy of the workflow); the library's validation is tests/unit/common/test_config.py."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("probe:\n  max_tokenz: 3\n", "probe.max_tokenz"),
        ("server:\n  max_batch_size: many\n", "server.max_batch_size"),
    ],
)
def test_snakemake_fails_naming_the_key(tmp_path, override, expected):
    for name in ("Snakefile", "rules", "scripts", "config", "profiles"):
        src = REPO / name
        dst = tmp_path / name
        shutil.copytree(src, dst) if src.is_dir() else shutil.copy(src, dst)
    (tmp_path / "bad.yaml").write_text(override)
    result = subprocess.run(
        [sys.executable, "-m", "snakemake", "-n", "--configfile", "bad.yaml", "--cores", "1"],
        check=False,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0
    assert expected in result.stdout + result.stderr
