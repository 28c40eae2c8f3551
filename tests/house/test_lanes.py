"""The lanes are folders: tests/workflow/'s conftest marks its tests `snakemake`, tests/engine/'s
`vllm`, and the quick lane (`make check`) is what neither marks (nor `slow`). Nothing is inferred
at collection; instead every test runs guarded (support/lanes.py): one outside those folders that
starts Snakemake or vLLM fails before the process exists, naming the folder to move it to. This
test is itself in the quick lane, so the guard is on around it."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys

import pytest
from support.lanes import (
    CHECK_LANE,
    COLLECTED,
    SNAKEMAKE,
    TESTS_DIR,
    VLLM,
    LaneError,
    command_lanes,
    misplaced_lanes,
)
from support.vllm import VLLM_PYTHON

REPO = TESTS_DIR.parent


def test_make_check_runs_the_check_lane():
    recipe = re.search(r"^check:.*\n((?:\t.*\n)+)", (REPO / "Makefile").read_text(), re.MULTILINE)
    assert recipe, "the Makefile has a `check` target"
    assert f'-m "{CHECK_LANE}"' in recipe.group(1)


def test_the_lane_folders_mark_their_tests_and_nothing_else(request):
    """Every collected test of tests/workflow/ is marked `snakemake`, of tests/engine/ `vllm` (and
    `slow`), and no other test carries either mark: the quick lane is the rest."""
    items = request.config.stash.get(COLLECTED, [])
    assert items, "tests/conftest.py stores what the session collected"
    for item in items:
        marks = {m.name for m in item.iter_markers()}
        in_workflow = item.path.is_relative_to(TESTS_DIR / "workflow")
        in_engine = item.path.is_relative_to(TESTS_DIR / "engine")
        assert (SNAKEMAKE in marks) == in_workflow, item.nodeid
        assert (VLLM in marks) == in_engine, item.nodeid
        if in_engine:
            assert "slow" in marks, item.nodeid


@pytest.mark.parametrize(
    "command, lanes",
    [
        ([sys.executable, "-m", "snakemake", "--cores", "1"], {SNAKEMAKE}),
        ("snakemake -n --configfile x.yaml", {SNAKEMAKE}),
        (["eaglenest", "serve-capture", "--", "snakemake", "--until", "x"], {SNAKEMAKE}),
        ([VLLM_PYTHON, "-c", "pass"], {VLLM}),
        ([VLLM_PYTHON, "-m", "eaglenest.vllm_engine.decode"], {VLLM}),
        (["/tmp/stand-in/python", "-m", "eaglenest.vllm_engine.decode"], set()),
        (["python", "-m", "vllm.entrypoints.openai.api_server"], {VLLM}),
        ([sys.executable, "-c", "print('snakemake')"], set()),
        (["snakefmt", "--check", "rules/"], set()),
        (["eaglenest", "serve", "--port", "0"], set()),
    ],
)
def test_a_command_belongs_to_the_lanes_it_starts(command, lanes):
    assert command_lanes(command) == lanes


def test_each_folder_may_start_its_own_lanes_only():
    snakemake = ["python", "-m", "snakemake"]
    vllm = [VLLM_PYTHON, "-m", "eaglenest.vllm_engine.serve"]
    assert misplaced_lanes(TESTS_DIR / "unit" / "client" / "test_x.py", snakemake) == [SNAKEMAKE]
    assert misplaced_lanes(TESTS_DIR / "house" / "test_x.py", vllm) == [VLLM]
    assert misplaced_lanes(TESTS_DIR / "workflow" / "test_x.py", snakemake) == []
    assert misplaced_lanes(TESTS_DIR / "workflow" / "test_x.py", vllm) == [VLLM]
    assert misplaced_lanes(TESTS_DIR / "engine" / "test_x.py", snakemake) == []
    assert misplaced_lanes(TESTS_DIR / "engine" / "test_x.py", vllm) == []


def test_this_quick_test_cannot_start_snakemake_or_vllm_but_any_other_process(tmp_path):
    marker = tmp_path / "ran"
    script = f"open({str(marker)!r}, 'w').close()"
    with pytest.raises(
        LaneError, match=r"starts snakemake .* lives in tests/workflow/ or tests/engine/"
    ):
        subprocess.run([sys.executable, "-m", "snakemake", "-c", script], check=False)
    with pytest.raises(LaneError, match=r"starts vllm .* lives in tests/engine/; move it there"):
        subprocess.run([VLLM_PYTHON, "-c", script], check=False)

    async def through_asyncio():
        await asyncio.create_subprocess_exec(sys.executable, "-m", "snakemake", "--version")

    with pytest.raises(LaneError, match="starts snakemake"):
        asyncio.run(through_asyncio())
    assert not marker.exists()
    subprocess.run([sys.executable, "-c", script], check=True)
    assert marker.exists()
