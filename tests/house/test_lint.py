"""Cleanliness gate: the workflow is snakefmt-formatted (its `snakemake --lint`, which runs
Snakemake, is tests/workflow/test_snakemake_lint.py)."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def run(*command: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        command, cwd=REPO, capture_output=True, text=True, timeout=300, check=False
    )


def test_snakefmt_check_passes():
    result = run(str(BIN / "snakefmt"), "--check", "Snakefile", "rules/")
    assert result.returncode == 0, result.stdout + result.stderr
