"""The processes a run trains in and their devices: one process, or torchrun's group (WORLD_SIZE
> 1) with the model wrapped in DDP; sums over the processes; mixed precision per device.

How the group starts (run_under_torchrun): one node (`train.nodes` 1) runs `torchrun --standalone`
with `train.gpus` processes, as it always has. Several nodes run one torchrun agent a node, each
with `train.gpus` processes, meeting at a c10d rendezvous: under SLURM the nodes are the job's
allocation (SLURM_JOB_NODELIST, which the train rule's `nodes` resource asks for), `srun` starts
the agents, the first node hosts the rendezvous and the job id names it. Ranks are global and the
data split depends on the rank alone, so W processes train the same over any number of nodes.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from eaglenest.common.devices import resolve_device

if TYPE_CHECKING:
    from eaglenest.settings.train import TrainSettings

log = logging.getLogger(__name__)

RENDEZVOUS_PORT = 29400  # torchrun's own default for c10d, on the allocation's first node
ENTRY_MODULE = "eaglenest.stages.train.train"  # its main(): one process of the group
GROUP_ERROR_CHARS = 6000  # of the group's log, in the error a failed group raises


@dataclass(frozen=True)
class Processes:
    rank: int = 0
    world_size: int = 1
    device: str = "cpu"

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def setup_processes(device: str) -> Processes:
    """One process, or torchrun's group (NCCL on CUDA, gloo on CPU)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    device = resolve_device(device)
    if world_size == 1:
        return Processes(device=device)
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    if device.startswith("cuda"):
        torch.cuda.set_device(local_rank)
        device = f"cuda:{local_rank}"
    dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
    return Processes(rank=rank, world_size=world_size, device=device)


def leave_processes() -> None:
    """The end of one process of torchrun's group: all wait for the last (rank 0 exports after
    the others are done), then leave together. Without the barrier a process that leaves while
    its peer still holds gloo's connections aborts ("terminate called without an active
    exception", SIGABRT: a finished run reported failed, seen on a loaded machine)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def all_reduce_sum(values: list[float], processes: Processes) -> list[float]:
    if processes.world_size == 1:
        return values
    import torch.distributed as dist

    tensor = torch.tensor(values, dtype=torch.float64, device=processes.device)
    dist.all_reduce(tensor)
    return tensor.tolist()


def all_reduce_max(values: list[int], processes: Processes) -> list[int]:
    if processes.world_size == 1:
        return values
    import torch.distributed as dist

    tensor = torch.tensor(values, dtype=torch.int64, device=processes.device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.tolist()


def global_counts(counts: list[int], processes: Processes) -> list[int]:
    """Each TTT step's count of loss positions, summed over the processes."""
    return [round(n) for n in all_reduce_sum([float(n) for n in counts], processes)]


def data_parallel(model: torch.nn.Module, processes: Processes) -> torch.nn.Module:
    """The model itself in one process; under torchrun its DDP wrapper, which averages the
    gradients of the processes in backward."""
    if processes.world_size == 1:
        return model
    from torch.nn.parallel import DistributedDataParallel

    ids = [int(processes.device.split(":")[1])] if processes.device.startswith("cuda") else None
    return DistributedDataParallel(model, device_ids=ids)


def autocast(device: str, precision: str):
    bf16 = precision == "bf16" or (precision == "auto" and device.startswith("cuda"))
    return torch.autocast(device_type=device.split(":")[0], dtype=torch.bfloat16, enabled=bf16)


# --- starting the group ---------------------------------------------------------------------


def write_torchrun_args(settings: TrainSettings, arguments: dict[str, Any]) -> Path:
    """The file every process of the group reads its arguments from (in the journal: every
    node of a cluster sees it)."""
    journal = Path(arguments["journal_dir"])
    journal.mkdir(parents=True, exist_ok=True)
    args_file = journal / "torchrun_args.json"
    spec = {"arguments": arguments, "settings": json.loads(settings.to_json())}
    args_file.write_text(json.dumps(spec, default=str))
    return args_file


def torchrun_command(
    settings: TrainSettings,
    args_file: Path,
    rendezvous: str | None = None,
    rendezvous_id: str = "eaglenest-train",
) -> list[str]:
    """One node's torchrun agent: standalone on one node; with several, a c10d rendezvous at
    `rendezvous` (host:port) that every node's agent joins."""
    command = [sys.executable, "-m", "torch.distributed.run"]
    if settings.nodes == 1:
        command += ["--standalone", f"--nproc_per_node={settings.gpus}"]
    else:
        if not rendezvous:
            raise ValueError(
                f"train.nodes {settings.nodes}: the agents need a rendezvous host:port"
            )
        command += [
            f"--nnodes={settings.nodes}",
            f"--nproc_per_node={settings.gpus}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={rendezvous}",
            f"--rdzv-id={rendezvous_id}",
        ]
    return [*command, "-m", ENTRY_MODULE, str(args_file)]


def allocation_hosts(environ: dict[str, str] | os._Environ) -> list[str]:
    """The hosts of the SLURM allocation this job runs in (SLURM_JOB_NODELIST expanded)."""
    nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
    if not nodelist:
        return []
    listed = subprocess.run(
        ["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, check=True
    )
    return listed.stdout.split()


def multi_node_command(settings: TrainSettings, args_file: Path, environ=os.environ) -> list[str]:
    """`srun` over the allocation's nodes, one torchrun agent each, meeting on the first node."""
    hosts = allocation_hosts(environ) if shutil.which("scontrol") else []
    if len(hosts) < settings.nodes:
        raise RuntimeError(
            f"train.nodes {settings.nodes}: training over several nodes runs inside a SLURM "
            f"allocation of that many nodes (the train rule asks for them under profiles/slurm); "
            f"this job's allocation has {len(hosts)} (SLURM_JOB_NODELIST "
            f"{environ.get('SLURM_JOB_NODELIST')!r})"
        )
    rendezvous = f"{hosts[0]}:{RENDEZVOUS_PORT}"
    job_id = environ.get("SLURM_JOB_ID", "eaglenest-train")
    srun = [
        "srun",
        f"--nodes={settings.nodes}",
        f"--ntasks={settings.nodes}",
        "--ntasks-per-node=1",
        "--overlap",
        "--kill-on-bad-exit=1",
    ]
    return [*srun, *torchrun_command(settings, args_file, rendezvous, f"eaglenest-{job_id}")]


AGENT_FAILURE = "torch.distributed.elastic.multiprocessing.errors.ChildFailedError"


def group_failure(log_text: str) -> str:
    """The end of a failed group's log without the agent's own Python traceback, the one that
    ends in ChildFailedError (it only says that a process failed): the processes' errors (torch
    prefixes each line `[rankN]:`), what they printed last, and the agent's summary of which
    rank failed how. Any other traceback stays."""
    lines = log_text.splitlines()
    ends = [i for i, line in enumerate(lines) if line.startswith(AGENT_FAILURE)]
    if ends:
        starts = [i for i, line in enumerate(lines[: ends[-1]]) if line.startswith("Traceback")]
        if starts:
            lines = lines[: starts[-1]] + lines[ends[-1] + 1 :]
    return "\n".join(lines)[-GROUP_ERROR_CHARS:]


def run_under_torchrun(settings: TrainSettings, arguments: dict[str, Any], log_path: str) -> None:
    """train_drafter in `settings.gpus` processes on each of `settings.nodes` nodes (DDP);
    their output goes to log_path."""
    args_file = write_torchrun_args(settings, arguments)
    if settings.nodes == 1:
        command = torchrun_command(settings, args_file)
    else:
        command = multi_node_command(settings, args_file)
    log.info("running %s", " ".join(command))
    with open(log_path, "a") as stream:
        start = stream.tell()
        finished = subprocess.run(command, check=False, stdout=stream, stderr=stream)
    if finished.returncode != 0:
        with open(log_path, errors="replace") as stream:
            stream.seek(start)
            said = stream.read()
        raise RuntimeError(
            f"torchrun exited with {finished.returncode} ({settings.nodes} node(s) x "
            f"{settings.gpus} process(es)); the end of its log {log_path}:\n"
            f"{group_failure(said)}"
        )
