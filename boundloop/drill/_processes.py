"""The drill's worker processes, from the drill's side: spawning them (in pid namespaces of
their own), watching their lives, and the probes that tell whether a frozen one holds a
lock every worker needs."""

from __future__ import annotations

import fcntl
import os
import select
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec


def can_unshare() -> bool:
    """True when workers can get pid namespaces of their own (root and unshare(1))."""
    if shutil.which("unshare") is None or os.geteuid() != 0:
        return False
    try:
        return subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"],
                              capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


class _Life(msgspec.Struct):
    """One worker process, from spawn to exit."""

    name: str
    slot: int
    piece: list[str]
    proc: Any
    out: Path
    err: Path
    owner: str = ""
    ready_at: float = 0.0  # when it said it was ready (its Runner open, sweeping)
    killed_at: float = 0.0
    exited_at: float = 0.0
    pauses: list[list[float]] = msgspec.field(default_factory=list)  # [stopped, resumed]
    resume_at: float = 0.0
    idle: bool = False  # its own runs are done (it may linger, taking over)

    @property
    def paused(self) -> bool:
        return bool(self.pauses) and self.pauses[-1][1] == 0.0

    def ready(self) -> bool:
        if not self.owner:
            try:
                words = self.out.read_text().split()
            except OSError:
                return False
            if len(words) >= 3 and words[0] == "ready":
                self.owner, self.ready_at = words[1], float(words[2])
        return bool(self.owner)

    def left_at(self) -> float:
        """When the worker began to leave (it printed ``leaving``, else ``bye``), 0.0 when it
        never did (killed, or still running)."""
        try:
            words = self.out.read_text().split()
        except OSError:
            return 0.0
        for word in ("leaving", "bye"):
            if word in words[:-1]:
                return float(words[words.index(word) + 1])
        return 0.0

    def able(self) -> list[tuple[float, float]]:
        """The stretches of time in which this worker could take runs over: ready, not
        frozen, not yet killed or gone."""
        if not self.ready_at:
            return []
        end = self.killed_at or self.exited_at or float("inf")
        stretches, t = [], self.ready_at
        for stopped, resumed in sorted(self.pauses):
            if stopped > t:
                stretches.append((t, min(stopped, end)))
            t = max(t, resumed or float("inf"))
        if t < end:
            stretches.append((t, end))
        return [(a, b) for a, b in stretches if a < b]

    def working(self) -> bool:
        """True until the worker says its own runs are done."""
        if not self.idle and self.ready():
            self.idle = "idle" in self.out.read_text().split()
        return not self.idle

    def signal(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass


class _Lines:
    """Counts the lines of a growing file, reading only what was added."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset, self.count = path, 0, 0

    def __call__(self) -> int:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return self.count
        self.offset += len(data)
        self.count += data.count(b"\n")
        return self.count


_PROBE = r"""
import fcntl, os, struct, sys, lmdb
env = lmdb.open(sys.argv[1], map_size=1 << 30, max_dbs=8, subdir=True, create=False)
# Opened once: closing a descriptor of lock.mdb would drop this process's LMDB locks on it.
lock = os.open(os.path.join(sys.argv[1], "lock.mdb"), os.O_RDWR)
def ofd(kind):
    fcntl.fcntl(lock, fcntl.F_OFD_SETLKW, struct.pack("hhqqi4x", kind, 0, 1 << 40, 1, 0))
for _ in sys.stdin:
    ofd(fcntl.F_WRLCK)  # boundloop's own write lock (journal.lmdb._lock._WriteLock), taken first
    ofd(fcntl.F_UNLCK)
    for _ in range(3):
        try:
            env.begin(write=True).abort()  # the writer's mutex
            # Two readers at once: the second takes a new reader slot, under the reader
            # table's mutex (the first reuses the spare one).
            a = env.begin()
            env.begin().abort()
            a.abort()
            break
        except lmdb.MapResizedError:
            env.set_mapsize(0)
    fd = os.open(sys.argv[2], os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)  # the drill's downstream
    os.close(fd)
    sys.stdout.write("ok\n")
    sys.stdout.flush()
"""


class _WriteLockProbe:
    """Tells whether the locks every worker shares can be taken: boundloop's write lock, the
    journal's writer and reader-table mutexes (LMDB) and the downstream's lock. A process of
    its own: LMDB allows one environment per process, and the drill's own Runner comes
    later."""

    def __init__(self, journal: Path, downstream: Path) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", _PROBE, str(journal),
                                      str(downstream)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def free(self, timeout: float, on_wait: Callable[[], None],
             on_stuck: Callable[[], None] | None = None) -> bool:
        """True when the lock was taken within ``timeout``; else calls ``on_wait`` (which
        must let the holder go) and waits for the probe's answer, calling ``on_stuck``
        every 2 s it still waits (a worker frozen by an earlier pause may hold the lock:
        that pause must end, or the drill would wait for it forever)."""
        stdin, stdout = self.proc.stdin, self.proc.stdout
        assert stdin is not None and stdout is not None
        stdin.write("probe\n")
        stdin.flush()
        ready, _, _ = select.select([stdout], [], [], timeout)
        if not ready:
            on_wait()
            while on_stuck is not None and not select.select([stdout], [], [], 2.0)[0]:
                on_stuck()
        if not stdout.readline():
            raise RuntimeError("the drill's write-lock probe died")
        return bool(ready)

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(timeout=10)


class _TidBlocks:
    """Ranges of thread ids for the workers' pid namespaces, never two alike at once.

    LMDB tells processes apart by pid (reader slots: two pid-1 processes cannot even open
    one journal) and its robust mutexes name their holder by thread id, which is unique
    only within a pid namespace: when a thread is killed while it waits for a mutex that a
    thread of another namespace with the same id holds, the kernel declares the holder dead,
    a third process takes the mutex too, and LMDB's exclusion is gone (seen here as
    segfaults in glibc's robust-list code). So each worker's namespace starts its thread ids
    at its own block of ``SIZE`` (``ns_last_pid``), away from the blocks of the workers
    alive, of those that died lately, and of the drill's probe (of this pid namespace).
    """

    SIZE = 1000
    GRACE_S = 2.0  # a block is reused this long after its worker was reaped, at the soonest

    def __init__(self) -> None:
        self.count = max(2, _pid_max() // self.SIZE)
        self.busy: dict[int, str] = {}  # block -> worker
        self.freed: dict[int, float] = {}  # block -> when its worker was reaped
        self.avoid: set[int] = set()
        self.next = 1

    def take(self, name: str) -> int:
        """The first pid of a block for worker ``name``."""
        for _ in range(2):
            for i in range(self.count - 1):
                b = 1 + (self.next - 1 + i) % (self.count - 1)
                if b in self.busy or b in self.avoid or (
                        b in self.freed and time.monotonic() - self.freed[b] < self.GRACE_S):
                    continue
                self.next = b + 1
                self.busy[b] = name
                return b * self.SIZE
            time.sleep(0.5)
        raise RuntimeError("no block of thread ids is free for another worker")

    def give_back(self, name: str) -> None:
        for b, who in list(self.busy.items()):
            if who == name:
                del self.busy[b]
                self.freed[b] = time.monotonic()


def _pid_max() -> int:
    try:
        return int(Path("/proc/sys/kernel/pid_max").read_text())
    except (OSError, ValueError):
        return 32768


def _spawn(base: Path, n: int, slot: int, runs: list[str], seed: int, concurrency: int,
           lease_s: float = 30.0, pidns: bool = False,
           tids: _TidBlocks | None = None, journal: str | None = None,
           compress: bool = False) -> _Life:
    name = f"w{n}"
    runs_file = base / "pieces" / f"runs-{n}.txt"
    runs_file.parent.mkdir(exist_ok=True)
    runs_file.write_text("\n".join(runs))
    logs = base / "logs"
    logs.mkdir(exist_ok=True)
    argv = [sys.executable, "-m", "boundloop.drill", "worker",
            journal or str(base / "journal"), str(base / "ledger"), str(runs_file), str(seed),
            str(concurrency), str(base / "recovered.jsonl"), "--lease", str(lease_s),
            "--name", name, "--notes", str(logs / f"{name}.jsonl"),
            "--linger", str(base / "linger")] + (["--compress"] if compress else [])
    return _popen(logs, name, slot, runs, argv, pidns, tids)


def _popen(logs: Path, name: str, slot: int, runs: list[str], argv: list[str], pidns: bool,
           tids: _TidBlocks | None) -> _Life:
    """Start worker ``name`` (``argv``, which takes ``--pid``), in a pid namespace of its
    own when ``pidns``, its output in ``logs``."""
    if pidns:
        # Thread-id blocks matter to LMDB's robust mutexes only (see _TidBlocks).
        first = [] if tids is None else ["--pid", str(tids.take(name))]
        argv = ["unshare", "--pid", "--fork", "--mount-proc", *argv, *first]
    out, err = logs / f"{name}.out", logs / f"{name}.err"
    with open(out, "wb") as o, open(err, "wb") as e:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=o, stderr=e,
                                start_new_session=True)
    return _Life(name, slot, runs, proc, out, err)


class _FlockProbe:
    """On a PostgreSQL journal, the one lock every worker shares is the downstream's (the row
    locks of a frozen worker's open transaction are the server's to free: it ends an idle
    transaction after half the lease, see ``boundloop.journal.postgres``)."""

    def __init__(self, lock: Path) -> None:
        self.lock = lock

    def free(self, timeout: float, on_wait: Callable[[], None]) -> bool:
        """True when the lock was taken within ``timeout``; else calls ``on_wait``."""
        fd = os.open(self.lock, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            deadline = time.monotonic() + timeout
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    return True
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        on_wait()
                        return False
                    time.sleep(0.002)
        finally:
            os.close(fd)  # and the lock with it

    def close(self) -> None:
        pass
