"""One cap per endpoint across every process on a host: `max_concurrency` request slots per
endpoint, shared by all shard jobs through byte-range locks on one file per endpoint.

Why locks on a file: generation jobs are local rules (they do HTTP only), so however many shard
jobs Snakemake runs at once, they run on one host and see one lock file. A slot is byte `i` of
`<slots_dir>/<hash of the URL>.lock`, held with a POSIX record lock (`lockf`): the kernel frees it
when the holder exits, a `kill -9` included, so a crashed job never leaks a slot and no broker has
to be started, found or cleaned up. POSIX locks also work across hosts on NFSv4, so a `slots_dir`
on a shared filesystem extends the cap to jobs on other nodes.

Older jobs first: a process whose requests wait for a slot marks it with a lock on one byte past
the slots, at an offset that grows with its start time, and a process takes a slot only when no
older process is waiting. Shards then finish in the order Snakemake started them (later stages
start sooner), and the requests go out in the order of the prompt list, as from one queue.

Record locks belong to the process, not to the descriptor: within one process a second lock of a
byte it holds succeeds silently, so the process keeps its own set of held slots. Waiting is the
caller's (eaglenest.stages.generate's endpoint pool): one scanner per process, woken by its own
releases and polling every POLL_S for other processes', so the cost is per process, not per
waiting request.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import random
import struct
import tempfile
import time
from pathlib import Path

# How often a process whose requests all wait looks again for a slot another process freed.
POLL_S = 0.01
# Waiting marks live at WAITING_BASE + the process's start time in microseconds, far past any cap.
WAITING_BASE = 1 << 40
# struct flock on Linux (x86-64, aarch64): short l_type, short l_whence, off_t l_start,
# off_t l_len, pid_t l_pid, padded to 32 bytes.
_FLOCK = "hhqqi4x"


def default_slots_dir() -> Path:
    """The host's slot directory, per user: every run on the host shares each endpoint's cap."""
    return Path(tempfile.gettempdir()) / f"eaglenest-endpoint-slots-{os.getuid()}"


def slot_file(slots_dir: Path, url: str) -> Path:
    return slots_dir / f"{hashlib.sha256(url.encode()).hexdigest()[:16]}.lock"


class EndpointSlots:
    """The `cap` request slots of the endpoint at `url`, shared by every process using `slots_dir`."""

    def __init__(self, url: str, cap: int, slots_dir: Path | None = None) -> None:
        self.url, self.cap = url, cap
        directory = slots_dir or default_slots_dir()
        directory.mkdir(parents=True, exist_ok=True)
        self.path = slot_file(directory, url)
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        # For a person looking at the directory: which endpoint a lock file stands for.
        self.path.with_suffix(".url").write_text(url + "\n")
        self.held: set[int] = set()
        self.seniority = time.time_ns() // 1000  # older processes have smaller values
        self.waiting = False

    def close(self) -> None:
        os.close(self._fd)  # releases every slot this process holds on the file

    def set_waiting(self, waiting: bool) -> None:
        """Say whether this process has requests waiting for a slot (see the module doc)."""
        if waiting != self.waiting:
            command = fcntl.LOCK_EX | fcntl.LOCK_NB if waiting else fcntl.LOCK_UN
            try:
                fcntl.lockf(self._fd, command, 1, WAITING_BASE + self.seniority, os.SEEK_SET)
            except OSError:  # another process started in the same microsecond: no priority
                return
            self.waiting = waiting

    def older_waiting(self) -> bool:
        """Does a process that started before this one wait for a slot?"""
        query = struct.pack(_FLOCK, fcntl.F_WRLCK, os.SEEK_SET, WAITING_BASE, self.seniority, 0)
        answer = fcntl.fcntl(self._fd, fcntl.F_GETLK, query)
        return struct.unpack(_FLOCK, answer)[0] != fcntl.F_UNLCK

    def try_acquire(self) -> int | None:
        """A free slot, now, or None (also when an older process waits for one); scanned from a
        random start so processes spread out."""
        if len(self.held) >= self.cap or self.older_waiting():
            return None
        start = random.randrange(self.cap)
        for offset in range(self.cap):
            index = (start + offset) % self.cap
            if index in self.held:
                continue
            try:
                fcntl.lockf(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, index, os.SEEK_SET)
            except OSError:  # held by another process
                continue
            self.held.add(index)
            return index
        return None

    def release(self, index: int) -> None:
        self.held.discard(index)
        fcntl.lockf(self._fd, fcntl.LOCK_UN, 1, index, os.SEEK_SET)

    def in_use(self) -> int:
        """Slots held now by every process (this one's own included), without taking any."""
        others = 0
        for index in range(self.cap):
            if index in self.held:
                continue
            query = struct.pack(_FLOCK, fcntl.F_WRLCK, os.SEEK_SET, index, 1, 0)
            answer = fcntl.fcntl(self._fd, fcntl.F_GETLK, query)
            if struct.unpack(_FLOCK, answer)[0] != fcntl.F_UNLCK:
                others += 1
        return others + len(self.held)
