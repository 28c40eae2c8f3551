"""A real scheduler: a single-node SLURM cluster (munged, slurmctld, slurmd from Debian's
`slurm-wlm` and `munge`, installed with apt-get when missing) started in a temp dir, and the demo's
shards run through `--profile profiles/slurm` up to their samples and tokens (generation with its
prompt slice, then validation and tokenization). Samples and tokens must equal those of the local
run of the same config on the same target (`finished_run`, built once for the suite); the SLURM
run's wall time is printed (`pytest -s`)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import polars as pl
import pytest
from support.servers import free_port
from support.workflow import (
    SMALL_DEMO,
    SMALL_RUN,
    copy_workflow_with_target,
    job_logs,
    planned_jobs,
    snakemake,
)

pytestmark = pytest.mark.slow

PACKAGES = ("slurm-wlm", "munge")
DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("srun", "sbatch", "squeue", "scancel")
SHARDS = ("00000", "00001")  # SMALL_DEMO: 40 prompts in shards of 20
TARGETS = tuple(f"results/{SMALL_RUN}/samples/{shard}.parquet" for shard in SHARDS)
TOKENS = tuple(f"results/{SMALL_RUN}/tokens/{shard}.parquet" for shard in SHARDS)
# Only what a single test node lacks: no accounting database (so no account and no sacct), and a
# first status check after 2 s instead of 40 (the jobs here take seconds).
SLURM_TEST_ARGS = (
    "--slurm-no-account",
    "--slurm-status-command",
    "squeue",
    "--slurm-init-seconds-before-status-checks",
    "2",
    "--jobs",
    "4",
)


def _binary(name: str) -> str | None:
    return shutil.which(name) or next(
        (str(p) for d in ("/usr/sbin", "/sbin") if (p := Path(d) / name).exists()), None
    )


def ensure_slurm_installed() -> None:
    """Install Debian's slurm-wlm and munge when missing; skip only without root or apt-get."""
    if all(_binary(name) for name in DAEMONS + CLIENTS):
        return
    if os.geteuid() != 0:
        pytest.skip("SLURM is not installed and installing it with apt-get needs root")
    if shutil.which("apt-get") is None:
        pytest.skip("SLURM is not installed and there is no apt-get to install it")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *PACKAGES]
    result = subprocess.run(install, env=env, capture_output=True, text=True, check=False)
    if result.returncode != 0:  # a fresh machine may have no package lists yet
        subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True, check=False)
        result = subprocess.run(install, env=env, capture_output=True, text=True, check=False)
    assert result.returncode == 0, "apt-get install slurm-wlm munge failed:\n" + result.stderr
    missing = [name for name in DAEMONS + CLIENTS if not _binary(name)]
    assert not missing, f"installed {PACKAGES} but still missing {missing}"


def node_line() -> str:
    """This machine as a SLURM node (CPUs, sockets, memory), as `slurmd -C` measures it."""
    out = subprocess.run(
        [_binary("slurmd"), "-C"], capture_output=True, text=True, check=True
    ).stdout
    return out.splitlines()[0] + " NodeAddr=127.0.0.1 State=UNKNOWN"


def write_slurm_conf(root: Path) -> Path:
    munge_socket = root / "munge" / "munge.socket"
    conf = root / "slurm.conf"
    conf.write_text(
        f"""ClusterName=eaglenest-test
SlurmctldHost={socket.gethostname().split(".")[0]}(127.0.0.1)
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={munge_socket}
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MpiDefault=none
ReturnToService=2
{node_line()}
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""
    )
    return conf


def start_munged(root: Path) -> None:
    """A munged of our own: its own key and socket, so it neither needs nor touches the system's."""
    munge_dir = root / "munge"
    munge_dir.mkdir(mode=0o755)
    key = munge_dir / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o600)
    subprocess.run(
        [
            _binary("munged"),
            "--force",  # the temp dir's parents are world-writable (/tmp); fine for a test
            f"--socket={munge_dir / 'munge.socket'}",
            f"--key-file={key}",
            f"--pid-file={munge_dir / 'munged.pid'}",
            f"--log-file={munge_dir / 'munged.log'}",
            f"--seed-file={munge_dir / 'munged.seed'}",
        ],
        check=True,
        capture_output=True,
    )


def stop_daemon(pid_file: Path) -> None:
    if not pid_file.exists():
        return
    pid = int(pid_file.read_text().split()[0])
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    os.kill(pid, signal.SIGKILL)


def srun_shim(root: Path, conf: Path) -> Path:
    """A bin dir whose `srun` sets SLURM_CONF. The plugin's job step drops every SLURM_* variable
    before its nested srun (snakemake-executor-plugin-slurm-jobstep 0.6.1), which only a node
    with the config at the default /etc/slurm/slurm.conf survives; this test leaves /etc alone."""
    bin_dir = root / "bin"
    bin_dir.mkdir()
    shim = bin_dir / "srun"
    shim.write_text(f'#!/bin/sh\nSLURM_CONF={conf} exec {shutil.which("srun")} "$@"\n')
    shim.chmod(0o755)
    return bin_dir


def wait_for_srun(env: dict[str, str], root: Path, timeout_s: float = 90) -> None:
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        last = subprocess.run(
            ["srun", "--time=1", "hostname"],
            env=env,
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        if last.returncode == 0:
            return
        time.sleep(1)
    logs = "\n".join(p.read_text()[-2000:] for p in sorted((root / "log").glob("*.log")))
    pytest.fail(f"`srun hostname` still fails after {timeout_s} s: {last.stderr}\n{logs}")


@pytest.fixture(scope="module")
def slurm_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """Environment (SLURM_CONF) of a running single-node cluster; daemons stop at teardown."""
    ensure_slurm_installed()
    root = tmp_path_factory.mktemp("slurm")
    for name in ("state", "spool", "log"):
        (root / name).mkdir()
    conf = write_slurm_conf(root)
    env = {
        **os.environ,
        "SLURM_CONF": str(conf),
        "PATH": f"{srun_shim(root, conf)}{os.pathsep}{os.environ['PATH']}",
    }
    try:
        start_munged(root)
        for daemon in ("slurmctld", "slurmd"):
            subprocess.run([_binary(daemon), "-f", str(conf)], env=env, check=True)
        wait_for_srun(env, root)
        yield env
    finally:
        subprocess.run(
            ["scancel", "--full", "--user=root"], env=env, capture_output=True, check=False
        )
        for pid_file in ("slurmd.pid", "slurmctld.pid", "munge/munged.pid"):
            stop_daemon(root / pid_file)


def samples(workdir: Path, files: tuple[str, ...] = TARGETS) -> pl.DataFrame:
    frames = [pl.read_parquet(workdir / path) for path in files]
    return pl.concat(frames).sort("id")


def test_slurm_run_equals_local_run(slurm_env: dict[str, str], finished_run: Path, tmp_path: Path):
    # The local run: finished_run, the same config through the same targets (and beyond), on one
    # host. The SLURM run starts from its target, so the answers can be compared.
    local = finished_run
    slurm = copy_workflow_with_target(tmp_path / "slurm", local / "results" / SMALL_RUN / "target")

    # The demo target was copied in: only prompts, probe, generation and samples are left.
    planned = planned_jobs(snakemake(slurm, "-n", *TARGETS, config=SMALL_DEMO))
    assert planned == {
        "prepare_prompts": 1,
        "probe_endpoints": 1,
        "generate_responses": len(SHARDS),
        "prepare_samples": len(SHARDS),
    }

    start = time.monotonic()
    result = snakemake(slurm, "--profile", "profiles/slurm", *SLURM_TEST_ARGS, *TARGETS,
                       config=SMALL_DEMO, env=slurm_env)  # fmt: skip
    slurm_s = time.monotonic() - start
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-5000:] + job_logs(slurm)
    print(
        f"\n{len(SHARDS)} shards of prompts -> generate -> validate + tokenize: SLURM {slurm_s:.1f} s"
    )

    # Every job went through SLURM (the demo target was copied in, so it was not built) but
    # generation's, local rules that share each endpoint's cap on this host.
    output = result.stdout + result.stderr
    submitted = re.findall(r"Job (\d+) has been submitted with SLURM jobid", output)
    assert len(submitted) == sum(planned.values()) - len(SHARDS), output[-5000:]
    assert output.count("localrule generate_responses:") == len(SHARDS), output[-5000:]

    local_samples, slurm_samples = samples(local), samples(slurm)
    assert local_samples.height > 0
    # Per-sample seeds depend only on the run seed and the sample id, so the same prompts give
    # the same requests and (the embedded server samples each row with its own generator) the
    # same answers, whichever node and batch served them.
    assert slurm_samples["id"].to_list() == local_samples["id"].to_list()
    # Everything but where and how fast it was served.
    columns = [c for c in local_samples.columns if c not in ("endpoint", "latency_s")]
    assert "reasoning" in columns and "content" in columns and "request" in columns
    for column in columns:
        assert slurm_samples[column].to_list() == local_samples[column].to_list(), column
    # The same token ids from the same samples, on whichever node they were tokenized.
    assert samples(slurm, TOKENS).equals(samples(local, TOKENS))
