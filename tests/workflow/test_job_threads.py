"""Every job uses the threads its rule declares, and no rule declares the whole machine.

Snakemake plans a job's `threads` from its rule (capped by --cores) and gives a `script:` job
OMP_NUM_THREADS; polars and the tokenizers' pool do not read it and size their pools once, when
they load, so each adapter applies the job's threads first (eaglenest.common.threads). The demo
target's build once declared every core of the machine (`os.cpu_count()`): beside another torch
job on 2 cores its training steps took 4-15 s instead of 0.7 s.

The plan is read from a real Snakemake dry run with many cores; the helper is checked in a fresh
process, with the libraries loaded after it as an adapter loads them."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from support.workflow import copy_workflow, snakemake

REPO = Path(__file__).resolve().parents[2]
MANY_CORES = 64  # more than any rule needs: a plan that follows the machine would show it


def declared_threads() -> dict[str, str]:
    """rule -> the source of its `threads:` directive."""
    declared = {}
    for smk in sorted((REPO / "rules").glob("*.smk")):
        for block in re.split(r"^rule ", smk.read_text(), flags=re.MULTILINE)[1:]:
            threads = re.search(r"^\s+threads:\s*(.+)$", block, flags=re.MULTILINE)
            declared[block.split(":", 1)[0]] = threads.group(1).strip() if threads else "1"
    return declared


def planned_threads(stdout: str) -> dict[str, int]:
    """rule -> threads of its jobs in a dry run (Snakemake prints `threads:` only above 1)."""
    planned: dict[str, int] = {}
    for block in re.split(r"^(?:\[.*\]\n)?rule |^localrule ", stdout, flags=re.MULTILINE)[1:]:
        name = block.split(":", 1)[0]
        threads = re.search(r"^\s+threads: (\d+)$", block, flags=re.MULTILINE)
        planned[name] = max(planned.get(name, 0), int(threads.group(1)) if threads else 1)
    return planned


@pytest.mark.slow
def test_each_job_plans_the_threads_its_rule_declares(tmp_path):
    workdir = copy_workflow(tmp_path / "wf")
    result = snakemake(workdir, "-n", cores=MANY_CORES)
    assert result.returncode == 0, result.stdout + result.stderr
    planned = planned_threads(result.stdout)
    declared = declared_threads()
    assert "build_demo_target" in planned and "train_drafter" in planned, result.stdout[-3000:]
    for rule, threads in planned.items():
        if rule == "all":
            continue
        source = declared[rule]
        # A number in the rule, or a get_*_threads() of rules/common.smk that reads the config.
        assert re.fullmatch(r"\d+|get_\w+_threads\(\)", source), (
            f"rule {rule} declares `threads: {source}`: a number it needs, not the machine's"
        )
        if source.isdigit():
            assert threads == int(source), (rule, threads, source)
        assert threads <= 2, f"rule {rule} plans {threads} threads with --cores {MANY_CORES}"
    assert planned["build_demo_target"] == 2


def test_use_threads_sizes_every_pool_loaded_after_it():
    code = """
import json, os, sys
from eaglenest.common.threads import use_threads
use_threads(1)
import polars, torch
from tokenizers import Tokenizer
print(json.dumps({"torch": torch.get_num_threads(), "polars": polars.thread_pool_size(),
                  "rayon": os.environ["RAYON_NUM_THREADS"], "omp": os.environ["OMP_NUM_THREADS"]}))
"""
    env = {"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "7", "POLARS_MAX_THREADS": "7"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert json.loads(out.stdout) == {"torch": 1, "polars": 1, "rayon": "1", "omp": "1"}


def test_use_threads_sets_a_loaded_torch_and_gives_one_to_a_job_without_cores():
    code = """
import torch
from eaglenest.common.threads import job_threads, use_threads
torch.set_num_threads(2)
assert use_threads(0) == 1 and torch.get_num_threads() == 1 and job_threads() == 1
"""
    subprocess.run([sys.executable, "-c", code], check=True)


def test_every_adapter_applies_its_jobs_threads_before_anything_loads():
    for script in sorted((REPO / "scripts").glob("*.py")):
        body = ast.parse(script.read_text()).body
        first, second = (ast.unparse(node) for node in body[:2])
        assert first == "from eaglenest.common.threads import use_threads", script.name
        assert second == "use_threads(snakemake.threads)", script.name
