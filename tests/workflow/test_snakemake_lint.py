"""Cleanliness gate that runs Snakemake: the workflow lints clean (`snakemake --lint`); the
formatting gate is tests/house/test_lint.py."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def run(*command: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        command, cwd=REPO, capture_output=True, text=True, timeout=300, check=False
    )


def test_snakemake_lint_reports_nothing():
    result = run(sys.executable, "-m", "snakemake", "--lint")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Congratulations, your workflow is in a good condition" in result.stdout + result.stderr
