"""The endpoint cap holds on shared hosts: the slot directory is the job's own (private, links
not followed), an endpoint listed twice is a config error, deference to an older waiter is bounded
and benched endpoints are not waited on, and only "held" counts as held. Real lock files, real
processes stopped with real signals."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time

import pytest
from support.workflow import REPO

from eaglenest.client.endpoints import Endpoint
from eaglenest.common.config import ConfigError, validate_config

SRC = REPO / "src"


def test_the_slot_directory_is_owned_private_and_its_links_are_not_followed(tmp_path, monkeypatch):
    from eaglenest.client.slots import EndpointSlots, SlotLockError, default_slots_dir, slot_file

    runtime_dir = tmp_path / "run-user"
    runtime_dir.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime_dir))
    directory = default_slots_dir()
    assert directory.parent == runtime_dir
    EndpointSlots("http://h:1", 2).close()
    assert directory.stat().st_mode & 0o777 == 0o700

    # Another user's planted link: the job must not write through it.
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    label = slot_file(directory, "http://h:2").with_suffix(".url")
    label.symlink_to(victim)
    with pytest.raises(SlotLockError, match="link"):
        EndpointSlots("http://h:2", 2)
    assert victim.read_text() == "precious\n"

    open_to_all = tmp_path / "open"
    open_to_all.mkdir()
    open_to_all.chmod(0o777)
    with pytest.raises(SlotLockError, match="written by others"):
        EndpointSlots("http://h:3", 2, open_to_all)
    if os.getuid() == 0:  # as root the test can make a directory another user owns
        theirs = tmp_path / "theirs"
        theirs.mkdir(mode=0o700)
        os.chown(theirs, 65534, 65534)
        with pytest.raises(SlotLockError, match="owned by uid 65534"):
            EndpointSlots("http://h:4", 2, theirs)


def test_the_same_endpoint_listed_twice_is_a_config_error(tmp_path):
    from eaglenest.client.pool import EndpointPool

    twice = [{"url": "http://h:8000"}, {"url": "HTTP://H:8000/v1/"}]
    with pytest.raises(ConfigError, match=r"entries 0 .* and 1 .* are the same endpoint"):
        validate_config({"endpoints": twice})
    assert validate_config({"endpoints": [{"url": "http://h:8000"}, {"url": "http://h:8001"}]})

    async def pool():
        EndpointPool([Endpoint("http://h:80"), Endpoint("http://h/v1")], 3, 1.0, tmp_path)

    with pytest.raises(ValueError, match="same endpoint"):
        asyncio.run(pool())


OLDER_WAITER = """
import os, signal, sys
from pathlib import Path
from eaglenest.client.slots import EndpointSlots
slots = EndpointSlots("http://h:7", 2, Path(sys.argv[1]))
slots.set_waiting(True)
print("waiting", flush=True)
os.kill(os.getpid(), signal.SIGSTOP)  # Ctrl-Z, a suspended SLURM job
"""


def test_a_stopped_older_waiter_holds_younger_jobs_back_only_for_a_while(tmp_path, monkeypatch):
    import eaglenest.client.slots as slots_module

    monkeypatch.setattr(slots_module, "DEFER_MAX_S", 0.5, raising=False)
    older = subprocess.Popen(
        [sys.executable, "-c", OLDER_WAITER, str(tmp_path)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(SRC)},
    )
    try:
        assert older.stdout.readline() == "waiting\n"
        younger = slots_module.EndpointSlots("http://h:7", 2, tmp_path)
        assert younger.older_waiting()
        deadline = time.monotonic() + 5
        got = None
        while got is None and time.monotonic() < deadline:
            got = younger.try_acquire()
            time.sleep(0.05)
        assert got is not None, "a stopped older waiter stalled the younger job"
        younger.close()
    finally:
        older.kill()
        older.wait()


def test_a_job_marks_itself_waiting_only_where_it_would_take_a_slot(tmp_path):
    from eaglenest.client.pool import EndpointPool

    async def scenario():
        pool = EndpointPool(
            [Endpoint("http://a:1", max_concurrency=1), Endpoint("http://b:1", max_concurrency=1)],
            3,
            60.0,
            tmp_path,
        )
        first = await pool.acquire()
        other = pool.states[1] if first.state is pool.states[0] else pool.states[0]
        other.benched_until = time.monotonic() + 60  # the other endpoint is benched
        waiter = asyncio.create_task(pool.acquire())
        await asyncio.sleep(0.1)  # waits: the healthy endpoint's one slot is taken
        marks = (first.state.slots.waiting, other.slots.waiting)
        pool.release(first, ok=True)
        pool.release(await waiter, ok=True)
        pool.close()
        return marks

    assert asyncio.run(scenario()) == (True, False)


def test_a_lock_error_other_than_held_is_raised_not_retried_forever(tmp_path):
    from eaglenest.client.slots import EndpointSlots, SlotLockError

    slots = EndpointSlots("http://h:8", 2, tmp_path)
    os.close(slots._fd)
    # A descriptor the kernel refuses write locks on (EBADF), as NFS may refuse with ENOLCK/EIO.
    slots._fd = os.open(slots.path, os.O_RDONLY)
    with pytest.raises(SlotLockError, match=r"\.lock.*http://h:8"):
        slots.try_acquire()
    slots.close()
