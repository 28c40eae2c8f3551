"""Shared fixtures of every folder (expensive ones session-scoped: each is built once per test
run). The lanes are folders, marked by their own conftest (support/lanes.py); here the session
keeps the list of every test it collected, for tests/house/test_lanes.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.lanes import COLLECTED
from support.workflow import SMALL_DEMO, copy_workflow, job_logs, snakemake

# The small demo target (config/tests/demo-small.yaml, one source for the unit tests' target and
# the workflow tests'): built in well under a minute on two cores, and answering held-out prompts
# in the `<think>...</think>` shape nearly always.
DEMO_TARGET_TEST_SETTINGS = {
    key: value for key, value in SMALL_DEMO["demo_target"].items() if key != "enabled"
}


@pytest.fixture(scope="session")
def demo_target_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A trained demo target in Hugging Face layout (with `demo_metrics.json`)."""
    from eaglenest.common.config import settings_from_sections
    from eaglenest.demo.target import build_demo_target
    from eaglenest.settings.demo_target import DemoTargetSettings

    out_dir = tmp_path_factory.mktemp("demo-target") / "target"
    settings = settings_from_sections(DemoTargetSettings, demo_target=DEMO_TARGET_TEST_SETTINGS)
    build_demo_target(out_dir, settings)
    return out_dir


@pytest.fixture(scope="session")
def finished_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A workdir where the whole pipeline ran on `SMALL_DEMO` (support/workflow.py), built once per
    session; its files are under results/{SMALL_RUN}/. Tests only dry-run in it, or restore what
    they change before they return."""
    workdir = copy_workflow(tmp_path_factory.mktemp("workflow"))
    # Training and live evaluation included: about 15 minutes on two busy cores.
    result = snakemake(workdir, config=SMALL_DEMO, timeout_s=2400)
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-5000:] + job_logs(workdir)
    return workdir


@pytest.hookimpl(tryfirst=True)  # before `-m` and `-k` deselect any
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    config.stash[COLLECTED] = list(items)
