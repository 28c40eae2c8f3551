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
start sooner), and the requests go out in the order of the prompt list, as from one queue. The
deference is bounded (DEFER_MAX_S): an older waiter that takes nothing for that long (stopped with
Ctrl-Z, a suspended SLURM job) no longer holds younger jobs back until it stops waiting.

The directory is the job's own: `$XDG_RUNTIME_DIR` (per user, mode 0700) where there is one, else
a per-user directory in the host's temp dir, created 0700; one that another user owns or may write
into is refused, and files in it are opened without following links, so no other local user can
plant a link or hold a slot byte. Only "held by another process" counts as held: any other lock
error (ENOLCK, EIO on NFS) is raised, naming the file, rather than retried forever.

Record locks belong to the process, not to the descriptor: within one process a second lock of a
byte it holds succeeds silently, so the process keeps its own set of held slots. Waiting is the
caller's (eaglenest.stages.generate.generate's endpoint pool): one scanner per process, woken by its own
releases and polling every POLL_S for other processes', so the cost is per process, not per
waiting request.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import random
import stat
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
# How long a process defers to an older one that waits without taking anything (see the doc).
DEFER_MAX_S = 10.0
# The errors of a non-blocking lock that mean "another process holds it".
HELD_ERRNOS = (errno.EAGAIN, errno.EACCES)


class SlotLockError(OSError):
    """The slot directory or lock file is unsafe or unusable; the message names it."""


def default_slots_dir() -> Path:
    """The host's slot directory, per user: every run on the host shares each endpoint's cap."""
    runtime_dir = os.environ.get("XDG_RUNTIME_DIR")
    if runtime_dir and Path(runtime_dir).is_dir():
        return Path(runtime_dir) / "eaglenest-endpoint-slots"
    return Path(tempfile.gettempdir()) / f"eaglenest-endpoint-slots-{os.getuid()}"


def owned_directory(directory: Path) -> Path:
    """`directory`, created 0700 if absent; refused unless it is a real directory (not a link)
    owned by this user that no one else may write into."""
    directory.parent.mkdir(parents=True, exist_ok=True)
    try:
        directory.mkdir(mode=0o700)
    except FileExistsError:
        pass
    info = directory.lstat()
    problem = None
    if not stat.S_ISDIR(info.st_mode):
        problem = "is not a directory (a link?)"
    elif info.st_uid != os.getuid():
        problem = f"is owned by uid {info.st_uid}, not this user ({os.getuid()})"
    elif info.st_mode & 0o022:
        problem = f"may be written by others (mode {stat.S_IMODE(info.st_mode):o})"
    if problem:
        raise SlotLockError(
            f"slot directory {directory} {problem}: another user could hold or redirect this "
            "job's request slots; remove it, or set generation.slots_dir to a directory of yours"
        )
    return directory


def open_nofollow(path: Path, flags: int) -> int:
    try:
        return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as err:
        raise SlotLockError(f"slot file {path}: {err.strerror} (a planted link?)") from err


def _held(err: OSError) -> bool:
    return err.errno in HELD_ERRNOS


def slot_file(slots_dir: Path, url: str) -> Path:
    return slots_dir / f"{hashlib.sha256(url.encode()).hexdigest()[:16]}.lock"


class EndpointSlots:
    """The `cap` request slots of the endpoint at `url`, shared by every process using `slots_dir`."""

    def __init__(self, url: str, cap: int, slots_dir: Path | None = None) -> None:
        self.url, self.cap = url, cap
        directory = owned_directory(slots_dir or default_slots_dir())
        self.path = slot_file(directory, url)
        self._fd = open_nofollow(self.path, os.O_RDWR | os.O_CREAT)
        # For a person looking at the directory: which endpoint a lock file stands for.
        label = open_nofollow(self.path.with_suffix(".url"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        with os.fdopen(label, "w") as stream:
            stream.write(url + "\n")
        self.held: set[int] = set()
        self.seniority = time.time_ns() // 1000  # older processes have smaller values
        self.waiting = False
        self.deferring_since: float | None = None  # when an older waiter was first seen

    def close(self) -> None:
        os.close(self._fd)  # releases every slot this process holds on the file

    def set_waiting(self, waiting: bool) -> None:
        """Say whether this process has requests waiting for a slot (see the module doc)."""
        if waiting != self.waiting:
            command = fcntl.LOCK_EX | fcntl.LOCK_NB if waiting else fcntl.LOCK_UN
            try:
                fcntl.lockf(self._fd, command, 1, WAITING_BASE + self.seniority, os.SEEK_SET)
            except OSError as err:
                if not _held(err):
                    raise self._error(err) from err
                return  # another process started in the same microsecond: no priority
            self.waiting = waiting

    def _error(self, err: OSError) -> SlotLockError:
        return SlotLockError(f"slot file {self.path} ({self.url}): lock failed: {err}")

    def older_waiting(self) -> bool:
        """Does a process that started before this one wait for a slot?"""
        query = struct.pack(_FLOCK, fcntl.F_WRLCK, os.SEEK_SET, WAITING_BASE, self.seniority, 0)
        try:
            answer = fcntl.fcntl(self._fd, fcntl.F_GETLK, query)
        except OSError as err:
            raise self._error(err) from err
        return struct.unpack(_FLOCK, answer)[0] != fcntl.F_UNLCK

    def defers(self) -> bool:
        """Should this process leave free slots to an older waiter now? Yes while one waits, for
        at most DEFER_MAX_S of its waiting (then no longer, until no older process waits)."""
        if not self.older_waiting():
            self.deferring_since = None
            return False
        now = time.monotonic()
        if self.deferring_since is None:
            self.deferring_since = now
        return now - self.deferring_since < DEFER_MAX_S

    def try_acquire(self) -> int | None:
        """A free slot, now, or None (also when an older process waits for one); scanned from a
        random start so processes spread out."""
        if len(self.held) >= self.cap or self.defers():
            return None
        start = random.randrange(self.cap)
        for offset in range(self.cap):
            index = (start + offset) % self.cap
            if index in self.held:
                continue
            try:
                fcntl.lockf(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, index, os.SEEK_SET)
            except OSError as err:
                if not _held(err):  # ENOLCK, EIO, ...: retrying 100 times a second fixes nothing
                    raise self._error(err) from err
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
