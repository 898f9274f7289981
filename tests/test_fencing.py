"""Ownership that holds (SPEC 6 "Ownership and fencing"), with real processes.

A worker in its own pid namespace (``unshare --pid``, as a container would be) is frozen
with SIGSTOP inside a handler, past its lease; another runner takes the run over; the
frozen worker is let go. A side-effect ledger shows that nothing ran twice and that the
fenced worker started nothing after the claim, and the journal that it appended nothing.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import boundloop as bl
from boundloop import events as ev

sys.path.insert(0, str(Path(__file__).parent))
from fence_worker import RUN_ID, mail_tool, script  # noqa: E402

WORKER = Path(__file__).parent / "fence_worker.py"
LEASE = 1.5


def _can_unshare() -> bool:
    if shutil.which("unshare") is None or os.geteuid() != 0:
        return False
    return subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"],
                          capture_output=True).returncode == 0


needs_unshare = pytest.mark.skipif(not _can_unshare(),
                                   reason="needs root and unshare(1) for a pid namespace")


class Worker:
    def __init__(self, tmp: Path, *, unshare: bool, hold: float, tool: str = "plain") -> None:
        self.journal, self.ledger, self.marker = tmp / "j", tmp / "ledger", tmp / "marker"
        argv = [sys.executable, str(WORKER), str(self.journal), str(self.ledger),
                str(self.marker), "--lease", str(LEASE), "--hold", str(hold), "--tool", tool]
        if unshare:
            argv = ["unshare", "--pid", "--fork", "--mount-proc", *argv]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     start_new_session=True, env=env)

    def wait_in_handler(self) -> None:
        end = time.monotonic() + 20
        while not self.marker.exists():
            assert self.proc.poll() is None, self.proc.communicate()
            assert time.monotonic() < end, "the worker never reached its first handler"
            time.sleep(0.01)

    def signal(self, sig: int) -> None:
        os.killpg(self.proc.pid, sig)

    def result(self) -> dict[str, object]:
        out, err = self.proc.communicate(timeout=30)
        assert self.proc.returncode == 0, err.decode()
        return json.loads(out.decode().strip().splitlines()[-1])  # type: ignore[no-any-return]

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.signal(signal.SIGCONT)
            self.signal(signal.SIGKILL)
            self.proc.wait()

    def lines(self) -> list[list[str]]:
        if not self.ledger.exists():
            return []
        return [line.split() for line in self.ledger.read_text().splitlines()]


@pytest.fixture
def workers(tmp_path: Path) -> Iterator[list[Worker]]:
    started: list[Worker] = []
    yield started
    for w in started:
        w.kill()


def kinds(events: list[ev.Event]) -> list[str]:
    return [type(e).__name__ for e in events]


@needs_unshare
@pytest.mark.timeout(60)
def test_a_frozen_worker_in_another_pid_namespace_is_fenced_after_a_takeover(
        tmp_path: Path, workers: list[Worker]) -> None:
    a = Worker(tmp_path, unshare=True, hold=0.5)
    workers.append(a)
    a.wait_in_handler()
    a.signal(signal.SIGSTOP)
    time.sleep(LEASE * 2)  # past A's lease: only the lease can judge A from here
    with bl.Runner(a.journal) as b:
        [found] = b.recover()
        assert found.run_id == RUN_ID
        assert [(u.call_id, u.phase) for u in found.unresolved] == \
            [("c1", "dispatched"), ("c2", "intended"), ("c3", "intended")]
        claimed_at = len(list(b.journal.events(RUN_ID)))
        a.signal(signal.SIGCONT)
        result = a.result()  # A wakes in its handler, then finds itself fenced
        assert result["status"] == "journal_unavailable", result
        assert result["tool_calls"] == 3
        after = list(b.journal.events(RUN_ID))
        assert len(after) == claimed_at, kinds(after[claimed_at:])  # A appended nothing
        # B goes on: a person decides the first mail (it did go out), and the two that
        # never started.
        b.resolve(RUN_ID, f"{RUN_ID}:1:0", "succeeded", note="seen in the mail log")
        b.resolve(RUN_ID, f"{RUN_ID}:1:1", "failed", note="never dispatched")
        b.resolve(RUN_ID, f"{RUN_ID}:1:2", "failed", note="never dispatched")
        resumed = b.resume(RUN_ID, model=bl.ScriptedModel([bl.Final("done")]),
                           tools=[mail_tool(a.ledger, "B")])
        assert resumed.status == "final"
        assert bl.replay(b.journal.events(RUN_ID)).epoch == 2
    # A sent mail 1 once, at epoch 1, and nothing after the claim; nothing ran twice.
    assert a.lines() == [["A", "1", "1", "1"]]


@needs_unshare
@pytest.mark.timeout(60)
def test_a_live_worker_in_another_pid_namespace_is_not_taken_over(
        tmp_path: Path, workers: list[Worker]) -> None:
    # A records pid 1 in its own namespace; this process has its own pid 1 too. Judged by
    # its lease (which it renews), A is alive: no claim mid-handler.
    a = Worker(tmp_path, unshare=True, hold=LEASE * 2)
    workers.append(a)
    a.wait_in_handler()
    with bl.Runner(a.journal) as b:
        owners = b.journal.owners()
        mine = [o for o in owners.values() if o.owner != b.owner]
        assert [o.pid for o in mine] == [1]
        deadline = time.monotonic() + LEASE * 1.5
        while time.monotonic() < deadline:
            assert b.recover() == []
            time.sleep(0.2)
    result = a.result()
    assert result["status"] == "final", result
    assert [line[:2] for line in a.lines()] == [["A", "1"], ["A", "2"], ["A", "3"]]


@pytest.mark.timeout(60)
def test_a_paused_worker_on_this_machine_is_alive_and_never_taken_over(
        tmp_path: Path, workers: list[Worker]) -> None:
    a = Worker(tmp_path, unshare=False, hold=0.3)
    workers.append(a)
    a.wait_in_handler()
    a.signal(signal.SIGSTOP)
    time.sleep(LEASE * 2)  # its lease expired, but its process exists: no zombie possible
    with bl.Runner(a.journal) as b:
        assert b.recover() == []
        with pytest.raises(bl.RecoveryError, match="live runner"):
            b.resume(RUN_ID, model=script(), tools=[mail_tool(a.ledger, "B")])
    a.signal(signal.SIGCONT)
    result = a.result()
    # A's lease ran out while it was paused: it fenced itself rather than start c2.
    assert result["status"] in ("final", "journal_unavailable"), result
    assert [line[0] for line in a.lines()] == ["A"] * len(a.lines())
    assert len({line[1] for line in a.lines()}) == len(a.lines())


@pytest.mark.timeout(60)
def test_resolve_refuses_a_live_run_unless_forced_and_force_fences_the_owner(
        tmp_path: Path, workers: list[Worker]) -> None:
    a = Worker(tmp_path, unshare=False, hold=3.0, tool="irreversible")
    workers.append(a)
    a.wait_in_handler()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    cli = [sys.executable, "-m", "boundloop", "--journal", str(a.journal), "resolve", RUN_ID,
           f"{RUN_ID}:1:0", "--outcome", "failed"]
    refused = subprocess.run(cli, capture_output=True, text=True, env=env, timeout=30)
    assert refused.returncode != 0
    assert "live runner" in refused.stderr and "--force" in refused.stderr
    forced = subprocess.run([*cli, "--force"], capture_output=True, text=True, env=env,
                            timeout=30)
    assert forced.returncode == 0, forced.stderr
    result = a.result()
    assert result["status"] == "journal_unavailable", result  # fenced: it stopped there
    assert [line[:2] for line in a.lines()] == [["A", "1"]]  # c2 and c3 never started
    with bl.Runner(a.journal) as b:
        events = list(b.journal.events(RUN_ID))
        resolved = [e for e in events if isinstance(e, ev.CallResolved)]
        assert [(e.execution_id, e.outcome, e.forced) for e in resolved] == \
            [(f"{RUN_ID}:1:0", "failed", True)]
        claims = [e for e in events if isinstance(e, ev.OwnerClaimed)]
        assert [e.epoch for e in claims] == [2]
        assert bl.replay(events).epoch == 2
