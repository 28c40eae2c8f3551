"""The lanes are folders: tests/workflow/'s conftest marks its tests `snakemake`, tests/engine/'s
`vllm`, and the quick lane (`make check`) is what neither marks (nor `slow`). Nothing is inferred
at collection; instead this house test reads what every test's code reaches (support/lanes.py)
and fails when one outside those folders starts Snakemake or vLLM, so the lanes stay honest."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

from support.lanes import (
    CHECK_LANE,
    COLLECTED,
    SNAKEMAKE,
    TESTS_DIR,
    VLLM,
    lane_violations,
)

REPO = TESTS_DIR.parent
# The engine modules at the top of tests/ until they move to tests/engine/ (issue 37), marked
# `vllm` by hand there; a file is "relative to" itself, so they count as the engine folder.
# A new test module as someone might write it, none of its tests marked by hand.
NEW_MODULE = """
import subprocess, sys
import pytest
from support.vllm import require_vllm_venv
from support.workflow import snakemake


def dry_run(workdir):
    return snakemake(workdir, "-n")


def lint():
    return subprocess.run([sys.executable, "-m", "snakemake", "--lint"], check=False)


@pytest.fixture
def planned(tmp_path):
    return dry_run(tmp_path)


def test_plain():
    assert True


def test_reads_the_word_without_running_it():
    assert "snakemake" in "snakemake.config"


def test_a_helper_starts_snakemake():
    lint()


def test_a_fixture_runs_the_workflow(planned):
    pass


def test_against_vllm():
    require_vllm_venv()
"""
# The lanes of a tree like tests/ (workflow/, engine/, unit/), and its lane check written out.
NEW_CONFTEST = """
import json
from pathlib import Path
import pytest
from support.lanes import TESTS_DIR, lane_violations, mark_folder

ROOT = Path(__file__).parent


def pytest_collection_modifyitems(items):
    mark_folder(items, ROOT / "workflow", pytest.mark.snakemake)
    mark_folder(items, ROOT / "engine", pytest.mark.vllm)
    folders = {"snakemake": (ROOT / "workflow", ROOT / "engine"), "vllm": (ROOT / "engine",)}
    found = lane_violations(items, roots=(TESTS_DIR, ROOT), folders=folders)
    (ROOT / "violations.json").write_text(json.dumps(found))
"""


def collected(*args: str, cwd: Path = REPO) -> list[str]:
    """The node ids `pytest --collect-only` selects."""
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args],
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": str(TESTS_DIR)},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode in (0, 5), result.stdout + result.stderr  # 5: none selected
    return [line for line in result.stdout.splitlines() if "::" in line]


def names(node_ids: Iterable[str]) -> set[str]:
    return {re.sub(r"\[.*\]$", "", node_id.split("::")[-1]) for node_id in node_ids}


def test_make_check_runs_the_check_lane():
    recipe = re.search(r"^check:.*\n((?:\t.*\n)+)", (REPO / "Makefile").read_text(), re.MULTILINE)
    assert recipe, "the Makefile has a `check` target"
    assert f'-m "{CHECK_LANE}"' in recipe.group(1)


def test_the_workflow_folders_tests_are_out_of_the_check_lane():
    paths = [
        "tests/workflow/test_snakemake_lint.py",
        "tests/workflow/test_config_errors_in_snakemake.py",
        "tests/workflow/test_samples_and_vocab_rules.py",
        "tests/house/test_lint.py",
        "tests/unit/common/test_config.py",
        "tests/unit/common/test_io.py",
        "tests/unit/stages/vocab/test_vocab.py",
    ]
    every = collected(*paths)
    quick = collected("-m", CHECK_LANE, *paths)
    workflow = [n for n in every if n.startswith("tests/workflow/")]
    assert quick and set(quick) < set(every) and workflow
    assert collected("-m", SNAKEMAKE, *paths) == workflow  # marked by their folder
    assert not set(workflow) & set(quick)
    assert names(n for n in quick if "test_lint.py::" in n) == {"test_snakefmt_check_passes"}
    assert "test_snakemake_lint_reports_nothing" not in names(quick)
    assert "test_snakemake_fails_naming_the_key" not in names(quick)
    assert "test_samples_and_vocab_rules_in_snakemake" not in names(quick)
    for module in ("test_config.py", "test_vocab.py"):  # their unit tests stay in
        assert [n for n in quick if n.startswith("tests/unit/") and f"{module}::" in n], module
    assert [n for n in every if "test_io.py::" in n] == [n for n in quick if "test_io.py::" in n]


def test_a_test_that_starts_snakemake_or_vllm_outside_its_lanes_folder_is_named(tmp_path):
    """The check on a new tree: the same module, none of it marked by hand, in a unit folder, the
    workflow folder and the engine folder."""
    (tmp_path / "conftest.py").write_text(NEW_CONFTEST)
    for folder in ("unit", "workflow", "engine"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "test_new.py").write_text(NEW_MODULE)
    options = ["-c", str(REPO / "pyproject.toml"), "--rootdir", str(tmp_path), str(tmp_path)]
    quick = collected("-m", CHECK_LANE, *options, cwd=tmp_path)
    assert {n.split("/")[0] for n in quick} == {"unit"}  # the lanes are the folders
    assert names(quick) == names(collected("unit", *options, cwd=tmp_path))
    assert {n.split("/")[0] for n in collected("-m", VLLM, *options, cwd=tmp_path)} == {"engine"}
    violations = {
        (lane, node_id.split("::")[0].split("/")[0], node_id.split("::")[-1])
        for lane, node_id in json.loads((tmp_path / "violations.json").read_text())
    }
    assert violations == {
        (SNAKEMAKE, "unit", "test_a_helper_starts_snakemake"),
        (SNAKEMAKE, "unit", "test_a_fixture_runs_the_workflow"),
        (VLLM, "unit", "test_against_vllm"),
        (VLLM, "workflow", "test_against_vllm"),
    }


def test_no_test_outside_the_workflow_and_engine_folders_reaches_snakemake_or_vllm(request):
    items = request.config.stash.get(COLLECTED, [])
    every_module = set(TESTS_DIR.rglob("test_*.py"))
    if not every_module <= {Path(item.path) for item in items}:
        # This session collected part of the suite only: check the whole in a session of its own.
        result = subprocess.run(
            [sys.executable, "-m", "pytest", str(TESTS_DIR), "-q", "-p", "no:cacheprovider"]
            + ["-k", request.node.name, "--durations=0", "--durations-min=1000"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=900,
            check=False,
        )
        assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-3000:]
        return
    violations = lane_violations(items)
    assert violations == [], (
        "these tests start Snakemake or vLLM outside tests/workflow/ (Snakemake) or tests/engine/"
        " (vLLM), where the quick lane would run them; move them to their lane's folder:\n"
        + "\n".join(f"{lane}: {node_id}" for lane, node_id in violations)
    )
