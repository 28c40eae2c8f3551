"""bench/gpu_check.py, the prepared GPU check, proven on the CPU: every step runs end to end with
`--device cpu --small` in a Python that cannot import what the GPU machine lacks (Snakemake,
polars, pandera, jsonschema, httpx, vLLM), and every module it imports, in its DDP child too,
comes from torch, transformers, safetensors, tqdm, numpy, their requirements or the standard
library; a step that fails is reported and the next one still runs."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "bench" / "gpu_check.py"
STEPS = (
    "gpus",
    "ttt",
    "long_context",
    "packed",
    "train",
    "capture",
    "fp8",
    "ddp",
    "device_timings",
)
# What the GPU machine has: python, these distributions and what they require.
GPU_MACHINE = ("torch", "transformers", "safetensors", "tqdm", "numpy")
BLOCKED = ("snakemake", "polars", "pandera", "jsonschema", "httpx", "vllm", "pyarrow")

# Imported at start-up by every Python of the run (PYTHONPATH), the script's DDP child included:
# importing a blocked package raises, and at exit the process lists the modules it imported.
SITECUSTOMIZE = """\
import atexit, json, os, sys

BLOCKED = {blocked!r}


class NotOnTheGpuMachine:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"{{name}} is not on the GPU machine (tests/bench/test_gpu_check.py)")
        return None


sys.meta_path.insert(0, NotOnTheGpuMachine())


@atexit.register
def _list_modules():
    names = sorted({{name.split(".")[0] for name in list(sys.modules)}})
    path = os.path.join({dump_dir!r}, f"modules-{{os.getpid()}}.json")
    with open(path, "w") as stream:
        json.dump(names, stream)
"""


def load_gpu_check():
    """bench/gpu_check.py as a module (registered: its dataclasses look their module up)."""
    if "gpu_check" not in sys.modules:
        spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
        module = importlib.util.module_from_spec(spec)
        sys.modules["gpu_check"] = module
        spec.loader.exec_module(module)
    return sys.modules["gpu_check"]


def required_distributions(roots: tuple[str, ...]) -> set[str]:
    """These distributions and everything they require (extras aside), canonical names."""
    seen: set[str] = set()
    todo = list(roots)
    while todo:
        name = re.sub(r"[-_.]+", "-", todo.pop()).lower()
        if name in seen:
            continue
        try:
            requires = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue
        seen.add(name)
        for line in requires:
            requirement = Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                todo.append(requirement.name)
    return seen


def gpu_machine_python(root: Path) -> Path:
    """The python of a new virtual environment holding only what the GPU machine has: the
    GPU_MACHINE distributions and what they require, linked from this environment."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
    site = next((root / "lib").glob("python*/site-packages"))
    for name in sorted(required_distributions(GPU_MACHINE)):
        dist = metadata.distribution(name)
        # Top-level packages, modules and the .dist-info folder (versions are read from it).
        for top in sorted({Path(str(f)).parts[0] for f in dist.files or []}):
            source = Path(dist.locate_file(top))
            if top.startswith("..") or top == "__pycache__" or not source.exists():
                continue
            if not (site / top).exists():
                (site / top).symlink_to(source)
    return root / "bin" / "python"


@pytest.mark.slow
def test_every_step_runs_on_the_cpu_with_only_what_the_gpu_machine_has(tmp_path: Path):
    python = gpu_machine_python(tmp_path / "venv")
    for absent in ("polars", "pandera", "snakemake", "jsonschema", "pytest", "PIL"):
        found = subprocess.run([python, "-c", f"import {absent}"], capture_output=True, check=False)
        assert found.returncode != 0, f"{absent} is importable in the GPU machine's environment"
    dumps = tmp_path / "modules"
    dumps.mkdir()
    site = next((tmp_path / "venv" / "lib").glob("python*/site-packages"))
    (site / "sitecustomize.py").write_text(
        SITECUSTOMIZE.format(blocked=BLOCKED, dump_dir=str(dumps))
    )
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "OUT": str(out)}
    done = subprocess.run(
        [python, str(SCRIPT), "--device", "cpu", "--small", "--threads", "1"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    lines = [line for line in done.stdout.splitlines() if line.startswith("gpu-check ")]
    assert done.returncode == 0, "\n".join(lines) + done.stderr[-3000:]
    for name in STEPS:
        assert any(line.startswith(f"gpu-check {name} ok ") for line in lines), name
    assert lines[-1].startswith("gpu-check done ok")
    assert (out / "gpu_check.log").read_text().splitlines() == lines
    results = json.loads((out / "gpu_check.json").read_text())
    assert [results["steps"][n]["status"] for n in STEPS] == ["ok"] * len(STEPS)
    assert results["failed"] == []
    # The figures the GPU run is for, as numbers: the TTT errors, the long-context memory.
    assert results["steps"]["ttt"]["figures"]["grad_rel_bf16"] > 0  # bf16 autocast did run
    assert results["steps"]["long_context"]["figures"]["T256_peak_mib"] > 0
    assert results["steps"]["ddp"]["figures"]["ddp"] == "DistributedDataParallel"
    # The file report.device.file reads, at each batch size, as report.device checks it.
    from eaglenest.settings.report import device_timings

    timings = device_timings({"file": str(out / "device_timings.json"), "batch": 2})
    assert 0 < timings.drafter_ratio <= 1 and set(timings.verify_cost) == {"1", "3"}
    assert timings.name == "cpu, batch 2"
    listed = [json.loads(p.read_text()) for p in dumps.glob("modules-*.json")]
    assert len(listed) >= 2, "the script and its DDP child each list their modules"
    imported = set().union(*map(set, listed))
    assert not imported & set(BLOCKED)
    assert {"torch", "transformers", "eaglenest"} <= imported


def test_a_failing_step_is_reported_and_the_next_one_runs(tmp_path: Path, monkeypatch, capsys):
    """fp8's round-trip tolerance set to 0 fails that step (its real figures kept); gpus, after
    it, still runs; the exit status is 1 and the JSON says which step failed."""
    gpu_check = load_gpu_check()
    monkeypatch.setitem(gpu_check.TOL, "fp8_roundtrip", 0.0)
    monkeypatch.setenv("OUT", str(tmp_path))
    status = gpu_check.main(["--device", "cpu", "--small", "--only", "fp8", "gpus"])
    lines = capsys.readouterr().out.splitlines()
    assert status == 1
    fp8 = next(line for line in lines if line.startswith("gpu-check fp8 "))
    assert fp8.startswith("gpu-check fp8 FAIL ") and "roundtrip_rel=0.02" in fp8
    assert "goal_<=_0" in fp8
    assert any(line.startswith("gpu-check gpus ok ") for line in lines)
    results = json.loads((tmp_path / "gpu_check.json").read_text())
    assert results["failed"] == ["fp8"]
    assert results["steps"]["fp8"]["figures"]["encoded_equal_share"] == 1.0


def test_the_vllm_step_is_skipped_without_vllm_and_fails_nothing(tmp_path, monkeypatch, capsys):
    """vllm_mla_dflash (a DFlash beside an MLA target in vLLM) needs a python with vLLM: without
    one it says so and is skipped, neither ok nor failed."""
    gpu_check = load_gpu_check()
    monkeypatch.setattr(gpu_check, "has_module", lambda name: False)
    monkeypatch.setenv("OUT", str(tmp_path))
    status = gpu_check.main(["--device", "cpu", "--small", "--only", "vllm_mla_dflash"])
    lines = capsys.readouterr().out.splitlines()
    assert status == 0
    assert any(line.startswith("gpu-check vllm_mla_dflash skip ") for line in lines), lines
    results = json.loads((tmp_path / "gpu_check.json").read_text())
    assert (
        results["failed"] == [] and "--vllm-python" in results["steps"]["vllm_mla_dflash"]["error"]
    )


def test_cuda_asked_for_without_cuda_fails_at_once(tmp_path: Path, monkeypatch, capsys):
    """On a machine whose torch sees no GPU, `--device cuda` (the default) is a failure, not a
    silent CPU run."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    monkeypatch.setenv("OUT", str(tmp_path))
    assert load_gpu_check().main([]) == 1
    assert capsys.readouterr().out.startswith("gpu-check env FAIL ")
    assert json.loads((tmp_path / "gpu_check.json").read_text())["failed"] == ["env"]


def test_the_schema_defaults_without_jsonschema_equal_the_validated_config():
    """The script fills config/schema.yaml's defaults itself (no jsonschema on the GPU machine):
    the settings it builds are those of the validated config."""
    from eaglenest.common.config import settings_from_sections
    from eaglenest.settings.hidden_states import HiddenSettings
    from eaglenest.settings.train import TrainSettings

    gpu_check = load_gpu_check()
    train = {"max_steps": 3, "device": "cpu", "drafter": {"fc_norm": False}}
    assert gpu_check.train_settings(**train) == settings_from_sections(TrainSettings, train=train)
    hidden = {"dtype": "fp8"}
    config = gpu_check.schema_config(hidden=hidden)
    assert HiddenSettings.from_config(config) == settings_from_sections(
        HiddenSettings, hidden=hidden
    )
