"""Whether a runner that owns runs is still there.

A runner is judged by its lease. The process check (pid and start time) is used only when
the owner is certainly on this machine and in this pid namespace: the same boot id and the
same pid-namespace identity. There a process that still exists is alive, even when paused,
so it is never taken over. A host name proves nothing (containers share them and reuse
pids), so it is never used on its own (SPEC 6).
"""

from __future__ import annotations

import functools
import os
import socket
import time

import msgspec


class OwnerRecord(msgspec.Struct, frozen=True):
    """A runner process that drives runs: how to tell whether it is still there.

    ``boot_id`` and ``pidns`` say which machine boot and which pid namespace ``pid`` is
    from: the process check is used only when both match the reader's own (SPEC 6).
    """

    owner: str
    pid: int
    host: str
    started: float
    lease_until: float
    boot_id: str = ""
    pidns: str = ""


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
    """True when a process with this pid exists in this pid namespace."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@functools.cache
def boot_id() -> str:
    """This machine's boot id ('' where the kernel does not say)."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            return f.read().strip()
    except OSError:
        return ""


def pid_namespace() -> str:
    """The identity of this process's pid namespace (device and inode of
    ``/proc/self/ns/pid``; '' where it cannot be read). Not cached: a process may move."""
    try:
        st = os.stat("/proc/self/ns/pid")
    except OSError:
        return ""
    return f"{st.st_dev}:{st.st_ino}"


def same_pid_space(record: OwnerRecord) -> bool:
    """True only when ``record``'s pid is certainly a pid of this machine's boot and of the
    pid namespace this process sees."""
    mine = boot_id(), pid_namespace()
    return bool(record.boot_id and record.pidns and all(mine)) and \
        (record.boot_id, record.pidns) == mine


def owner_alive(record: OwnerRecord | None, now: float | None = None) -> bool:
    """Whether the runner of ``record`` still drives its runs: in this machine's pid space,
    its process exists (a reused pid has another start time); elsewhere, its lease holds."""
    if record is None:
        return False
    if same_pid_space(record):
        return pid_alive(record.pid) and (not record.started
                                          or process_start(record.pid) == record.started)
    return record.lease_until >= (time.time() if now is None else now)


def this_process(owner: str, lease_until: float) -> OwnerRecord:
    """The owner record of the calling process, with its lease until ``lease_until``."""
    pid = os.getpid()
    return OwnerRecord(owner, pid, socket.gethostname(), process_start(pid), lease_until,
                       boot_id(), pid_namespace())
