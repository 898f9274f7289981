"""A journal commit that hangs (a frozen file system: the commit blocks in the kernel) cannot
keep a run with a deadline past its deadline plus grace (SPEC 1, 5): the run ends
``journal_unavailable`` while the commit is still stuck, and nothing is dispatched on that
commit's strength. Two ways: a journal whose commit blocks on an Event (always), and a real
``fsfreeze`` of a loop-mounted ext4 holding the journal (as root, where the sandbox allows it;
skipped with the reason otherwise)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import threading
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import boundloop as bl
from boundloop.journal.lmdb import LmdbJournal

SUPERVISORS = 2


class HangingJournal(LmdbJournal):
    """An LMDB journal whose commits block, once ``hang`` is set, until ``thaw`` is (as a
    commit blocks in the kernel on a frozen file system: whoever commits is stuck)."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.hang = threading.Event()
        self.thaw = threading.Event()
        self.stuck = threading.Event()

    def _commit(self, batch: Any, wait: bool = True) -> None:
        if self.hang.is_set() and not self.thaw.is_set():
            self.stuck.set()
            self.thaw.wait(30)
        super()._commit(batch, wait)


@pytest.fixture
def hanging(tmp_path: Path) -> Iterator[HangingJournal]:
    journal = HangingJournal(tmp_path / "j")
    try:
        yield journal
    finally:
        journal.thaw.set()
        journal.close()


def on_shard(prefix: str, shard: int) -> str:
    """A run id that the runner gives to supervisor ``shard`` (runs are sharded by crc32)."""
    for i in range(1000):
        run_id = f"{prefix}-{i}"
        if zlib.crc32(run_id.encode()) % SUPERVISORS == shard:
            return run_id
    raise AssertionError("no run id found")


def freezing_model(freeze: Any, ran: list[str]) -> bl.ScriptedModel:
    """Calls ``freeze()`` on its first step, then asks for one call of ``act``."""
    script = bl.ScriptedModel([bl.CallTools([bl.ToolCall("c1", "act", {})]), bl.Final("done")])

    def model(history: list[Any], ctx: bl.ModelContext) -> Any:
        if ctx.step == 1:
            freeze()
        return script(history, ctx)

    return model  # type: ignore[return-value]


def act_tool(ran: list[str]) -> bl.Tool:
    def act() -> str:
        ran.append("act")
        return "done"

    return bl.Tool("act", act)


@pytest.mark.timeout(60)
def test_a_run_whose_own_supervisor_is_stuck_in_a_commit_ends_at_its_deadline(
        hanging: HangingJournal) -> None:
    ran: list[str] = []
    with bl.Runner(hanging, supervisors=SUPERVISORS) as runner:
        started = time.monotonic()
        result = runner.run(model=freezing_model(hanging.hang.set, ran), tools=[act_tool(ran)],
                            prompt="p", run_id="frozen", budget=bl.Budget(deadline_s=2.0))
        took = time.monotonic() - started
        assert hanging.stuck.is_set() and not hanging.thaw.is_set()  # still stuck
        assert result.status == "journal_unavailable", result
        assert took < 2.0 + 0.5, took  # the deadline plus its grace
        assert "had not returned" in result.explanation
        assert result.model_steps == 1 and result.unresolved == []  # nothing was dispatched
        hanging.thaw.set()
        # The commit completes now; its answer finds the run gone: the tool never runs.
        time.sleep(0.5)
        assert ran == []
        after = runner.run(model=bl.ScriptedModel([bl.Final("ok")]), prompt="p",
                           budget=bl.Budget(deadline_s=5.0))
        assert after.status == "final"
        assert ran == []
        kinds = [type(e).__name__ for e in runner.journal.events("frozen")]
        assert "RunFinished" not in kinds  # left open as its durable events say, for recovery


@pytest.mark.timeout(60)
def test_a_run_waiting_behind_another_threads_stuck_commit_ends_at_its_deadline(
        hanging: HangingJournal) -> None:
    ran: list[str] = []
    with bl.Runner(hanging, supervisors=SUPERVISORS) as runner:
        # A run without a deadline wedges supervisor 0 inside a commit; a run with one, on
        # supervisor 1, waits for a commit queued behind it.
        stuck = runner.submit(model=freezing_model(hanging.hang.set, ran),
                              tools=[act_tool(ran)], prompt="p", run_id=on_shard("stuck", 0))
        assert hanging.stuck.wait(5)
        started = time.monotonic()
        late = runner.run(model=bl.ScriptedModel([bl.Final("ok")]), prompt="p",
                          run_id=on_shard("late", 1), budget=bl.Budget(deadline_s=1.0))
        took = time.monotonic() - started
        assert late.status == "journal_unavailable", late
        assert took < 1.0 + 0.5, took
        assert late.model_steps == 0  # its start was never confirmed: nothing ran
        assert not stuck.done() and ran == []
        hanging.thaw.set()
        # The run without a deadline waited: its commit did complete, so its call runs.
        assert stuck.result(timeout=10).status == "final"
        assert ran == ["act"]


@pytest.mark.timeout(60)
def test_a_run_told_to_a_supervisor_stuck_in_a_commit_ends_at_its_deadline(
        hanging: HangingJournal) -> None:
    ran: list[str] = []
    with bl.Runner(hanging, supervisors=SUPERVISORS) as runner:
        stuck = runner.submit(model=freezing_model(hanging.hang.set, ran),
                              tools=[act_tool(ran)], prompt="p", run_id=on_shard("stuck", 0))
        assert hanging.stuck.wait(5)
        # Its supervisor is stuck inside the commit: this run waits in its inbox.
        started = time.monotonic()
        queued = runner.run(model=bl.ScriptedModel([bl.Final("ok")]), prompt="p",
                            run_id=on_shard("queued", 0), budget=bl.Budget(deadline_s=1.0))
        took = time.monotonic() - started
        assert queued.status == "journal_unavailable", queued
        assert took < 1.0 + 0.5, took
        assert queued.model_steps == 0 and "had not returned" in queued.explanation
        hanging.thaw.set()
        assert stuck.result(timeout=10).status == "final"
        # The supervisor skipped it once it got to it: nothing of it was written.
        assert queued.run_id not in list(runner.journal.runs())
        again = runner.run(model=bl.ScriptedModel([bl.Final("ok")]), prompt="p",
                           run_id=queued.run_id, budget=bl.Budget(deadline_s=5.0))
        assert again.status == "final"  # its id is free: the runner forgot it


@pytest.mark.timeout(60)
def test_a_slow_commit_within_the_deadline_is_waited_for(hanging: HangingJournal) -> None:
    """Only a commit that hangs past the deadline and its grace is given up on."""
    ran: list[str] = []

    def hang_a_while() -> None:
        hanging.hang.set()
        threading.Timer(0.6, hanging.thaw.set).start()

    with bl.Runner(hanging, supervisors=SUPERVISORS) as runner:
        result = runner.run(model=freezing_model(hang_a_while, ran), tools=[act_tool(ran)],
                            prompt="p", budget=bl.Budget(deadline_s=3.0))
    assert result.status == "final" and ran == ["act"]


# -- a real frozen file system -----------------------------------------------------------------
def _why_no_fsfreeze() -> str | None:
    if os.geteuid() != 0:
        return "needs root (mount -o loop, fsfreeze)"
    for tool in ("fsfreeze", "mkfs.ext4", "mount", "umount"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    return None


class FrozenFs:
    """A loop-mounted ext4 image under ``base``; ``freeze()`` freezes it (fsfreeze) for at most
    ``limit_s``: a process of its own thaws it then, whatever becomes of this one."""

    def __init__(self, base: Path, limit_s: float = 20.0) -> None:
        self.image, self.mnt = base / "fs.img", base / "mnt"
        self.mnt.mkdir()
        self.limit_s = limit_s
        self.mounted = False
        self.guard: subprocess.Popen[bytes] | None = None
        subprocess.run(["truncate", "-s", "64M", str(self.image)], check=True)
        made = subprocess.run(["mkfs.ext4", "-q", "-F", str(self.image)], capture_output=True,
                              text=True)
        if made.returncode != 0:
            pytest.skip(f"cannot make an ext4 image here: {made.stderr.strip()}")
        done = subprocess.run(["mount", "-o", "loop", str(self.image), str(self.mnt)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"cannot loop-mount an ext4 image here: {done.stderr.strip()}")
        self.mounted = True

    def freeze(self) -> None:
        # The dead man's switch first: a frozen file system left behind would hang every
        # process that writes to it.
        self.guard = subprocess.Popen(
            ["sh", "-c", f"sleep {self.limit_s}; fsfreeze --unfreeze '{self.mnt}'"],
            start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        subprocess.run(["fsfreeze", "--freeze", str(self.mnt)], check=True, timeout=10)

    def unfreeze(self) -> None:
        if self.guard is not None:
            subprocess.run(["fsfreeze", "--unfreeze", str(self.mnt)], capture_output=True,
                           timeout=10)  # fails harmlessly when not frozen
            os.killpg(self.guard.pid, signal.SIGKILL)  # the shell and its sleep
            self.guard.wait(timeout=5)
            self.guard = None

    def close(self) -> None:
        self.unfreeze()
        if self.mounted:
            subprocess.run(["umount", str(self.mnt)], capture_output=True, timeout=30)
            self.mounted = False


@pytest.mark.timeout(60)
@pytest.mark.skipif(_why_no_fsfreeze() is not None, reason=_why_no_fsfreeze() or "")
def test_a_run_ends_at_its_deadline_while_fsfreeze_holds_its_commit(tmp_path: Path) -> None:
    fs = FrozenFs(tmp_path)
    ran: list[str] = []
    try:
        with bl.Runner(fs.mnt / "journal") as runner:
            try:
                started = time.monotonic()
                result = runner.run(model=freezing_model(fs.freeze, ran),
                                    tools=[act_tool(ran)], prompt="p", run_id="frozen",
                                    budget=bl.Budget(deadline_s=3.0))
                took = time.monotonic() - started
            finally:
                fs.unfreeze()  # before the runner closes: closing writes to the journal
            assert result.status == "journal_unavailable", result
            assert took < 3.0 + 0.5, took
            assert result.unresolved == []
            time.sleep(0.5)  # the stuck commit has completed by now: still nothing runs
            assert ran == []
            after = runner.run(model=bl.ScriptedModel([bl.Final("ok")]), prompt="p")
            assert after.status == "final"
        assert ran == []
    finally:
        fs.close()


def test_the_watch_on_a_long_deadline_keeps_no_finished_run_alive(tmp_path: Path) -> None:
    """A run's watch waits in the timer until its deadline: it holds the run's Future (and
    so its result and transcript) and spec only weakly."""
    import gc
    import weakref

    with bl.Runner(tmp_path / "j") as runner:
        future = runner.submit(model=bl.ScriptedModel([bl.Final("ok")]), prompt="p" * 10_000,
                               budget=bl.Budget(deadline_s=3600))
        assert future.result(timeout=10).status == "final"
        gone = weakref.ref(future)
        del future
        gc.collect()
        assert gone() is None
