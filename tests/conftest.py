"""Shared fixtures of every folder (expensive ones session-scoped: each is built once per test
run). The lanes are folders, marked by their own conftest (support/lanes.py); here every test's
setup and call is guarded (a test outside its lane's folder that starts Snakemake or vLLM fails),
and the session keeps the list of every test it collected, for tests/house/. Under pytest-xdist
(`make test` runs three workers: support/workers.py) a worker uses its share of the cores, a
module's tests go to one worker, and the shared builds are made once for all."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict
from pathlib import Path

import pytest
from support.cpu_log import cpu_logged
from support.lanes import COLLECTED, guarded
from support.workers import (
    CACHE_DIR,
    ModuleScheduling,
    built_once,
    order_for_workers,
    use_worker_cores,
)
from support.workflow import SMALL_DEMO, copy_run, copy_workflow_with_target, job_logs, snakemake

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

    settings = settings_from_sections(DemoTargetSettings, demo_target=DEMO_TARGET_TEST_SETTINGS)
    built = built_once(
        tmp_path_factory,
        "demo-target",
        lambda out: build_demo_target(out / "target", settings),
        key=demo_target_key(settings),
    )
    return built / "target"


def demo_target_key(settings) -> str:
    """What the demo target's build depends on: its settings, the code the rule that builds it
    runs (its code version), and torch's version."""
    import torch

    from eaglenest.common.code_version import script_code_version

    script = Path(__file__).resolve().parents[1] / "scripts" / "build_demo_target.py"
    parts = [json.dumps(asdict(settings), sort_keys=True, default=str)]
    parts += [script_code_version(script), torch.__version__]
    return "demo-target-" + hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


@pytest.fixture(scope="session")
def finished_run(tmp_path_factory: pytest.TempPathFactory, demo_target_dir: Path) -> Path:
    """A workdir where the whole pipeline ran on `SMALL_DEMO` (support/workflow.py), built once per
    session (for every worker); its files are under results/{SMALL_RUN}/. The demo target is
    `demo_target_dir`, copied in (the same settings: built once for the suite, not twice), so
    Snakemake plans every job after it; the build through Snakemake is asserted where a run makes
    its own (tests/engine/test_deepseek_v3_in_vllm.py). Read-only: a test that runs Snakemake
    there, even a dry run (which writes override.yaml), asks for `finished_run_copy`."""

    def build(out: Path) -> None:
        workdir = copy_workflow_with_target(out / "workflow", demo_target_dir)
        # Training and live evaluation included: about 2 minutes on two quiet cores.
        result = snakemake(workdir, config=SMALL_DEMO, timeout_s=2400)
        assert result.returncode == 0, (
            result.stdout[-5000:] + result.stderr[-5000:] + job_logs(workdir)
        )

    return built_once(tmp_path_factory, "finished-run", build) / "workflow"


@pytest.fixture
def finished_run_copy(finished_run: Path, tmp_path: Path) -> Path:
    """A copy of `finished_run` of the test's own (7 MB; file times and Snakemake's records kept,
    so a dry run there plans what it would plan in the original)."""
    return copy_run(finished_run, tmp_path / "workflow")


def pytest_configure(config: pytest.Config) -> None:
    use_worker_cores()
    # The code versions' parses (eaglenest.common.code_version) go to the checkout's own cache,
    # shared by the workers and every Snakemake the suite starts, never the user's.
    os.environ.setdefault("EAGLENEST_CACHE_DIR", str(CACHE_DIR.parent / "eaglenest"))


@pytest.hookimpl(optionalhook=True)  # `-p no:xdist` runs the suite in one process
def pytest_xdist_make_scheduler(config: pytest.Config, log) -> ModuleScheduling:
    """Under xdist (`-n N`): a module's tests on one worker, the longest chains first."""
    return ModuleScheduling(config, log)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item: pytest.Item):
    with (
        cpu_logged(item.nodeid, "setup"),
        guarded(item.path, item.nodeid),
    ):  # session fixtures a test asks for first start here
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item):
    with cpu_logged(item.nodeid, "call"), guarded(item.path, item.nodeid):
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item):
    with cpu_logged(item.nodeid, "teardown"):
        yield


@pytest.hookimpl(tryfirst=True)  # before `-m` and `-k` deselect any
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    config.stash[COLLECTED] = list(items)
    order_for_workers(items)
