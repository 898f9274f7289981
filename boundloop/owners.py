"""Whether a runner that owns runs is still there: its process on this host, else its lease."""

from __future__ import annotations

import os
import socket
import time

from boundloop.journal.base import OwnerRecord


def process_start(pid: int) -> float:
    """The process's start time in clock ticks since boot (0.0 when unknown), to tell a
    live owner from a new process that reused its pid."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return float(fields[19])
    except (OSError, IndexError, ValueError):
        return 0.0


def pid_alive(pid: int) -> bool:
    """True when a process with this pid exists on this host."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def owner_alive(record: OwnerRecord | None, now: float | None = None) -> bool:
    """Whether the runner of ``record`` still drives its runs. On this host the kernel
    answers (a reused pid has another start time); elsewhere, the lease."""
    if record is None:
        return False
    if record.host == socket.gethostname():
        return pid_alive(record.pid) and (not record.started
                                          or process_start(record.pid) == record.started)
    return record.lease_until >= (time.time() if now is None else now)


def this_process() -> tuple[int, str, float]:
    """(pid, host, start time) of the calling process."""
    pid = os.getpid()
    return pid, socket.gethostname(), process_start(pid)
