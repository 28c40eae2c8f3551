"""The quick lane (`make check`): the tests marked `snakemake` or `vllm` by tests/conftest.py
(support/lanes.py, from what a test's code reaches) are out of it, with no mark written by hand."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

from support.lanes import CHECK_LANE, TESTS_DIR

REPO = TESTS_DIR.parent

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
NEW_CONFTEST = """
from pathlib import Path
from support.lanes import TESTS_DIR, assign_lanes

def pytest_collection_modifyitems(items):
    assign_lanes(items, roots=(TESTS_DIR, Path(__file__).parent))
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


def test_the_suites_snakemake_and_vllm_tests_are_out_of_the_check_lane():
    modules = ("workflow", "lint", "config", "vocab", "io")
    paths = [f"tests/test_{m}.py" for m in modules] + ["tests/engine/test_vllm_generation.py"]
    every = collected(*paths)
    quick = collected("-m", CHECK_LANE, *paths)
    assert quick and set(quick) < set(every)
    for module in ("test_workflow.py", "engine/test_vllm_generation.py"):  # Snakemake or vLLM
        assert not [n for n in quick if n.startswith(f"tests/{module}::")], module
    # Not marked by hand: each found by what its code runs (snakefmt stays in, it is no Snakemake).
    assert names(n for n in quick if "test_lint.py::" in n) == {"test_snakefmt_check_passes"}
    assert "test_snakemake_fails_naming_the_key" not in names(quick)
    assert "test_samples_and_vocab_rules_in_snakemake" not in names(quick)
    for module in ("test_config.py", "test_vocab.py"):  # their other tests stay in
        assert [n for n in quick if n.startswith(f"tests/{module}::")], module
    assert [n for n in every if "test_io.py::" in n] == [n for n in quick if "test_io.py::" in n]


def test_a_new_test_that_starts_snakemake_or_vllm_leaves_the_check_lane_unmarked(tmp_path):
    (tmp_path / "conftest.py").write_text(NEW_CONFTEST)
    (tmp_path / "test_new.py").write_text(NEW_MODULE)
    options = ["-c", str(REPO / "pyproject.toml"), "--rootdir", str(tmp_path), str(tmp_path)]
    assert names(collected("-m", CHECK_LANE, *options, cwd=tmp_path)) == {
        "test_plain",
        "test_reads_the_word_without_running_it",
    }
    assert names(collected("-m", "vllm", *options, cwd=tmp_path)) == {"test_against_vllm"}
    assert names(collected("-m", "not vllm and not slow", *options, cwd=tmp_path)) == {
        "test_plain",
        "test_reads_the_word_without_running_it",
        "test_a_helper_starts_snakemake",
        "test_a_fixture_runs_the_workflow",
    }
