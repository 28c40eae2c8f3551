"""Training imports the capture reader in every `hidden.store` mode, and a GPU training machine
that reads files has no aiohttp, polars or pandera (bench/gpu_check.py runs there): the pool's
HTTP client and the tokens reader are imported only when a job asks the capture servers."""

from __future__ import annotations

import subprocess
import sys

CHECK = """
import sys
import eaglenest.capture.reader
import eaglenest.stages.train.train
print(sorted(m for m in ("aiohttp", "polars", "pandera") if m in sys.modules))
"""


def test_training_imports_neither_the_http_client_nor_the_frames_libraries():
    result = subprocess.run(
        [sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=300, check=True
    )
    assert result.stdout.strip().splitlines()[-1] == "[]", result.stdout + result.stderr
