"""Cleanliness gates: the workflow lints clean and is snakefmt-formatted."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def run(*command: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        command, cwd=REPO, capture_output=True, text=True, timeout=300, check=False
    )


def test_snakemake_lint_reports_nothing():
    result = run(sys.executable, "-m", "snakemake", "--lint")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Congratulations, your workflow is in a good condition" in result.stdout + result.stderr


def test_snakefmt_check_passes():
    result = run(str(BIN / "snakefmt"), "--check", "Snakefile", "rules/")
    assert result.returncode == 0, result.stdout + result.stderr
