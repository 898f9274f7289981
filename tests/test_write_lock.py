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


def test_a_run_without_a_deadline_waits_lock_wait_s_then_fails_closed(
        journal: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bl_lmdb, "LOCK_WAIT_S", 1.0)
    with bl.Runner(journal) as runner:
        holder = Holder(journal)
        try:
            started = time.monotonic()
            result = runner.run(model=bl.ScriptedModel([bl.Final("ok")]), tools=[],
                                prompt="p", run_id="nodeadline")
            took = time.monotonic() - started
        finally:
            holder.kill()
    assert result.status == "journal_unavailable" and 0.9 <= took <= 3.0, (result, took)


def test_opening_a_runner_gives_up_with_a_clear_error(journal: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bl_lmdb, "LOCK_WAIT_S", 1.0)
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
    monkeypatch.setattr(bl_lmdb, "LOCK_WAIT_S", 4.0)
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
