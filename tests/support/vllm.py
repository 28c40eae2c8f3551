"""The real vLLM of the tests: the CPU build in .venv-vllm (`make vllm`), and the settings that
compare its figures with the project's own."""

from __future__ import annotations

import os

import pytest

from support.workflow import REPO

VLLM_VENV = REPO / ".venv-vllm"
VLLM_STAMP = VLLM_VENV / ".installed"  # written by `make vllm` once the install is complete
VLLM_PYTHON = str(VLLM_VENV / "bin" / "python")  # not resolved: the venv's python is a link
# Exact storage and the target in float32 in both backends: differences are vLLM's kernels only.
EXACT = {"dtype": "fp32", "model_dtype": "float32", "device": "cpu"}


def require_vllm_venv() -> None:
    """Skips the test without .venv-vllm; in CI (CI=true) fails it, as `make test` makes one."""
    if not VLLM_STAMP.exists():
        reason = f"{VLLM_VENV.name} is absent: `make vllm` installs a real vLLM (CPU build)"
        if os.environ.get("CI") == "true":
            pytest.fail(f"{reason}; in CI `make test` must have created it")
        pytest.skip(reason)
