"""The suite's workers (tests/support/workers.py): every test that asks for a shared run's
fixture is in one of its group's modules, so one worker builds that run, once; and the order the
work is handed out puts the groups first."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from support.lanes import COLLECTED
from support.workers import (
    SHARED_RUN_GROUPS,
    TESTS_DIR,
    group_of,
    misplaced_tests,
    order_for_workers,
)


def whole_suite(request: pytest.FixtureRequest) -> list[pytest.Item] | None:
    """Every test of the suite as this session collected them; None when it collected part of
    them only, after running the calling test in a session of the whole suite."""
    items = request.config.stash.get(COLLECTED, [])
    if set(TESTS_DIR.rglob("test_*.py")) <= {Path(item.path) for item in items}:
        return items
    result = subprocess.run(
        [sys.executable, "-m", "pytest", str(TESTS_DIR), "-q", "-p", "no:cacheprovider"]
        + ["-k", request.node.name, "--durations=0", "--durations-min=1000"],
        cwd=TESTS_DIR.parent, capture_output=True, text=True, timeout=900, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-3000:]
    return None


def test_every_test_of_a_shared_run_is_in_its_group(request: pytest.FixtureRequest):
    items = whole_suite(request)
    if items is None:
        return
    assert misplaced_tests(items) == []
    for group in SHARED_RUN_GROUPS:  # and each group holds tests of its run
        users = [item for item in items if group.fixture in getattr(item, "fixturenames", ())]
        assert users, f"no test uses {group.fixture}"


def test_a_test_outside_its_group_is_named(request: pytest.FixtureRequest):
    """Planted: the first test of the plain-decoding group, seen as if it lived elsewhere."""
    items = whole_suite(request)
    if items is None:
        return
    planted = next(item for item in items if "plain_decoding" in item.fixturenames)

    class Moved:
        nodeid = "tests/unit/test_elsewhere.py::test_planted"
        fixturenames = planted.fixturenames

    assert group_of(Moved.nodeid) is None
    (message,) = misplaced_tests([Moved])
    assert "test_planted uses plain_decoding" in message and "'plain-decoding'" in message


def test_the_groups_are_handed_out_first_in_their_order(request: pytest.FixtureRequest):
    items = whole_suite(request)
    if items is None:
        return
    ordered = list(items)
    order_for_workers(ordered)
    groups = [group_of(item.nodeid) for item in ordered]
    grouped = [group for group in groups if group is not None]
    assert groups[: len(grouped)] == grouped, "a test outside the groups comes before a group's"
    assert [SHARED_RUN_GROUPS.index(g) for g in grouped] == sorted(
        SHARED_RUN_GROUPS.index(g) for g in grouped
    )
    # and this session runs its tests in that order
    position = {item.nodeid: index for index, item in enumerate(ordered)}
    ran = [position[item.nodeid] for item in request.session.items]
    assert ran == sorted(ran)
