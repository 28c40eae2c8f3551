"""bench/run_all.py: every bench in its own process, figures merged, failures recorded not fatal."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

BENCH_DIR = Path(__file__).resolve().parents[2] / "bench"
RUN_ALL = BENCH_DIR / "run_all.py"

WRITES_FIGURES = """\
import argparse, json
parser = argparse.ArgumentParser()
parser.add_argument("--json")
parser.add_argument("--size", type=int, default=10)
args = parser.parse_args()
print("fast bench: 123 things/s")
open(args.json, "w").write(json.dumps({"things_per_s": 123.0, "size": args.size}))
"""
FAILS = """\
import sys
print("about to fail")
sys.exit(3)
"""
NO_JSON = "print('forgot to write --json')\n"
HANGS = "import time\nprint('hanging', flush=True)\ntime.sleep(60)\n"


def run_all(bench_dir: Path, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    out = bench_dir / "results.json"
    result = subprocess.run(
        [sys.executable, str(RUN_ALL), "--bench-dir", str(bench_dir), "--out", str(out), *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    return result, json.loads(out.read_text())


def test_figures_are_merged_and_a_failure_is_recorded(tmp_path: Path):
    (tmp_path / "fast.py").write_text(WRITES_FIGURES)
    (tmp_path / "broken.py").write_text(FAILS)
    (tmp_path / "silent.py").write_text(NO_JSON)
    (tmp_path / "_helper.py").write_text("raise SystemExit('a helper is not a bench')\n")
    result, merged = run_all(tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    assert sorted(merged["benches"]) == ["broken", "fast", "silent"]
    fast = merged["benches"]["fast"]
    assert fast["status"] == "ok"
    assert fast["figures"] == {"things_per_s": 123.0, "size": 10}
    assert fast["wall_s"] > 0
    broken = merged["benches"]["broken"]
    assert (broken["status"], broken["returncode"], broken["figures"]) == ("failed", 3, None)
    assert "about to fail" in broken["output_tail"]
    assert merged["benches"]["silent"]["status"] == "failed"
    assert sorted(merged["failed"]) == ["broken", "silent"]
    machine = merged["machine"]
    for key in ("cpu_count", "platform", "python", "git_commit", "date_utc", "gpus"):
        assert key in machine
    assert machine["versions"]["torch"]
    assert "123 things/s" in result.stdout  # the bench's own output is shown as it runs


def test_only_and_timeout(tmp_path: Path):
    (tmp_path / "fast.py").write_text(WRITES_FIGURES)
    (tmp_path / "hangs.py").write_text(HANGS)
    result, merged = run_all(tmp_path, "--only", "hangs", "--timeout-s", "2")
    assert result.returncode == 1
    assert list(merged["benches"]) == ["hangs"]
    assert merged["benches"]["hangs"]["status"] == "timeout"
    assert merged["benches"]["hangs"]["wall_s"] < 30

    result, merged = run_all(tmp_path, "--only", "fast")
    assert result.returncode == 0, result.stdout + result.stderr
    assert merged["failed"] == []


def test_quick_sizes_name_benches_that_exist():
    """A bench renamed or removed leaves no stale `--quick` sizes (they would never apply), and
    the studies that train drafters live in experiments/, not among the benches."""
    spec = importlib.util.spec_from_file_location("run_all", RUN_ALL)
    run_all_module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(run_all_module)
    benches = {p.stem for p in run_all_module.discover(BENCH_DIR)}
    assert "generate" in benches
    assert not {"storage", "recipe"} & benches
    assert set(run_all_module.QUICK_ARGS) <= benches, set(run_all_module.QUICK_ARGS) - benches


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="this machine has a GPU")
def test_the_gpu_check_is_skipped_without_a_gpu(tmp_path: Path):
    """A bench of NEEDS_GPU (bench/gpu_check.py) is not run where nvidia-smi lists no GPU: it is
    recorded as skipped, and a skip is no failure."""
    (tmp_path / "fast.py").write_text(WRITES_FIGURES)
    (tmp_path / "gpu_check.py").write_text(FAILS)
    result, merged = run_all(tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert merged["benches"]["gpu_check"]["status"] == "skipped"
    assert "about to fail" not in result.stdout
    assert merged["failed"] == []
    assert merged["benches"]["fast"]["status"] == "ok"
