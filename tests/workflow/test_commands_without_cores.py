"""Commands a user types with no other flag in the project directory work without `--cores`:
`snakemake --unlock` after a killed run (what Snakemake itself tells them to type), a dry run,
the rule list and the summary. A rule whose threads need the total number of cores
(`workflow.cores`) fails all of them at parse time."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from support.workflow import copy_workflow

pytestmark = pytest.mark.slow

COMMANDS = ("--unlock", "-n", "--list-rules", "--summary")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return copy_workflow(tmp_path_factory.mktemp("no-cores"))


@pytest.mark.parametrize("flag", COMMANDS)
def test_command_needs_no_cores(workdir: Path, flag: str):
    # Only the flag: profiles/default/config.yaml applies as it does to a user's plain command.
    result = subprocess.run(
        [sys.executable, "-m", "snakemake", flag],
        cwd=workdir,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
