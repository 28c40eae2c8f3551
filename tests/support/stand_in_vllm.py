"""A stand-in for the configs' default vllm.python (`.venv-vllm/bin/python`, relative to the
working directory) for tests that validate a config planning vLLM jobs without a vLLM at hand:
a folder holding that path as a link to the tests' own interpreter, which runs and imports no
vLLM (so the config passes, its vLLM version warned as untold), and starts no vLLM either."""

from __future__ import annotations

import sys
from pathlib import Path


def stand_in_vllm_folder(folder: Path) -> Path:
    """`folder`, with .venv-vllm/bin/python in it: chdir there to validate such a config."""
    python = folder / ".venv-vllm" / "bin" / "python"
    python.parent.mkdir(parents=True, exist_ok=True)
    python.symlink_to(sys.executable)
    return folder
