"""Shared fixtures. Expensive ones are session-scoped: each is built once per test run."""

from __future__ import annotations

from pathlib import Path

import pytest

# A demo target small enough to build in well under a minute on two cores, yet trained long
# enough to answer held-out prompts with `<think>\n...\n</think>\n\nanswer<|im_end|>` nearly
# always (its answers are often wrong; tests need the shape, not the arithmetic).
DEMO_TARGET_TEST_SETTINGS = {
    "seed": 0,
    "num_layers": 8,
    "hidden_size": 64,
    "num_heads": 4,
    "num_kv_heads": 2,
    "intermediate_size": 192,
    "vocab_size": 512,
    "train_steps": 400,
    "batch_size": 16,
    "learning_rate": 3e-3,
    "heldout_prompts": 30,
}


@pytest.fixture(scope="session")
def demo_target_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A trained demo target in Hugging Face layout (with `demo_metrics.json`)."""
    from eaglenest.demo.target import build_demo_target

    out_dir = tmp_path_factory.mktemp("demo-target") / "target"
    build_demo_target(out_dir, **DEMO_TARGET_TEST_SETTINGS)
    return out_dir


@pytest.fixture(scope="session")
def finished_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A workdir where the whole pipeline ran on `SMALL_DEMO` (workflow_helpers), built once per
    session. Tests only dry-run in it, or restore what they change before they return."""
    from workflow_helpers import SMALL_DEMO, copy_workflow, job_logs, snakemake

    workdir = copy_workflow(tmp_path_factory.mktemp("workflow"))
    # Training and live evaluation included: about 15 minutes on two busy cores.
    result = snakemake(workdir, config=SMALL_DEMO, timeout_s=2400)
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-5000:] + job_logs(workdir)
    return workdir
