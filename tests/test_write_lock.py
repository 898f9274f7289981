"""A process paused or stuck while it holds the journal's write lock cannot keep a run past its
deadline's grace, nor any API call waiting for ever (SPEC 1): writes wait for the lock within
the run's deadline (else ``LOCK_WAIT_S``), then fail closed. Real processes: the holder opens
the journal, enters a write transaction and stops itself (SIGSTOP), as a worker frozen mid-commit
does."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import boundloop as bl
from boundloop.journal import lmdb as bl_lmdb

HOLDER = """
import os, signal, sys
from boundloop.journal.lmdb import LmdbJournal
journal = LmdbJournal(sys.argv[1])
with journal._txn(write=True):
    print("held", flush=True)
    os.kill(os.getpid(), signal.SIGSTOP)  # frozen inside its write transaction
"""


class Holder:
    """A process frozen (SIGSTOP) while it holds the write lock of the journal at ``path``."""

    def __init__(self, path: Path) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(path)],
                                     stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        assert self.proc.stdout.readline().strip() == "held"
        deadline = time.monotonic() + 10
        while not _stopped(self.proc.pid):
            assert time.monotonic() < deadline, "the holder did not stop itself"
            time.sleep(0.01)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=10)


def _stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"


@pytest.fixture
def journal(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "j"
    with bl.Runner(path) as runner:  # the journal exists, with a finished run in it
        assert runner.run(model=bl.ScriptedModel([bl.Final("ok")]), tools=[],
                          prompt="p").status == "final"
    yield path


def test_a_run_with_a_deadline_ends_in_time_while_a_frozen_process_holds_the_lock(
        journal: Path) -> None:
    with bl.Runner(journal) as runner:
        holder = Holder(journal)
        try:
            started = time.monotonic()
            result = runner.run(model=bl.ScriptedModel([bl.Final("ok")]), tools=[],
                                prompt="p", run_id="late", budget=bl.Budget(deadline_s=1.0))
            took = time.monotonic() - started
            assert result.status == "journal_unavailable", result
            assert took <= 1.5, took  # the deadline plus its grace (SPEC 1, 5)
            assert "write lock" in (result.explanation or "")
            assert result.model_steps == 0  # nothing ran: its start could not be recorded
        finally:
            holder.kill()  # the kernel lets go of a dead process's lock
        assert "late" not in list(runner.journal.runs())
        after = runner.run(model=bl.ScriptedModel([bl.Final("ok")]), tools=[], prompt="p",
                           run_id="after", budget=bl.Budget(deadline_s=5.0))
        assert after.status == "final"


def test_an_outcome_that_cannot_be_recorded_in_time_is_left_unresolved(journal: Path) -> None:
    frozen: list[Holder] = []

    def freeze_then_answer(text: str) -> str:
        frozen.append(Holder(journal))  # the lock is taken while the handler runs
        return text

    tool = bl.Tool("echo", freeze_then_answer)
    model = bl.ScriptedModel([bl.CallTools([bl.ToolCall("c1", "echo", {"text": "x"})]),
                              bl.Final("done")])
    with bl.Runner(journal) as runner:
        try:
            started = time.monotonic()
            result = runner.run(model=model, tools=[tool], prompt="p", run_id="mid",
                                budget=bl.Budget(deadline_s=3.0))
            took = time.monotonic() - started
        finally:
            for h in frozen:
                h.kill()
        assert result.status == "journal_unavailable", result
        assert took <= 3.5, took
        assert result.tool_calls == 1
        assert [u.tool for u in result.unresolved] == ["echo"]  # ran; its outcome unrecorded
        kinds = [type(e).__name__ for e in runner.journal.events("mid")]
        assert kinds[-1] == "CallDispatched" and "RunFinished" not in kinds


@pytest.mark.parametrize("budget", [None, bl.Budget(deadline_s=30)],
                         ids=["no deadline", "a long deadline"])
def test_a_write_waits_lock_wait_s_at_most_then_fails_closed(
        journal: Path, monkeypatch: pytest.MonkeyPatch, budget: bl.Budget | None) -> None:
    monkeypatch.setattr(bl_lmdb._lock, "LOCK_WAIT_S", 1.0)
    with bl.Runner(journal) as runner:
        holder = Holder(journal)
        try:
            started = time.monotonic()
            result = runner.run(model=bl.ScriptedModel([bl.Final("ok")]), tools=[],
                                prompt="p", run_id="waited", budget=budget)
            took = time.monotonic() - started
        finally:
            holder.kill()
    assert result.status == "journal_unavailable" and 0.9 <= took <= 3.0, (result, took)


def test_opening_a_runner_gives_up_with_a_clear_error(journal: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bl_lmdb._lock, "LOCK_WAIT_S", 1.0)
    holder = Holder(journal)
    try:
        started = time.monotonic()
        with pytest.raises(bl.JournalUnavailable, match="write lock"):
            bl.Runner(journal)
        assert time.monotonic() - started <= 3.0
    finally:
        holder.kill()
    with bl.Runner(journal) as runner:  # and once it is free, all is well
        assert len(list(runner.journal.runs())) == 1


def test_a_supervisor_waiting_for_the_lock_still_serves_its_other_runs(
        journal: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One supervisor: a run without a deadline waits for the lock on the writer thread, not
    on the supervisor's, so a run with a deadline there still ends in time."""
    monkeypatch.setattr(bl_lmdb._lock, "LOCK_WAIT_S", 4.0)
    with bl.Runner(journal, supervisors=1) as runner:
        holder = Holder(journal)
        try:
            patient = runner.submit(bl.ScriptedModel([bl.Final("ok")]), [], "p",
                                    run_id="patient")
            time.sleep(0.2)  # its admission is waiting for the lock
            started = time.monotonic()
            hurried = runner.run(model=bl.ScriptedModel([bl.Final("ok")]), tools=[],
                                 prompt="p", run_id="hurried",
                                 budget=bl.Budget(deadline_s=0.5))
            took = time.monotonic() - started
            assert hurried.status == "journal_unavailable" and took <= 1.0, (hurried, took)
            assert not patient.done()
        finally:
            threading.Timer(0.5, holder.kill).start()
        assert patient.result(timeout=10).status == "final"  # it got the lock once free


def test_the_lock_costs_writes_nothing_when_free(journal: Path) -> None:
    """Writers in two processes take turns (no lock left behind by a commit)."""
    code = ("import boundloop as bl, sys\n"
            "with bl.Runner(sys.argv[1]) as r:\n"
            "    for i in range(20):\n"
            "        assert r.run(model=bl.ScriptedModel([bl.Final('ok')]), tools=[],"
            " prompt='p').status == 'final'\n")
    env = {**os.environ}
    procs = [subprocess.Popen([sys.executable, "-c", code, str(journal)], env=env)
             for _ in range(2)]
    for p in procs:
        assert p.wait(timeout=120) == 0
    with bl.Runner(journal) as runner:
        assert len(list(runner.journal.runs())) == 41
    assert signal.SIGSTOP  # (the frozen-holder tests above use it)


# -- found by an attacker pass -------------------------------------------------------------------
BUSY = """
import sys, time
from boundloop.journal.lmdb import LmdbJournal
journal = LmdbJournal(sys.argv[1])
print("held", flush=True)
end = time.monotonic() + float(sys.argv[2])
while time.monotonic() < end:  # another process, merely busy: short commits back to back
    with journal._txn(write=True) as txn:
        txn.put(b"busy", b"x", db=journal._meta)
        time.sleep(0.003)
    time.sleep(0.0003)
"""


def busy_peer(path: Path, seconds: float) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-c", BUSY, str(path), str(seconds)],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


def test_a_runs_appends_stay_in_order_when_the_lock_is_busy(journal: Path) -> None:
    """Pipelined appends of one run (seq 1, then 2) while another process commits: a first
    append handed to the writer (the lock was busy) is never overtaken by the second."""
    from boundloop import events as ev
    from boundloop.errors import SequenceConflict

    conflicts: list[str] = []

    def note(err: BaseException | None) -> None:
        if isinstance(err, SequenceConflict):
            conflicts.append(str(err))

    peer = busy_peer(journal, 20)
    try:
        with bl_lmdb.LmdbJournal(journal) as j:
            for i in range(150):
                rid = f"r{i}"
                j.append(rid, 0, [ev.RunAdmitted(run_id=rid, budget=bl.Budget(), history=[],
                                                 tools=[], owner="x")])
                j.submit_many([(rid, 1, [ev.RunResumed(run_id=rid)], note, None)])
                j.submit_many([(rid, 2, [ev.RunResumed(run_id=rid)], note, None)])
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and \
                    any(j.find(f"r{i}").last_seq < 3 for i in range(150)):  # type: ignore[union-attr]
                time.sleep(0.05)
            assert conflicts == []
            assert all(j.find(f"r{i}").last_seq == 3 for i in range(150))  # type: ignore[union-attr]
    finally:
        peer.kill()
        peer.wait(timeout=10)


def test_a_run_past_its_deadline_still_records_its_end_while_the_lock_is_busy(
        journal: Path) -> None:
    """A model overrunning the deadline is abandoned at its grace; the run's closing append
    then waits a little for a lock another process holds only briefly, instead of failing."""
    def slow(history: object, ctx: object) -> bl.Final:
        time.sleep(1.0)
        return bl.Final("late")

    peer = busy_peer(journal, 20)
    try:
        with bl.Runner(journal) as runner:
            futures = [runner.submit(slow, [], "p", run_id=f"g{i}",
                                     budget=bl.Budget(deadline_s=0.3)) for i in range(8)]
            results = [f.result(timeout=30) for f in futures]
            assert {(r.status, r.exhausted_limit) for r in results} == \
                {("limit_exceeded", "deadline")}, [r.explanation for r in results]
            for r in results:
                assert type(list(runner.journal.events(r.run_id))[-1]).__name__ == "RunFinished"
    finally:
        peer.kill()
        peer.wait(timeout=10)


FORKER = """
import multiprocessing, sys, time
from boundloop.journal.lmdb import LmdbJournal
journal = LmdbJournal(sys.argv[1])
job = multiprocessing.get_context("fork").Process(target=time.sleep, args=(60,))
job.start()  # a tool's background job, forked without exec
print(job.pid, flush=True)
with journal._txn(write=True):
    print("held", flush=True)
    time.sleep(600)  # killed mid-commit
"""


def test_a_forked_child_does_not_keep_a_killed_parents_lock(
        journal: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bl_lmdb._lock, "LOCK_WAIT_S", 2.0)
    proc = subprocess.Popen([sys.executable, "-c", FORKER, str(journal)],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    child = int(proc.stdout.readline())
    try:
        assert proc.stdout.readline().strip() == "held"
        proc.kill()
        proc.wait(timeout=10)
        assert os.path.exists(f"/proc/{child}")  # the fork child lives on
        with bl.Runner(journal) as runner:  # and the lock went with its parent
            assert runner.run(model=bl.ScriptedModel([bl.Final("ok")]), tools=[],
                              prompt="p").status == "final"
    finally:
        os.kill(child, signal.SIGKILL)
