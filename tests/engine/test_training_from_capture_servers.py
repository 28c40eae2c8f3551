"""Training without stored hidden states (`hidden.store: none`), against a real vLLM CPU capture
server (`eaglenest serve-capture`) and through real Snakemake, on copies of the lane's
`vllm_captured_run` (the small demo, its hidden-state shards captured by vLLM, exact fp32):
- training from the server equals training from the files (the same seed: the same batches, the
  loss trace and the exported tensors within float tolerance), and so do the held-out states
  evaluation reads (its simulated acceptance);
- no extract_hidden_states job is planned and no hidden-state file is written (the server's own
  per-request state files, vLLM's transport to us, are read and deleted: none is left);
- the training job killed -9 after its first checkpoint, then rerun, resumes there and ends with
  the same drafter;
- then, in the same workdir, `hidden.store: budget` with room for the one training shard: that
  shard alone is captured (through the server) as a file and trained from, the held-out one comes
  from the server, and the drafter and evaluation are again those from files;
- the wait share of training from the server (`data_wait_share`) is printed.

One engine starts here (the server, eager, for the module's runs).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from support.servers import free_port
from support.vllm import capture_config
from support.workers import CORES
from support.workflow import (
    DEMO_CONFIGFILE,
    SMALL_RUN,
    copy_run,
    job_logs,
    planned_jobs,
    snakemake,
)

SHARDS = ("00000", "00001")
# Tiny and exact: every step logged and checkpointed (the kill lands after the first), no live
# decoding (the simulated acceptance is what reads the states).
TRAIN = {"log_every": 1, "checkpoint_every": 1}
EVALUATE = {"live": False}
TARGETS = [f"results/{SMALL_RUN}/drafter/config.json", f"results/{SMALL_RUN}/eval/metrics.json"]


def run_config(url: str | None, store: str) -> dict:
    config = capture_config(url)
    config["hidden"]["store"] = store
    config["train"] = {**config.get("train", {}), **TRAIN}
    config["evaluate"] = {**config.get("evaluate", {}), **EVALUATE}
    return config


def copy_run_without(source: Path, destination: Path, drop_hidden: bool) -> Path:
    """A copy of a finished run (support.workflow.copy_run) without its training journal, its
    logs and, when `drop_hidden`, its hidden-state shards."""
    copy_run(source, destination)
    results = destination / "results" / SMALL_RUN
    shutil.rmtree(results / "journal" / "train", ignore_errors=True)
    if drop_hidden:
        for shard in SHARDS:
            for suffix in (".safetensors", ".json"):
                (results / "hidden" / f"{shard}{suffix}").unlink()
    for path in (destination / "logs").rglob("*.log"):
        path.unlink()
    return destination


def losses(workdir: Path) -> list[tuple[int, float]]:
    lines = (workdir / "results" / SMALL_RUN / "drafter" / "metrics.jsonl").read_text()
    records = [json.loads(line) for line in lines.splitlines() if line.strip()]
    return [(r["step"], r["loss"]) for r in records if r["split"] == "train"]


def weights(workdir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(workdir / "results" / SMALL_RUN / "drafter" / "model.safetensors")


def assert_same_training(found: Path, reference: Path) -> None:
    a, b = losses(found), losses(reference)
    assert [s for s, _ in a] == [s for s, _ in b] and len(a) >= 4
    torch.testing.assert_close(torch.tensor([x for _, x in a]), torch.tensor([x for _, x in b]),
                               rtol=1e-4, atol=1e-5)  # fmt: skip
    wa, wb = weights(found), weights(reference)
    assert sorted(wa) == sorted(wb)
    for name in wb:
        torch.testing.assert_close(wa[name], wb[name], rtol=1e-3, atol=1e-5, msg=name)


def hidden_files(workdir: Path) -> list[str]:
    """Hidden-state-shaped files of the run: shards, their temporaries, capture work folders."""
    hidden = workdir / "results" / SMALL_RUN / "hidden"
    return sorted(p.name for p in hidden.iterdir() if p.name != "target_head.safetensors")


@pytest.fixture(scope="module")
def server(vllm_captured_run: dict, tmp_path_factory: pytest.TempPathFactory):
    """A copy of the captured run without its hidden-state shards, and one capture server for
    it (its served name hashes the target's path: the runs are in this copy): the workdir, URL,
    announcement and storage. The module's tests run there in turn."""
    tmp = tmp_path_factory.mktemp("capture-server")
    workdir = copy_run_without(vllm_captured_run["workdir"], tmp / "workflow", drop_hidden=True)
    url = f"http://127.0.0.1:{free_port()}"
    process, announced = start_server(workdir, run_config(url, "none"), tmp)
    try:
        yield {"workdir": workdir, "url": url, "announced": announced, "storage": tmp / "storage"}
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(120)


def start_server(workdir: Path, config: dict, tmp: Path) -> tuple[subprocess.Popen, dict]:
    override = tmp / "server.yaml"
    override.write_text(json.dumps(config))
    args = [sys.executable, "-m", "eaglenest.cli", "serve-capture",
            "--configfile", DEMO_CONFIGFILE, str(override), "--storage-dir", str(tmp / "storage"),
            "--log", str(tmp / "server.log"), "--startup-timeout-s", "900"]  # fmt: skip
    server = subprocess.Popen(args, cwd=workdir, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, start_new_session=True)  # fmt: skip
    assert server.stdout is not None
    line = server.stdout.readline()
    if not line.startswith("EAGLENEST "):
        server.kill()
        pytest.fail(line + (server.stderr.read()[-3000:] if server.stderr else ""))
    return server, json.loads(line[len("EAGLENEST ") :])


def killed_after_first_checkpoint(workdir: Path, config: dict) -> int:
    """Start the training job, kill -9 its whole process group once a checkpoint exists;
    returns the step it had saved."""
    (workdir / "override.yaml").write_text(yaml.safe_dump(config))
    args = [sys.executable, "-m", "snakemake", "--cores", str(CORES), TARGETS[0],
            "--configfile", DEMO_CONFIGFILE, str(workdir / "override.yaml")]  # fmt: skip
    job = subprocess.Popen(args, cwd=workdir, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
    state = workdir / "results" / SMALL_RUN / "journal" / "train" / "state.pt"
    deadline = time.monotonic() + 600
    while not state.exists() and job.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    os.killpg(job.pid, signal.SIGKILL)
    job.wait()
    assert state.exists(), "no checkpoint before the job ended\n" + job_logs(workdir)
    saved = torch.load(state, map_location="cpu", weights_only=True)["step"]
    assert not (workdir / "results" / SMALL_RUN / "drafter" / "config.json").exists()
    return int(saved)


@pytest.fixture(scope="module")
def from_files(vllm_captured_run: dict, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The reference: training and evaluation from the vLLM-captured files."""
    workdir = copy_run_without(
        vllm_captured_run["workdir"], tmp_path_factory.mktemp("files") / "w", False
    )
    config = run_config(None, "files")
    dry = snakemake(workdir, *TARGETS, "-n", config=config)
    assert planned_jobs(dry) == {"train_drafter": 1, "evaluate_drafter": 1}, dry.stdout[-2000:]
    result = snakemake(workdir, *TARGETS, config=config, timeout_s=900)
    assert result.returncode == 0, result.stderr[-3000:] + job_logs(workdir)
    return workdir


def test_training_from_a_capture_server_equals_training_from_files_and_resumes(from_files, server):
    workdir = server["workdir"]
    config = run_config(server["url"], "none")
    dry = snakemake(workdir, *TARGETS, "-n", config=config)
    assert planned_jobs(dry) == {"train_drafter": 1, "evaluate_drafter": 1}, dry.stdout[-2000:]
    started = time.monotonic()
    result = snakemake(workdir, *TARGETS, config=config, timeout_s=900)
    pooled_s = time.monotonic() - started
    assert result.returncode == 0, result.stderr[-3000:] + job_logs(workdir)
    assert_same_training(workdir, from_files)
    assert_same_evaluation(workdir, from_files)
    assert hidden_files(workdir) == [], hidden_files(workdir)
    assert not list(server["storage"].glob("cmpl-*")), "state files left on the server"
    assert "states from the capture servers" in job_logs(workdir)
    results = workdir / "results" / SMALL_RUN
    report = json.loads((results / "drafter" / "train_report.json").read_text())
    reference = json.loads((from_files / "results" / SMALL_RUN / "drafter" /
                            "train_report.json").read_text())  # fmt: skip

    # Killed -9 after its first checkpoint, rerun: it resumes there, to the same drafter.
    for name in ("drafter", "eval"):
        shutil.rmtree(results / name)
    shutil.rmtree(results / "journal" / "train")
    saved = killed_after_first_checkpoint(workdir, config)
    assert snakemake(workdir, "--unlock", config=config).returncode == 0
    rerun = snakemake(workdir, TARGETS[0], "--rerun-incomplete", config=config, timeout_s=900)
    assert rerun.returncode == 0, rerun.stderr[-3000:] + job_logs(workdir)
    log = (workdir / "logs" / SMALL_RUN / "train_drafter.log").read_text()
    assert f"at step {saved} of" in log, log[-3000:]
    assert_same_training(workdir, from_files)
    assert hidden_files(workdir) == []
    assert not list(server["storage"].glob("cmpl-*")), "state files left on the server"
    print(
        f"training from the capture server ({server['announced']['url']}): {report['steps']} "
        f"steps, data_wait_share {report['data_wait_share']:.3f} (from files "
        f"{reference['data_wait_share']:.3f}), {report['tokens_per_s']:.0f} tokens/s (from files "
        f"{reference['tokens_per_s']:.0f}); train and evaluate jobs {pooled_s:.1f} s"
    )


def test_budget_captures_the_shard_that_fits_once_and_the_rest_comes_from_the_server(
    from_files, server
):
    """After the none run, in its workdir: the small demo's one training shard fits
    `hidden.cache_gb`, so it alone is captured as a file (through the server); the held-out
    shard does not (from the server): the same drafter and evaluation as from files."""
    from eaglenest.common.config import validate_config
    from eaglenest.run.store import estimated_sample_bytes

    workdir = server["workdir"]
    config = run_config(server["url"], "budget")
    config["hidden"]["cache_gb"] = 1.0
    validated = validate_config(copy_of(config))
    shard_bytes = validated["prompts"]["shard_size"] * estimated_sample_bytes(validated, 64)
    config["hidden"]["cache_gb"] = 1.5 * shard_bytes / 1e9
    dry = snakemake(workdir, *TARGETS, "-n", config=config)
    jobs = {"extract_hidden_states": 1, "train_drafter": 1, "evaluate_drafter": 1}
    assert planned_jobs(dry) == jobs, dry.stdout[-2000:]
    result = snakemake(workdir, *TARGETS, config=config, timeout_s=900)
    assert result.returncode == 0, result.stderr[-3000:] + job_logs(workdir)
    assert_same_training(workdir, from_files)
    assert_same_evaluation(workdir, from_files)
    assert hidden_files(workdir) == [f"{SHARDS[0]}.json", f"{SHARDS[0]}.safetensors"]
    assert not list(server["storage"].glob("cmpl-*")), "state files left on the server"


def copy_of(config: dict) -> dict:
    return json.loads(json.dumps(config))


def assert_same_evaluation(found: Path, reference: Path) -> None:
    """The simulated acceptance (the held-out states' reader) as from files."""
    evaluated, expected = (
        json.loads((workdir / "results" / SMALL_RUN / "eval" / "metrics.json").read_text())
        for workdir in (found, reference)
    )
    for k, figures in expected["simulated"].items():
        assert evaluated["simulated"][k]["positions"] == figures["positions"]
        assert evaluated["simulated"][k]["acceptance_length"] == pytest.approx(
            figures["acceptance_length"], rel=1e-3
        )
