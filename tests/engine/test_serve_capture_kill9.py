"""Nothing vLLM starts outlives a killed `eaglenest serve-capture`, `kill -9` included.

serve-capture starts vLLM's server in a process of its own group (PR_SET_PDEATHSIG: it dies with
serve-capture), and vLLM starts `VLLM::EngineCore` and `VLLM::Worker` from there. Those are
grandchildren, which PR_SET_PDEATHSIG does not reach: a `kill -9` of serve-capture's process group
once left them running (620 MB here, 40 minutes later; on a GPU node, the GPUs). The engine's
process now forks a watchdog that kills its group when it dies
(eaglenest.vllm_engine.process.start_group_watchdog).

First the mechanism with plain Python processes (multiprocessing's spawn, as vLLM uses), then the
real thing: serve-capture over the demo target with the real vLLM CPU build, killed with kill -9
once it answers, and every process it had started (found under it in /proc before the kill,
`VLLM::` ones included) counted a few seconds later: zero."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.servers import free_port
from support.vllm import EXACT, VLLM_PYTHON, require_vllm_venv
from support.workflow import DEMO_CONFIGFILE, SMALL_DEMO, SMALL_RUN, copy_workflow, merged

SETTLE_S = 5  # after the kill, before counting


def descendants(root: int) -> dict[int, str]:
    """pid -> `comm (cmdline)` of every process under `root` (not `root` itself)."""
    children: dict[int, list[int]] = {}
    names = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        comm, rest = stat[stat.index("(") + 1 : stat.rindex(")")], stat[stat.rindex(")") + 2 :]
        ppid = int(rest.split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
        names[int(entry.name)] = f"{comm} ({cmdline.strip()[:120]})"
    found, todo = {}, list(children.get(root, []))
    while todo:
        pid = todo.pop()
        found[pid] = names[pid]
        todo += children.get(pid, [])
    return found


def alive(pids) -> dict[int, str]:
    """The given processes still running (zombies are dead), with their comm."""
    running = {}
    for pid in pids:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except FileNotFoundError:
            continue
        if stat[stat.rindex(")") + 2] != "Z":
            running[pid] = stat[stat.index("(") + 1 : stat.rindex(")")]
    return running


def kill_group_and_count(leader: subprocess.Popen, tree: dict[int, str]) -> dict[int, str]:
    os.killpg(leader.pid, signal.SIGKILL)
    leader.wait()
    time.sleep(SETTLE_S)
    left = alive(tree)
    for pid in left:  # the test leaves nothing behind either way
        os.kill(pid, signal.SIGKILL)
    return left


# An engine's process as engine_process starts it (own group, dies with its parent), whose
# "engine" is a process started by multiprocessing's spawn, as vLLM starts EngineCore.
ENGINE = """
import multiprocessing, sys, time
from eaglenest.vllm_engine.process import start_group_watchdog

def engine_core():
    time.sleep(600)

if __name__ == "__main__":
    if sys.argv[1] == "watchdog":
        start_group_watchdog()
    multiprocessing.get_context("spawn").Process(target=engine_core).start()
    print("ready", flush=True)
    time.sleep(600)
"""
LAUNCHER = """
import subprocess, sys, time
from eaglenest.vllm_engine.process import die_with_parent
engine = subprocess.Popen([sys.executable, sys.argv[1], sys.argv[2]],
                          start_new_session=True, preexec_fn=die_with_parent())
time.sleep(600)
"""


@pytest.mark.parametrize("watchdog", ["watchdog", "none"])
def test_processes_an_engine_spawns_die_with_a_killed_launcher(watchdog, tmp_path):
    engine = tmp_path / "engine.py"  # spawn imports the main module from its file
    engine.write_text(ENGINE)
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, str(engine), watchdog],
        start_new_session=True, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert launcher.stdout.readline().strip() == "ready"
    time.sleep(1)
    tree = descendants(launcher.pid)
    spawned = [pid for pid, name in tree.items() if "multiprocessing" in name]
    assert spawned, tree  # the engine's spawned child, besides its process (and a watchdog)
    left = kill_group_and_count(launcher, tree)
    if watchdog == "watchdog":
        assert left == {}, left
    else:  # what happened before: the spawned child outlived everything
        assert left, tree


@pytest.mark.vllm
@pytest.mark.slow
def test_kill_9_of_serve_capture_leaves_no_engine_process(demo_target_dir, tmp_path):
    require_vllm_venv()
    workdir = copy_workflow(tmp_path / "wf")
    target = workdir / "results" / SMALL_RUN / "target"
    target.parent.mkdir(parents=True)
    os.symlink(demo_target_dir, target)
    config = merged(SMALL_DEMO, {
        "hidden": {**EXACT, "backend": "vllm"},
        "vllm": {"python": VLLM_PYTHON, "capture_url": f"http://127.0.0.1:{free_port()}"},
    })  # fmt: skip
    (workdir / "override.yaml").write_text(json.dumps(config))
    log = tmp_path / "server.log"
    serve = subprocess.Popen(
        [sys.executable, "-m", "eaglenest.cli", "serve-capture", "--configfile", DEMO_CONFIGFILE,
         "override.yaml", "--log", str(log), "--startup-timeout-s", "600"],
        cwd=workdir, stdout=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        ready = serve.stdout.readline()
        assert ready.startswith("EAGLENEST "), log.read_text()[-3000:]
        tree = descendants(serve.pid)
    except BaseException:
        os.killpg(serve.pid, signal.SIGKILL)
        raise
    engines = {pid: name for pid, name in tree.items() if name.startswith("VLLM::")}
    assert engines, tree  # EngineCore at least: the processes that were left behind
    left = kill_group_and_count(serve, tree)
    assert left == {}, f"left running after kill -9 of serve-capture: {left} of {tree}"
