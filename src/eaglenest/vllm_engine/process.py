"""Running a module of ours under the serving engine's own interpreter (vLLM's `vllm.python`),
and talking to it.

vLLM pins another transformers than ours, so it never shares the project's environment: a stage
that needs it starts `python -m <module>` from that environment, with our source on PYTHONPATH,
and the module imports only the engine, torch, numpy, this file, threads and vllm_cpu (stdlib
only). The child writes messages to stdout as lines `EAGLENEST <json>` (`say`); every other line
there is the engine's own log (vLLM logs to stdout), which the parent logs and keeps the end of
for errors.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from eaglenest.vllm_engine.cpu import config_uses_mla, cpu_engine_args
from eaglenest.vllm_engine.cpu_kernel_scan import fix_cpu_kernel_scan

MARKER = "EAGLENEST "
LOG_TAIL_LINES = 40
PR_SET_PDEATHSIG = 1  # linux/prctl.h

log = logging.getLogger(__name__)


class EngineError(RuntimeError):
    """The engine could not be started or failed; the message ends with the end of its log."""


def say(message: dict[str, Any]) -> None:
    """In the child: one message to the parent, as one write of the whole line (print writes the
    text and the newline apart, and an engine worker's log line could land between them)."""
    sys.stdout.write(MARKER + json.dumps(message) + "\n")
    sys.stdout.flush()


def die_with_parent() -> Callable[[], None] | None:
    """What a child runs before exec to get SIGKILL when its parent dies, however it dies (kill -9
    included), so an engine never keeps a GPU for a job that is gone (Linux PR_SET_PDEATHSIG).
    Looked up here, in the parent: a forked child of a threaded process should not load libraries."""
    if not sys.platform.startswith("linux"):
        return None
    prctl, parent = ctypes.CDLL(None, use_errno=True).prctl, os.getpid()

    def in_child() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the call
            os._exit(1)

    return in_child


def start_group_watchdog() -> None:
    """In the engine's process (the leader of its own process group), before the engine starts:
    fork a watchdog that SIGKILLs the whole group when this process dies, however it dies.

    PR_SET_PDEATHSIG (die_with_parent) kills this process with its parent, but not what the
    engine starts: vLLM's `VLLM::EngineCore` and `VLLM::Worker` are this process's children, and
    a kill -9 of `serve-capture` or of a job once left them running as orphans (620 MB here, on a
    GPU node the GPUs a restarted server needs). They stay in this process group (vLLM starts no
    session of its own), so the watchdog, told by its own PR_SET_PDEATHSIG that this process is
    gone, kills the group. A stop of the group (stop_process_group's SIGTERM) ends it too."""
    if not sys.platform.startswith("linux"):
        return
    prctl, leader = ctypes.CDLL(None, use_errno=True).prctl, os.getpid()
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
    if os.fork():
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGUSR1})
        return
    try:  # the watchdog: no threads, nothing of the engine's, no pipe of the parent's held open
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        os.closerange(3, 65536)
        prctl(PR_SET_PDEATHSIG, signal.SIGUSR1, 0, 0, 0)
        if os.getppid() == leader:  # else the engine's process died before the prctl
            signal.sigwait({signal.SIGUSR1})
        os.killpg(leader, signal.SIGKILL)  # the watchdog is in the group: this ends it too
    finally:
        os._exit(0)


def llm_arguments(request: dict[str, Any], **method: Any) -> dict[str, Any]:
    """In the child: the keyword arguments of `vllm.LLM` for a request written by the parent:
    its `engine_args`, then the target and sizes it names, then the method's own; a None is left
    to vLLM's default."""
    args = dict(request["engine_args"])
    for key in (
        "dtype",
        "tensor_parallel_size",
        "quantization",
        "max_model_len",
        "gpu_memory_utilization",
        "trust_remote_code",
    ):
        args[key] = request[key]
    args.update(model=request["target"], **method)
    args = {key: value for key, value in args.items() if value is not None}
    if request.get("cpu_workarounds", True) and _on_cpu():
        drafter = (args.get("speculative_config") or {}).get("model")
        args = cpu_engine_args(
            args,
            target_uses_mla=config_uses_mla(model_config(request["target"])),
            drafter_uses_mla=config_uses_mla(model_config(drafter)) if drafter else None,
        )
    return args


# What this process set of vLLM's variables itself (not the user's choice): the next engine of
# the same process decides as the first did.
_SET_HERE: dict[str, str] = {}


def worker_in_engine_core() -> bool:
    """In the child: whether vLLM's worker runs in its engine core's process instead of one more
    process spawned for it, which imports vLLM and torch once more (a one-shot decode here: a
    few seconds of 30). vLLM spawns the CPU worker only to pin its OpenMP threads to cores,
    which a job's engine does not do (engine_thread_env's `nobind`); so on CPU then, and never
    over the user's own setting. A one-shot engine then keeps its engine core in this process
    too (`one_shot_llm`); a server's stays apart (vLLM's AsyncLLM)."""
    return (
        os.environ.get("VLLM_CPU_OMP_THREADS_BIND") == "nobind"
        and os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") in (None, _SET_HERE.get("value"))
        and _on_cpu()
    )


def one_shot_llm(args: dict[str, Any]) -> Any:
    """In the child: `vllm.LLM(**args)`; when `worker_in_engine_core`, its worker and its engine
    core both in this process: vLLM's single-process executor named by class (its CPU platform
    turns the name "uni" back into "mp") and VLLM_ENABLE_V1_MULTIPROCESSING=0, sparing one
    import of vLLM and torch per engine (~8 s of CPU here; the small demo's plain, K=3 and K=7
    engines one after another: 94 -> 46 s of CPU, tokens and vLLM's counters identical). For
    every target: the Kimi-K2.5 layout's processor loads a module vLLM's kernel scan trips over
    in our process (cpu_kernel_scan.py, applied here), and the offline capture steps the engine
    until the last states are written (capture.py `write_finished_states`)."""
    from vllm import LLM

    if worker_in_engine_core() and "distributed_executor_backend" not in args:
        from vllm.v1.executor.uniproc_executor import UniProcExecutor

        args = {**args, "distributed_executor_backend": UniProcExecutor}
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = _SET_HERE["value"] = "0"
        fix_cpu_kernel_scan()
    return LLM(**args)


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def model_config(model: str) -> dict[str, Any]:
    """In the child: a model's config.json, from its directory or the local hub cache."""
    path = Path(model) / "config.json"
    if path.is_file():
        return json.loads(path.read_text())
    from huggingface_hub import hf_hub_download  # vLLM's dependency; reads the local cache

    return json.loads(Path(hf_hub_download(model, "config.json")).read_text())


def engine_python(python: str, key: str = "vllm.python") -> str:
    """The engine's interpreter, checked: relative paths are from the working directory (for a
    workflow, its directory). Not resolved: a venv's python is a link that must stay one."""
    path = Path(python)
    if not (path.is_file() and os.access(path, os.X_OK)):
        raise EngineError(
            f"{key} {python!r}: no such interpreter (from {Path.cwd()}); `make vllm` creates "
            ".venv-vllm, or name the python of an environment with vLLM"
        )
    return str(path)


def our_pythonpath() -> str:
    """PYTHONPATH for vLLM's interpreter: our source first (the directory holding eaglenest/),
    then whatever the caller had."""
    source_root = str(Path(__file__).resolve().parents[2])
    return os.pathsep.join(filter(None, [source_root, os.environ.get("PYTHONPATH")]))


@contextlib.contextmanager
def engine_process(
    python: str, module: str, args: list[str], env: dict[str, str]
) -> Iterator[subprocess.Popen]:
    """`python -m module args` with our source importable, in its own process group (the engine
    starts processes of its own): all of them are stopped when the block ends, however it ends."""
    process = subprocess.Popen(
        [python, "-m", module, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        # In a job, vLLM's CPU build keeps to the job's threads (engine_thread_env).
        env={
            **os.environ,
            **engine_thread_env(),
            **env,
            "PYTHONPATH": our_pythonpath(),
            "PYTHONUNBUFFERED": "1",
        },
        start_new_session=True,
        # Safe here: the child calls one function looked up before the fork, then execs.
        preexec_fn=die_with_parent(),  # noqa: PLW1509
    )
    try:
        yield process
    finally:
        stop_process_group(process)


def stop_process_group(
    process: subprocess.Popen, wait_s: float = 30, first: int = signal.SIGTERM
) -> None:
    """Stop a child that leads its own process group (the engine's own processes, a command's
    jobs): `first` (SIGTERM; common.command's Ctrl-C, SIGINT) to the whole group, SIGKILL if
    the child lingers past `wait_s`, then SIGKILL to whatever of the group is left behind."""
    for sig, wait in ((first, wait_s), (signal.SIGKILL, 10)):
        if process.poll() is not None:
            break
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(wait)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)  # processes of the group left behind


def engine_messages(process: subprocess.Popen, tail: list[str]) -> Iterator[dict[str, Any]]:
    """The child's messages; its other lines are logged, and the last ones kept in `tail`."""
    assert process.stdout is not None
    for line in process.stdout:
        at = line.find(MARKER)
        if at >= 0:  # after a worker's unfinished line, if one was written just before
            if at:
                log.info("engine: %s", line[:at])
            yield json.loads(line[at + len(MARKER) :])
            continue
        log.info("engine: %s", line.rstrip())
        tail.append(line.rstrip())
        del tail[:-LOG_TAIL_LINES]


def reply(process: subprocess.Popen, text: str = "next") -> None:
    """A line to the child's stdin (it waits for one between batches)."""
    assert process.stdin is not None
    process.stdin.write(text + "\n")
    process.stdin.flush()


def engine_thread_env() -> dict[str, str]:
    """The variables that keep vLLM's CPU build to the job's threads. By default
    (VLLM_CPU_OMP_THREADS_BIND=auto) it pins one OpenMP thread to every core of the NUMA node,
    whatever OMP_NUM_THREADS says (vllm/utils/ompmultiprocessing.py); `nobind` leaves the count
    to OMP_NUM_THREADS, which common.threads.use_threads set. Only inside a job (use_threads ran), and never
    over a binding the user chose."""
    if "EAGLENEST_THREADS" not in os.environ or "VLLM_CPU_OMP_THREADS_BIND" in os.environ:
        return {}
    return {"VLLM_CPU_OMP_THREADS_BIND": "nobind"}
