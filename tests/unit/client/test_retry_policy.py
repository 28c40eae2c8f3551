"""One retry policy for every request the pipeline sends to a server (eaglenest.client.retry):
the probe, generation and the capture client read the one set of retryable statuses and back off
by the one rule, and no module writes its own set again."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from eaglenest.client.retry import RETRYABLE_STATUS, RetryPolicy

LIBRARY = Path(__file__).resolve().parents[3] / "src" / "eaglenest"
USERS = ("stages/probe.py", "client/chat.py", "capture/faults.py")


def test_the_backoff_doubles_up_to_its_cap_with_jitter_and_honours_the_server_up_to_its_cap():
    policy = RetryPolicy(max_attempts=4, backoff_base_s=1.0, backoff_max_s=3.0, retry_after_max_s=5)
    for attempt, nominal in ((1, 1.0), (2, 2.0), (3, 3.0), (4, 3.0)):
        waits = [policy.backoff_s(attempt) for _ in range(200)]
        assert nominal * 0.5 <= min(waits) and max(waits) <= nominal * 1.5
        assert max(waits) - min(waits) > nominal * 0.2  # jittered, not one value
    assert policy.backoff_s(1, server_wait_s=4.0) == 4.0
    assert policy.backoff_s(1, server_wait_s=3600.0) == 5.0
    assert [policy.retries(a) for a in (1, 3, 4)] == [True, True, False]


def test_the_backoff_of_a_server_refusing_for_hours_never_overflows():
    """The capture pool's backoff streak of a server busy for hours, and generation's attempts
    at max_attempts >= 1,026, reached 2**1024: OverflowError. Past 60 doublings it is the cap."""
    policy = RetryPolicy(max_attempts=0, backoff_base_s=1.0, backoff_max_s=30.0)
    for attempt in (1025, 1026, 10**6):
        assert 15.0 <= policy.backoff_s(attempt) <= 45.0


def test_busy_is_one_rule_for_capture_and_generation():
    """What a busy server or a gateway before one answers (429, 503; 502, 504) is one set:
    generation retries it, the capture pool backs the server off instead of setting it aside."""
    from eaglenest.capture.faults import OVERLOAD_STATUS
    from eaglenest.client.retry import BUSY_STATUS

    assert {429, 502, 503, 504} == BUSY_STATUS == OVERLOAD_STATUS
    assert BUSY_STATUS <= RETRYABLE_STATUS


def test_the_server_wait_is_ignored_without_a_cap():
    assert RetryPolicy(2, 0.01, 0.01).backoff_s(1, server_wait_s=60.0) <= 0.015


def int_sets(path: Path) -> list[int]:
    """Line numbers of set literals of HTTP statuses (ints from 400 up) in a module."""
    return [
        node.lineno
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Set)
        and node.elts
        and all(isinstance(e, ast.Constant) and isinstance(e.value, int) for e in node.elts)
        and min(e.value for e in node.elts) >= 400
    ]


def test_only_the_retry_module_names_the_retryable_statuses():
    written = {
        str(path.relative_to(LIBRARY)): lines
        for path in sorted(LIBRARY.rglob("*.py"))
        if (lines := int_sets(path)) and path != LIBRARY / "client" / "retry.py"
    }
    assert not written, f"statuses written outside client/retry.py: {written}"
    assert {408, 429, 500, 502, 503, 504} == RETRYABLE_STATUS


@pytest.mark.parametrize("module", USERS)
def test_probe_generation_and_capture_take_the_statuses_from_the_retry_module(module):
    tree = ast.parse((LIBRARY / module).read_text())
    imported = {
        alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module == "eaglenest.client.retry"
        for alias in node.names
    }
    assert "RETRYABLE_STATUS" in imported
