"""An atomic write removes the stale temp siblings of its output and keeps a live writer's
(held under a real lock by another process)."""

from __future__ import annotations

import json
import subprocess
import sys

from eaglenest.common.io import write_json

HOLDER = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDONLY)
fcntl.flock(fd, fcntl.LOCK_EX)
print("held", flush=True)
time.sleep(60)
"""


def test_stale_temp_siblings_are_removed_and_a_live_writers_kept(tmp_path):
    out = tmp_path / "out.json"
    stale = tmp_path / ".out.json.deadbeef.tmp"
    stale.write_bytes(b"\0" * 1000)
    stale_dir = tmp_path / ".out.json.0000ffff.tmp"
    stale_dir.mkdir()
    live = tmp_path / ".out.json.0badcafe.tmp"
    live.write_text("being written")
    unrelated = tmp_path / ".other.json.deadbeef.tmp"
    unrelated.write_text("x")
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(live)], stdout=subprocess.PIPE)
    try:
        assert holder.stdout.readline() == b"held\n"
        write_json(out, {"ok": True})
    finally:
        holder.kill()
        holder.wait()
    assert not stale.exists() and not stale_dir.exists()
    assert live.exists() and unrelated.exists()
    assert json.loads(out.read_text()) == {"ok": True}
