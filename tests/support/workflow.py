"""The workflow in a temp dir, for tests, benches and experiments: the test configs of
config/tests/, a copy of the workflow, real Snakemake runs in it, the job counts of a dry run and
configs merged over the demo. The finished run itself is a session fixture in tests/conftest.py
(`finished_run`), built once for every module that needs it.

Tests import it as `support.workflow` (tests/ is on pytest's path); benches and experiments put
tests/ on sys.path first."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import yaml

from support.workers import CORES

REPO = Path(__file__).resolve().parents[2]
# src/ goes along: rules/common.smk puts the workdir's src/ first on sys.path, so code versions are
# hashed from this snapshot (edits elsewhere in the tree during a test session change nothing).
WORKFLOW_FILES = ("Snakefile", "rules", "scripts", "config", "profiles", "envs", "src")

# The configs a person can also run by hand, each over the embedded demo and under its own `run:`
# name (`snakemake --cores 2 --configfile config/config.yaml <file>`: the Snakefile reads the demo
# only when no --configfile is given, so a variant of the demo names it first).
TEST_CONFIGS = REPO / "config" / "tests"
DEMO_CONFIGFILE = "config/config.yaml"


def load_test_config(name: str) -> dict:
    """config/tests/<name>.yaml as a dict."""
    return yaml.safe_load((TEST_CONFIGS / f"{name}.yaml").read_text())


# The small demo (2 shards of 20 prompts, a small target, short training) that `finished_run` runs.
SMALL_DEMO = load_test_config("demo-small")
SMALL_RUN = SMALL_DEMO["run"]


def copy_workflow(workdir: Path) -> Path:
    """The workflow's files in `workdir` (created when missing), ready for `snakemake` there."""
    workdir.mkdir(parents=True, exist_ok=True)
    for name in WORKFLOW_FILES:
        src = REPO / name
        if src.is_dir():
            shutil.copytree(src, workdir / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(src, workdir / name)
    return workdir


def copy_workflow_with_target(workdir: Path, target_dir: Path) -> Path:
    """`copy_workflow` with the demo target already in place under results/{SMALL_RUN}/target
    (no provenance: Snakemake plans every job after it, and never its build)."""
    copy_workflow(workdir)
    shutil.copytree(target_dir, workdir / "results" / SMALL_RUN / "target")
    return workdir


def copy_run(workdir: Path, dest: Path) -> Path:
    """A copy of a workdir where Snakemake ran: file times and .snakemake's records kept, so
    Snakemake plans there what it would plan in the original."""
    shutil.copytree(workdir, dest, symlinks=True)
    return dest


def snakemake_command(
    *args: str, cores: int = CORES, configfiles: Sequence[Path] = ()
) -> list[str]:
    """`python -m snakemake --cores N ARGS` (N: the worker's cores), with `configfiles` over the demo's config when given
    (after the targets: --configfile takes every file name after it)."""
    command = [sys.executable, "-m", "snakemake", "--cores", str(cores), *args]
    if configfiles:  # variants of the demo
        command += ["--configfile", DEMO_CONFIGFILE, *[str(p) for p in configfiles]]
    return command


def snakemake(
    workdir: Path,
    *args: str,
    config: dict | None = None,
    cores: int = CORES,
    env: dict[str, str] | None = None,
    timeout_s: float = 900,
) -> subprocess.CompletedProcess:
    """`snakemake --cores N ARGS` in `workdir`, output captured; `config` (a variant of the demo)
    is written to workdir/override.yaml and given over the demo's config."""
    configfiles = []
    if config is not None:
        path = workdir / "override.yaml"
        path.write_text(yaml.safe_dump(config))
        configfiles.append(path)
    return subprocess.run(
        snakemake_command(*args, cores=cores, configfiles=configfiles),
        cwd=workdir,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )


def job_logs(workdir: Path) -> str:
    """The tail of every job log under workdir/logs, for assertion messages."""
    return "\n".join(p.read_text()[-3000:] for p in sorted((workdir / "logs").rglob("*.log")))


def planned_jobs(result: subprocess.CompletedProcess) -> dict[str, int]:
    """Job counts per rule from a dry run's 'Job stats' table ({} when nothing to do)."""
    assert result.returncode == 0, result.stdout + result.stderr
    counts: dict[str, int] = {}
    in_table = False
    for line in result.stdout.splitlines():
        if line.startswith("job ") and "count" in line:
            in_table = True
            continue
        if in_table:
            match = re.match(r"^(\w+)\s+(\d+)$", line.strip())
            if match and match.group(1) != "total":
                counts[match.group(1)] = int(match.group(2))
            elif line.strip() and not line.startswith("---") and not match:
                break
    return counts


def merged(base: dict, change: dict) -> dict:
    """A copy of the config `base` with each section of `change` updated over its own."""
    out = json.loads(json.dumps(base))
    for section, values in change.items():
        out.setdefault(section, {}).update(values)
    return out
