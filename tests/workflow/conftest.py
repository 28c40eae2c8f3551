"""The workflow lane: tests that run real Snakemake in a temp copy of the workflow
(support/workflow.py), many of them on the small demo run `finished_run` (tests/conftest.py).
Every test in this folder is marked `snakemake`, so `make check` leaves them out; the long ones
are marked `slow` in their modules."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.lanes import mark_folder


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    mark_folder(items, Path(__file__).parent, pytest.mark.snakemake)
