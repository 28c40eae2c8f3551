"""One vLLM capture engine for every hidden-state shard (`eaglenest serve-capture`,
`vllm.capture_url`), against the real vLLM CPU build and through real Snakemake, on a copy of
`finished_run` (tests/conftest.py):
- its shards captured by one engine equal, shard for shard, what the offline backend (an engine
  per shard job: the conftest's `vllm_captured_run`) wrote, and the run starts one engine instead
  of one per shard;
- a changed tokens shard recaptures only that shard, and a new capture URL recaptures nothing;
- a shard job killed mid-capture, then rerun, writes a complete, correct file, and no state file
  is left in the server's storage or beside the output;
- a capture server whose engine is killed mid-run is restarted by serve-capture, and the run
  completes with every sample once.

Three engines start here, eager: the server, a second server (one request at a time) shared by
the two kill tests, and that server's restart after its engine is killed.
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

import polars as pl
import pytest
import torch
from support.servers import free_port, healthy
from support.vllm import CAPTURE_SHARDS as SHARDS
from support.vllm import capture_config, engine_starts, hidden_targets
from support.workers import CORES
from support.workflow import DEMO_CONFIGFILE, SMALL_RUN, job_logs, planned_jobs, snakemake


def serve_capture(workdir: Path, config: dict, *command: str, storage: Path, log: Path):
    """`eaglenest serve-capture` for the run's config (the file snakemake gets too), started."""
    path = workdir / "override.yaml"
    path.write_text(json.dumps(config))
    args = [sys.executable, "-m", "eaglenest.cli", "serve-capture",
            "--configfile", DEMO_CONFIGFILE, str(path), "--storage-dir", str(storage),
            "--log", str(log), "--startup-timeout-s", "600"]  # fmt: skip
    if command:
        args += ["--", *command]
    return subprocess.Popen(args, cwd=workdir, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)  # fmt: skip


def snakemake_command(workdir: Path, *targets: str) -> list[str]:
    return [sys.executable, "-m", "snakemake", "--cores", str(CORES), *targets,
            "--configfile", DEMO_CONFIGFILE, str(workdir / "override.yaml")]  # fmt: skip


def assert_shards_equal(found: Path, reference: Path) -> None:
    from eaglenest.formats.hidden_shard import open_hidden_shard

    a, b = open_hidden_shard(found), open_hidden_shard(reference)
    assert a.sample_ids == b.sample_ids and len(a) == len(b) > 0
    for i in range(len(b)):
        x, y = a.sample(i), b.sample(i)
        assert torch.equal(x["input_ids"], y["input_ids"])
        assert torch.equal(x["loss_mask"], y["loss_mask"])
        for name in ("aux", "final_hidden"):
            torch.testing.assert_close(x[name], y[name], rtol=1e-5, atol=1e-6)


def state_files(*directories: Path) -> list[Path]:
    found = []
    for directory in directories:
        found += [p for p in directory.glob("*") if p.name != "server-request.json"]
    return found


@pytest.fixture(scope="module")
def served_run(vllm_captured_run: dict, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The same shards through one capture server, in a copy of the offline run without them:
    `eaglenest serve-capture ... -- snakemake ...`, the server stopped when snakemake ends."""
    workdir = tmp_path_factory.mktemp("capture-server") / "workflow"
    shutil.copytree(vllm_captured_run["workdir"], workdir, symlinks=True)
    hidden = workdir / "results" / SMALL_RUN / "hidden"
    for shard in SHARDS:
        (hidden / f"{shard}.safetensors").unlink()
        (hidden / f"{shard}.json").unlink()
    for path in (workdir / "logs").rglob("*.log"):
        path.unlink()
    reference = vllm_captured_run["workdir"] / "results" / SMALL_RUN / "hidden"
    storage = tmp_path_factory.mktemp("capture-storage")
    server_log = tmp_path_factory.mktemp("capture-log") / "server.log"
    config = capture_config(f"http://127.0.0.1:{free_port()}")
    started = time.monotonic()
    process = serve_capture(workdir, config, *snakemake_command(workdir, *hidden_targets()),
                            storage=storage, log=server_log)  # fmt: skip
    stdout, stderr = process.communicate(timeout=1800)
    served_s = time.monotonic() - started
    assert process.returncode == 0, stdout[-3000:] + stderr[-3000:] + job_logs(workdir)
    announced = json.loads(next(line for line in stdout.splitlines()
                                if line.startswith("EAGLENEST "))[len("EAGLENEST "):])  # fmt: skip
    return {**vllm_captured_run, "workdir": workdir, "reference": reference, "config": config,
            "storage": storage, "server_log": server_log, "served_s": served_s,
            "announced": announced}  # fmt: skip


def test_one_capture_server_captures_every_shard_as_an_engine_per_shard_does(served_run):
    workdir, hidden = (
        served_run["workdir"],
        served_run["workdir"] / "results" / SMALL_RUN / "hidden",
    )
    job_log_files = sorted((workdir / "logs").rglob("*.log"))
    assert engine_starts(served_run["server_log"], *job_log_files) == 1
    assert served_run["offline_starts"] == len(SHARDS)
    for shard in SHARDS:
        summary = json.loads((hidden / f"{shard}.json").read_text())
        assert summary["backend"] == "vllm" and summary["samples"] > 0
        assert_shards_equal(
            hidden / f"{shard}.safetensors", served_run["reference"] / f"{shard}.safetensors"
        )
    assert "through http://127.0.0.1" in job_logs(workdir)
    assert not state_files(served_run["storage"]), "state files were left in the server's storage"
    assert not list(hidden.glob(".*")), "temporary files were left beside the outputs"
    assert not healthy(served_run["announced"]["url"]), "the server outlived the run"
    tokens = sum(json.loads((hidden / f"{s}.json").read_text())["tokens"] for s in SHARDS)
    print(
        f"capture of {len(SHARDS)} shards, {tokens} tokens, engine start included: offline "
        f"{served_run['offline_s']:.1f} s ({tokens / served_run['offline_s']:.0f} tokens/s, "
        f"{served_run['offline_starts']} engine starts), one server "
        f"{served_run['served_s']:.1f} s ({tokens / served_run['served_s']:.0f} tokens/s, 1 start; "
        f"ready after {served_run['announced']['ready_s']:.1f} s)"
    )


def test_a_changed_tokens_shard_recaptures_only_that_shard(served_run):
    workdir, config = served_run["workdir"], served_run["config"]
    shard = "00001"
    dry = snakemake(workdir, *hidden_targets(), "-n", config=config)
    assert planned_jobs(dry) == {}, dry.stdout[-2000:]
    elsewhere = {**config, "vllm": {**config["vllm"], "capture_url": "http://127.0.0.1:9"}}
    assert planned_jobs(snakemake(workdir, *hidden_targets(), "-n", config=elsewhere)) == {}
    tokens = workdir / "results" / SMALL_RUN / "tokens" / f"{shard}.parquet"
    frame = pl.read_parquet(tokens)
    frame.head(frame.height - 1).write_parquet(tokens)  # a regenerated shard: other contents
    dry = snakemake(workdir, *hidden_targets(), "-n", config=config)
    assert planned_jobs(dry) == {"extract_hidden_states": 1}, dry.stdout[-2000:]
    outputs = [line for line in dry.stdout.splitlines() if line.strip().startswith("output:")]
    assert len(outputs) == 1 and f"hidden/{shard}.safetensors" in outputs[0], outputs


def finished_requests(url: str) -> int:
    """Requests the server has answered, from its Prometheus metrics (vLLM's own counter)."""
    import urllib.request

    with urllib.request.urlopen(f"{url}/metrics", timeout=5) as response:
        text = response.read().decode()
    return int(sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("vllm:request_success_total")))  # fmt: skip


def wait_for_requests(url: str, count: int, timeout_s: float) -> int:
    deadline = time.monotonic() + timeout_s
    while (done := finished_requests(url)) < count and time.monotonic() < deadline:
        time.sleep(0.005)
    return done


@pytest.fixture(scope="module")
def one_at_a_time(served_run: dict, tmp_path_factory: pytest.TempPathFactory):
    """A second server over the same run, one request at a time so that a capture lasts long
    enough to be killed in its middle, shared by the two kill tests (one engine start for both;
    the server-kill test adds its restart). Stopped with SIGTERM at the end: 130, and gone."""
    workdir = served_run["workdir"]
    config = capture_config(served_run["config"]["vllm"]["capture_url"], requests_per_batch=1)
    base = tmp_path_factory.mktemp("one-at-a-time")
    storage, server_log = base / "storage", base / "server.log"
    server = serve_capture(workdir, config, storage=storage, log=server_log)
    assert server.stdout is not None
    line = server.stdout.readline()  # the EAGLENEST line, once the server answers
    try:
        assert line.startswith("EAGLENEST "), line + server.stderr.read()[-3000:]
        yield {"process": server, "config": config, "storage": storage, "log": server_log,
               "url": json.loads(line[len("EAGLENEST ") :])["url"]}  # fmt: skip
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(120)
    assert server.returncode == 130 and not healthy(json.loads(line[len("EAGLENEST ") :])["url"])


def recapture(workdir: Path, shard: str) -> tuple[str, int]:
    """The shard's target, its hidden files removed first, and its samples."""
    hidden = workdir / "results" / SMALL_RUN / "hidden"
    for name in (f"{shard}.safetensors", f"{shard}.json"):
        (hidden / name).unlink(missing_ok=True)
    tokens = workdir / "results" / SMALL_RUN / "tokens" / f"{shard}.parquet"
    return f"results/{SMALL_RUN}/hidden/{shard}.safetensors", pl.read_parquet(tokens).height


def test_a_shard_job_killed_mid_capture_then_rerun_writes_a_complete_file(
    served_run, one_at_a_time
):
    workdir, server = served_run["workdir"], one_at_a_time
    config, storage, url = server["config"], server["storage"], server["url"]
    hidden = workdir / "results" / SMALL_RUN / "hidden"
    shard = "00000"  # 00001's tokens were changed by the test before
    target, samples = recapture(workdir, shard)
    starts = engine_starts(server["log"])
    job = subprocess.Popen(snakemake_command(workdir, target), cwd=workdir,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           start_new_session=True)  # fmt: skip
    before = finished_requests(url)
    done = wait_for_requests(url, before + 2, timeout_s=600) - before  # the log comes in bursts
    os.killpg(job.pid, signal.SIGKILL)
    job.wait()
    assert 2 <= done < samples, f"the kill came after {done} of {samples} requests"
    assert not (hidden / f"{shard}.safetensors").exists(), "the kill came after the capture"
    assert snakemake(workdir, "--unlock", config=config).returncode == 0
    rerun = snakemake(workdir, target, "--rerun-incomplete", config=config, timeout_s=900)
    assert rerun.returncode == 0, rerun.stdout[-3000:] + rerun.stderr[-3000:] + job_logs(workdir)
    assert_shards_equal(
        hidden / f"{shard}.safetensors", served_run["reference"] / f"{shard}.safetensors"
    )
    assert not state_files(storage), state_files(storage)
    assert not list(hidden.glob(".*")), list(hidden.glob(".*"))
    assert engine_starts(server["log"]) == starts  # the same engine throughout


def engine_core(root: int) -> int | None:
    """The pid of vLLM's engine core under process `root` (its comm, cut to 15 characters)."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            comm, rest = stat[stat.index("(") + 1 : stat.rindex(")")], stat[stat.rindex(")") + 2 :]
            parents[int(entry.name)] = (int(rest.split()[1]), comm)
    for pid, (_, comm) in parents.items():
        ancestor = pid
        while ancestor in parents and ancestor != root:
            ancestor = parents[ancestor][0]
        if ancestor == root and comm.startswith("VLLM::EngineCor"):
            return pid
    return None


def test_a_capture_server_whose_engine_dies_mid_run_is_restarted_and_the_run_completes(
    served_run, one_at_a_time
):
    """serve-capture watches its server: the engine core killed -9 in the middle of a shard's
    capture, the server is restarted at the same URL (--restarts, default 2) and the waiting
    job's samples go there; the shard is whole, each sample once, equal to the reference."""
    workdir, server = served_run["workdir"], one_at_a_time
    storage, url = server["storage"], server["url"]
    hidden = workdir / "results" / SMALL_RUN / "hidden"
    shard = "00000"
    starts = engine_starts(server["log"])
    # On a loaded machine the shard's 20 requests can pass between two polls of the metrics:
    # then no kill (no restart spent) and the shard is captured again, up to three times.
    for _ in range(3):
        target, samples = recapture(workdir, shard)
        job = subprocess.Popen(snakemake_command(workdir, target), cwd=workdir,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True)  # fmt: skip
        try:
            before = finished_requests(url)
            done = wait_for_requests(url, before + 2, timeout_s=600) - before
            if done >= samples:
                job.communicate(timeout=900)
                continue
            core = engine_core(server["process"].pid)
            assert core is not None, "no VLLM::EngineCore under serve-capture"
            os.kill(core, signal.SIGKILL)
            killed_at = time.monotonic()
            output, _ = job.communicate(timeout=900)
            break
        finally:
            if job.poll() is None:
                os.killpg(job.pid, signal.SIGKILL)
    assert 2 <= done < samples, f"the kill came after {done} of {samples} requests"
    assert job.returncode == 0, output[-3000:] + job_logs(workdir)
    assert engine_starts(server["log"]) == starts + 1, "the server was not restarted once"
    assert_shards_equal(  # every sample, once, as the offline engine wrote it
        hidden / f"{shard}.safetensors", served_run["reference"] / f"{shard}.safetensors"
    )
    assert not state_files(storage), state_files(storage)
    assert healthy(url)  # the restarted server serves on
    print(f"engine killed after {done} of {samples} requests; the run ended "
          f"{time.monotonic() - killed_at:.1f} s later, restart included")  # fmt: skip
