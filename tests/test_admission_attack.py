"""Attacks on told admission (#21): submits racing close(), one id from many threads, a
small max_in_flight under a flood, children under a flood, and callers' callbacks of runs
admission refused (SPEC 1: no call of the API waits forever)."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import threading
import time
import zlib
from concurrent.futures import Future, wait
from pathlib import Path
from typing import Any

import pytest

import boundloop as bl
from boundloop.journal.base import RunInfo

#: Every wait in these tests is bounded by this (a hang is a failure, not a stuck suite).
WAIT_S = 5.0


def _admission_waits(runner: bl.Runner, gate: threading.Event,
                     error: Exception | None = None) -> None:
    """The journal's ``find``, when admission calls it, waits for ``gate`` (and then raises
    ``error`` for the run ``boom``)."""
    find = runner.journal.find

    def find_slowly(run_id: str) -> RunInfo | None:
        if threading.current_thread().name.startswith("AdmissionActor"):
            assert gate.wait(WAIT_S)
            if error is not None and run_id == "boom":
                raise error
        return find(run_id)

    runner.journal.find = find_slowly  # type: ignore[method-assign]


def _final(text: str) -> bl.ScriptedModel:
    return bl.ScriptedModel([bl.Final(text)])


def _held(gate: threading.Event, entered: threading.Event, text: str,
          calls: list[int] | None = None) -> Any:
    """A model that says it was called (``entered``, ``calls``), then waits for ``gate``."""

    def model(history: list[Any], ctx: bl.ModelContext) -> bl.Final:
        if calls is not None:
            calls.append(1)
        entered.set()
        assert gate.wait(WAIT_S)
        return bl.Final(text)

    return model


def _all_return(threads: list[threading.Thread]) -> None:
    """Start ``threads``; each returns within WAIT_S."""
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT_S)
        assert not t.is_alive()


def test_a_callback_of_a_refused_run_may_submit_runs(journal_dir: Path) -> None:
    """A done-callback of a refused run's Future that submits again (a retry on
    ``journal_unavailable``): when it ran on admission's thread, it waited for an admission
    slot only that very thread can give back (until close()). It runs on the runner's
    settle pool now, and its submits take their slots as any other."""
    gate = threading.Event()
    runner = bl.Runner(journal_dir)
    try:
        _admission_waits(runner, gate, bl.JournalUnavailable("the disk is away"))
        retried: list[Future[bl.RunResult]] = []
        done = threading.Event()

        def retry(f: Future[bl.RunResult]) -> None:
            try:
                assert f.result().status == "journal_unavailable"
                for name in ("again-1", "again-2"):
                    retried.append(runner.submit(model=_final(name), prompt="p",
                                                 run_id=name))
            finally:
                done.set()

        refused = runner.submit(model=_final("x"), prompt="p", run_id="boom")
        assert not refused.done()  # admission is held in find: the callback waits for it
        refused.add_done_callback(retry)
        gate.set()
        assert done.wait(WAIT_S), "a submit from the refused run's callback waited for a slot"
        assert [f.result(WAIT_S).status for f in retried] == ["final", "final"]
        assert sorted(runner.journal.runs()) == ["again-1", "again-2"]
    finally:
        gate.set()
        runner.close(timeout=2)


@pytest.mark.parametrize("drain", [False, True], ids=["cancel", "drain"])
def test_close_racing_many_submitters_settles_every_future(journal_dir: Path,
                                                           drain: bool) -> None:
    """close() while threads and asyncio tasks submit: close returns, every submitter
    returns, every Future is settled (a result or RunnerClosed), and every run in the
    journal was admitted once and either ended or stays open for recovery."""
    started = threading.Event()

    def slow(history: list[Any], ctx: bl.ModelContext) -> bl.Final:
        started.set()
        threading.Event().wait(0.05)  # long enough for close() to find it running
        return bl.Final("ok")

    runner = bl.Runner(journal_dir, max_in_flight=4)
    futures: list[Future[bl.RunResult]] = []
    raised: list[BaseException] = []
    lock = threading.Lock()
    go = threading.Barrier(7)

    def flood(n: int) -> None:
        go.wait(WAIT_S)
        for i in range(40):
            try:
                f = runner.submit(model=slow, prompt="p", run_id=f"t{n}-{i}")
            except bl.RunnerClosed as exc:
                with lock:
                    raised.append(exc)
                return
            with lock:
                futures.append(f)

    outcomes: list[Any] = []

    def aflood() -> None:
        async def main() -> None:
            async def one(i: int) -> Any:
                try:
                    return await runner.arun(model=slow, prompt="p", run_id=f"a-{i}")
                except bl.RunnerClosed as exc:
                    return exc
            go.wait(WAIT_S)
            outcomes.extend(await asyncio.wait_for(
                asyncio.gather(*(one(i) for i in range(20))), WAIT_S * 2))
        asyncio.run(main())

    threads = [threading.Thread(target=flood, args=(n,), daemon=True) for n in range(5)]
    threads.append(threading.Thread(target=aflood, daemon=True))
    for t in threads:
        t.start()
    go.wait(WAIT_S)
    assert started.wait(WAIT_S)
    closer = threading.Thread(target=runner.close, kwargs={"timeout": 1.0, "drain": drain},
                              daemon=True)
    closer.start()
    closer.join(WAIT_S * 2)
    assert not closer.is_alive(), "close() did not return"
    for t in threads:
        t.join(WAIT_S)
        assert not t.is_alive(), "a submitter was left blocked"
    fenced: list[str] = []
    for f in futures:
        assert f.done()
        try:
            result = f.result(0)
        except bl.RunnerClosed:
            continue
        if drain and result.status == "journal_unavailable":
            # Admitted as the runner drained: fenced before its model was called, and
            # left open in the journal for another runner (SPEC 6).
            fenced.append(result.run_id)
            continue
        assert result.status in ("final", "cancelled", "rejected"), result
    for o in outcomes:
        assert isinstance(o, bl.RunnerClosed | bl.RunResult), o
    with bl.Runner(journal_dir) as reopened:
        for run_id in reopened.journal.runs():
            kinds = [type(e).__name__ for e in reopened.journal.events(run_id)]
            assert kinds.count("RunAdmitted") == 1, (run_id, kinds)
        for run_id in fenced:
            kinds = [type(e).__name__ for e in reopened.journal.events(run_id)]
            assert "RunFinished" not in kinds, (run_id, kinds)
            assert run_id in set(reopened.journal.open_runs())


def test_one_id_from_many_threads_is_one_run(journal_dir: Path) -> None:
    """The same run id submitted from many threads at once: one run in the journal, and
    every caller gets that run's result (or a consistent refusal)."""
    gate = threading.Event()
    entered = threading.Event()
    calls: list[int] = []
    model = _held(gate, entered, "the one", calls)

    with bl.Runner(journal_dir) as runner:
        go = threading.Barrier(8)
        futures: list[Future[bl.RunResult]] = []
        lock = threading.Lock()

        def submit() -> None:
            go.wait(WAIT_S)
            f = runner.submit(model=model, prompt="p", run_id="same")
            with lock:
                futures.append(f)

        _all_return([threading.Thread(target=submit, daemon=True) for _ in range(8)])
        assert entered.wait(WAIT_S)
        gate.set()
        results = [f.result(WAIT_S) for f in futures]
        finals = [r for r in results if r.status == "final"]
        assert finals, results
        assert {r.run_id for r in results} == {"same"}
        assert all(r.status == "final" for r in results), results
        assert len(calls) == 1
        assert list(runner.journal.runs()) == ["same"]
        kinds = [type(e).__name__ for e in runner.journal.events("same")]
        assert kinds.count("RunAdmitted") == 1
        assert not runner.in_flight("same")


def _flood(runner: bl.Runner, submitters: int, each: int, prefix: str,
           ) -> dict[str, Future[bl.RunResult]]:
    """``submitters`` threads, let go at once, each submit ``each`` runs (ids
    ``{prefix}{thread}-{i}``) and return; the Futures by run id."""
    futures: dict[str, Future[bl.RunResult]] = {}
    lock = threading.Lock()
    go = threading.Barrier(submitters)

    def flood(n: int) -> None:
        go.wait(WAIT_S)
        for i in range(each):
            run_id = f"{prefix}{n}-{i}"
            f = runner.submit(model=_final("ok"), prompt="p", run_id=run_id)
            with lock:
                futures[run_id] = f

    threads = [threading.Thread(target=flood, args=(n,), daemon=True)
               for n in range(submitters)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT_S * 2)
        assert not t.is_alive()
    return futures


def test_a_small_max_in_flight_under_a_flood_frees_every_slot(journal_dir: Path) -> None:
    """max_in_flight=2 and many submitters: refused runs hold nothing, every admitted
    run's end frees its slot, and a run after the flood is admitted."""
    with bl.Runner(journal_dir, max_in_flight=2) as runner:
        futures = _flood(runner, 6, 30, "r")
        results = [f.result(WAIT_S) for f in futures.values()]
        assert {r.status for r in results} <= {"final", "rejected"}
        ran = {r.run_id for r in results if r.status == "final"}
        assert ran == set(runner.journal.runs())
        for r in results:
            assert not runner.in_flight(r.run_id)
        assert len(runner._in_flight) == 0
        assert runner.run(model=_final("after"), prompt="p").status == "final"


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_children_finish_while_the_runner_is_flooded(journal_dir: Path, kind: str) -> None:
    """A parent's tools start children (run_child, arun_child) while other threads flood
    the runner with submits: no deadlock over the admission slot, the children finish."""
    child_model = bl.ScriptedModel([bl.Final("child")] * 8)

    if kind == "sync":
        @bl.tool
        def spawn(ctx: bl.ToolContext) -> str:
            return ctx.run_child(model=child_model, prompt="c").status
        tool = spawn
    else:
        @bl.tool(name="spawn")
        async def aspawn(ctx: bl.ToolContext) -> str:
            return (await ctx.arun_child(model=child_model, prompt="c")).status
        tool = aspawn
    parent = bl.ScriptedModel([
        bl.CallTools([bl.ToolCall(f"c{i}", "spawn", {}) for i in range(4)]),
        bl.Final("parent")])
    with bl.Runner(journal_dir) as runner:
        stop = threading.Event()
        flooded: list[Future[bl.RunResult]] = []

        def flood() -> None:
            while not stop.is_set() and len(flooded) < 200:
                flooded.append(runner.submit(model=_final("f"), prompt="p"))

        floods = [threading.Thread(target=flood, daemon=True) for _ in range(3)]
        for t in floods:
            t.start()
        try:
            if kind == "sync":
                result = runner.submit(model=parent, tools=[tool], prompt="p").result(WAIT_S * 2)
            else:
                async def main() -> bl.RunResult:
                    return await asyncio.wait_for(
                        runner.arun(model=parent, tools=[tool], prompt="p"), WAIT_S * 2)
                result = asyncio.run(main())
        finally:
            stop.set()
            for t in floods:
                t.join(WAIT_S)
        assert result.status == "final", result
        children = [r for r in result.transcript if r.kind == "tool_result"]
        assert len(children) == 4
        assert all("final" in str(m.content) for m in children), children
        assert all(f.result(WAIT_S).status == "final" for f in flooded)


def test_a_future_cancelled_before_admission_decided_ends_the_run(journal_dir: Path) -> None:
    """Cancelling the Future while admission has not decided yet: the run ends cancelled
    (nothing runs), its slot is free again, and the next run is admitted."""
    gate = threading.Event()
    model = _final("never")
    with bl.Runner(journal_dir, max_in_flight=1) as runner:
        _admission_waits(runner, gate)
        future = runner.submit(model=model, prompt="p", run_id="early")
        assert future.cancel()
        gate.set()
        for _ in range(int(WAIT_S / 0.05)):
            if not runner.in_flight("early"):
                break
            threading.Event().wait(0.05)
        assert not runner.in_flight("early")
        assert model.calls == 0
        after = runner.run(model=_final("after"), prompt="p", budget=bl.Budget(deadline_s=10))
        assert after.status == "final", after


def test_a_run_admitted_for_a_supervisor_gone_leaves_nothing_in_flight(
        journal_dir: Path) -> None:
    """Admission admits a run but its supervisor is gone (stopped): the Future gets
    RunnerClosed, and the run holds neither its id nor an in-flight slot afterwards (with
    max_in_flight=1, a run on the other supervisor is admitted)."""
    with bl.Runner(journal_dir, max_in_flight=1, supervisors=2) as runner:
        ids = [f"run-{i}" for i in range(40)]
        shard = [zlib.crc32(i.encode()) % 2 for i in ids]
        gone_id, live_id = ids[shard.index(0)], ids[shard.index(1)]
        runner._supervisors[0].stop(timeout=WAIT_S)
        future = runner.submit(model=_final("x"), prompt="p", run_id=gone_id)
        with pytest.raises(bl.RunnerClosed):
            future.result(WAIT_S)
        assert not runner.in_flight(gone_id)
        assert len(runner._in_flight) == 0
        assert runner.run(model=_final("ok"), prompt="p", run_id=live_id).status == "final"


def test_a_child_forked_while_a_submit_waits_for_admission_is_refused_at_once(
        journal_dir: Path) -> None:
    """fork() while a thread of the parent waits for an admission slot: in the child,
    submit raises RunnerClosed at once (it does not wait for a slot, nor for a lock the
    parent's threads held), and close() returns."""
    gate = threading.Event()
    runner = bl.Runner(journal_dir)
    try:
        _admission_waits(runner, gate)
        first = runner.submit(model=_final("first"), prompt="p", run_id="first")
        held = threading.Thread(target=lambda: runner.submit(
            model=_final("held"), prompt="p", run_id="held"), daemon=True)
        held.start()
        held.join(0.3)
        assert held.is_alive()  # waits for the slot "first" holds
        pid = os.fork()
        if pid == 0:  # the child: its exit status is the verdict
            code = 1
            try:
                signal.alarm(10)  # never outlives the test, whatever it waits for
                try:
                    runner.submit(model=_final("child"), prompt="p", run_id="child")
                    code = 2
                except bl.RunnerClosed:
                    runner.close(timeout=1)
                    code = 0
            finally:
                os._exit(code)
        for _ in range(int(WAIT_S * 2 / 0.05)):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            threading.Event().wait(0.05)
        else:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail("the forked child hung")
        assert os.waitstatus_to_exitcode(status) == 0
        gate.set()
        held.join(WAIT_S)
        assert not held.is_alive()
        assert first.result(WAIT_S).status == "final"
    finally:
        gate.set()
        runner.close(timeout=2)
    with bl.Runner(journal_dir) as reopened:
        assert sorted(reopened.journal.runs()) == ["first", "held"]


class _Interrupting:
    """Stands in for a runner's admission slots or admission actor: raises
    KeyboardInterrupt (Ctrl-C in the submitting thread) from ``name``."""

    def __init__(self, real: Any, name: str) -> None:
        self.real, self.name = real, name

    def __getattr__(self, attr: str) -> Any:
        if attr == self.name:
            def interrupted(*args: Any, **kwargs: Any) -> Any:
                raise KeyboardInterrupt
            return interrupted
        return getattr(self.real, attr)


@pytest.mark.parametrize("where", ["waiting for a slot", "telling admission"])
def test_an_interrupted_submit_leaves_neither_its_id_nor_its_slot(journal_dir: Path,
                                                                   where: str) -> None:
    """Ctrl-C in a submit before its run reached admission: the id is not left in flight
    with a Future nothing settles (a retry of the id got it and waited for ever), and the
    admission slot is not lost (every later submit waited for ever)."""
    with bl.Runner(journal_dir) as runner:
        if where == "waiting for a slot":
            real: Any = runner._admitting
            runner._admitting = _Interrupting(real, "acquire")  # type: ignore[assignment]
        else:
            real = runner._admission
            runner._admission = _Interrupting(real, "tell")  # type: ignore[assignment]
        try:
            with pytest.raises(KeyboardInterrupt):
                runner.submit(model=_final("x"), prompt="p", run_id="retry-me")
        finally:
            if where == "waiting for a slot":
                runner._admitting = real
            else:
                runner._admission = real
        assert not runner.in_flight("retry-me")
        assert not runner.cancel("retry-me")
        out: list[Future[bl.RunResult]] = []
        again = threading.Thread(target=lambda: out.append(runner.submit(
            model=_final("again"), prompt="p", run_id="retry-me")), daemon=True)
        again.start()
        again.join(WAIT_S)
        assert not again.is_alive(), "the admission slot was lost"
        assert out[0].result(WAIT_S).status == "final"
        assert list(runner.journal.runs()) == ["retry-me"]


def test_a_callback_of_a_refused_run_may_wait_for_another_run(journal_dir: Path) -> None:
    """Before admission was told (#21), a refused run's callbacks ran in the submitting
    thread; a refused Future with callbacks is now settled on the runner's settle pool, so
    one that waits for a run it submitted (or for anything slow) holds up no admission."""
    gate = threading.Event()
    runner = bl.Runner(journal_dir)
    try:
        _admission_waits(runner, gate, bl.JournalUnavailable("the disk is away"))
        got: list[str] = []
        done = threading.Event()

        def retry_and_wait(f: Future[bl.RunResult]) -> None:
            try:
                again = runner.submit(model=_final("again"), prompt="p", run_id="again")
                got.append(again.result(2).status)
            finally:
                done.set()

        refused = runner.submit(model=_final("x"), prompt="p", run_id="boom")
        refused.add_done_callback(retry_and_wait)
        gate.set()
        assert done.wait(WAIT_S)
        assert got == ["final"]
    finally:
        gate.set()
        runner.close(timeout=2)


def test_two_submits_of_one_id_past_the_lookup_at_once_are_one_run(journal_dir: Path) -> None:
    """Two callers submit one id, both past the lookup of existing runs before either
    registers it (the window between ``_existing`` and ``_start``): the second follows the
    first's run instead of being refused ``already in flight`` (SPEC 14: a run with an
    id that exists is returned, never refused nor run twice)."""
    gate = threading.Event()
    entered = threading.Event()
    model = _held(gate, entered, "the one")

    with bl.Runner(journal_dir) as runner:
        real = runner._existing
        both = threading.Barrier(2)

        def existing_then_wait(spec: Any) -> Any:
            found = real(spec)
            both.wait(WAIT_S)  # neither has registered the id yet
            return found

        runner._existing = existing_then_wait  # type: ignore[method-assign]
        futures: list[Future[bl.RunResult]] = []
        threads = [threading.Thread(target=lambda: futures.append(runner.submit(
            model=model, prompt="p", run_id="same")), daemon=True) for _ in range(2)]
        try:
            _all_return(threads)
            assert entered.wait(WAIT_S)
        finally:
            gate.set()
        assert [f.result(WAIT_S).status for f in futures] == ["final", "final"]
        kinds = [type(e).__name__ for e in runner.journal.events("same")]
        assert kinds.count("RunAdmitted") == 1


def test_a_callback_of_a_refused_run_that_exits_does_not_stop_the_actors(
        journal_dir: Path) -> None:
    """A refused run's callback that raises SystemExit (a sys.exit() meant for the caller's
    thread): on admission's thread, it made pykka stop every actor in the process, this
    runner's and any other's; it ends nothing but that callback now."""
    gate = threading.Event()
    with bl.Runner(journal_dir) as runner:
        _admission_waits(runner, gate, bl.JournalUnavailable("the disk is away"))

        def leave(f: Future[bl.RunResult]) -> None:
            raise SystemExit(3)

        refused = runner.submit(model=_final("x"), prompt="p", run_id="boom")
        assert not refused.done()
        refused.add_done_callback(leave)
        gate.set()
        assert refused.result(WAIT_S).status == "journal_unavailable"
        after = runner.submit(model=_final("ok"), prompt="p").result(WAIT_S)
        assert after.status == "final", after
        assert runner._admission.is_alive()
        assert all(s.is_alive() for s in runner._supervisors)


def test_admission_errors_under_a_flood_settle_every_run_and_lose_no_slot(
        journal_dir: Path) -> None:
    """The journal's ``find`` fails for some of many concurrent submits (RuntimeError and
    JournalUnavailable): each of those runs fails or is refused alone, every submitter
    returns, and admission goes on admitting (no slot, no id, no in-flight entry lost)."""
    with bl.Runner(journal_dir) as runner:
        find = runner.journal.find

        def flaky(run_id: str) -> RunInfo | None:
            # Only where admission decides (its caller is ``_admit``): a failing lookup in
            # ``_first``'s follow-up is test_a_failed_lookup_after_a_refusal_settles_the_run.
            if sys._getframe(1).f_code.co_name == "_admit":
                if run_id.endswith("-3"):
                    raise RuntimeError("find broke")
                if run_id.endswith("-5"):
                    raise bl.JournalUnavailable("the disk is away")
            return find(run_id)

        runner.journal.find = flaky  # type: ignore[method-assign]
        futures = _flood(runner, 5, 20, "e")
        statuses: dict[str, str] = {}
        for run_id, f in futures.items():
            try:
                statuses[run_id] = f.result(WAIT_S).status
            except RuntimeError:
                statuses[run_id] = "raised"
        assert len(statuses) == 100
        for run_id, status in statuses.items():
            expected = {"3": "raised", "5": "journal_unavailable"}.get(run_id.split("-")[1],
                                                                       "final")
            assert status == expected, (run_id, status)
        assert len(runner._in_flight) == 0
        assert not any(runner.in_flight(run_id) for run_id in statuses)
        assert runner.run(model=_final("after"), prompt="p").status == "final"


def test_a_failed_lookup_after_a_refusal_settles_the_run(journal_dir: Path) -> None:
    """A run refused (max_in_flight) makes ``_first`` look the id up in the journal (was it
    taken by another runner?): when that lookup raised other than JournalError, the
    exception was swallowed by the Future's callback machinery and the Future submit
    returned was never settled, not even by close() (it is not in ``_pending``). Now the
    refusal stands."""
    gate = threading.Event()
    entered = threading.Event()
    blocking = _held(gate, entered, "first")

    with bl.Runner(journal_dir, max_in_flight=1) as runner:
        find = runner.journal.find

        def broken_for_b(run_id: str) -> RunInfo | None:
            if run_id == "b" and threading.current_thread().name.startswith("AdmissionActor"):
                raise RuntimeError("find broke")
            return find(run_id)

        runner.journal.find = broken_for_b  # type: ignore[method-assign]
        try:
            first = runner.submit(model=blocking, prompt="p", run_id="a")
            assert entered.wait(WAIT_S)
            refused = runner.submit(model=_final("b"), prompt="p", run_id="b")
            assert refused.result(2).status == "rejected"
        finally:
            gate.set()
        assert first.result(WAIT_S).status == "final"


def test_a_refusal_settled_in_place_runs_no_callback_there() -> None:
    """Admission settles a refused run's Future on its own thread only when it has no
    done-callbacks, checked and settled under the Future's lock: a callback added from
    another thread meanwhile waits, then runs on the thread that added it (the Future
    being done), never on admission's; a Future with callbacks is left to the pool."""
    from boundloop._runner.starting import _settled_quietly

    future: Future[str] = Future()
    started, ran_on = threading.Event(), []

    def add() -> None:
        started.set()
        future.add_done_callback(lambda f: ran_on.append(threading.current_thread().name))

    adder = threading.Thread(target=add, name="adder", daemon=True)

    def settle() -> None:
        adder.start()
        assert started.wait(WAIT_S)
        time.sleep(0.05)  # the adder is inside add_done_callback, waiting for the lock
        future.set_result("refused")

    assert _settled_quietly(future, settle)
    adder.join(WAIT_S)
    assert ran_on == ["adder"]

    called_back: Future[str] = Future()
    called_back.add_done_callback(lambda f: None)
    assert not _settled_quietly(called_back, lambda: called_back.set_result("x"))
    assert not called_back.done()


def _unreadable_ids(runner: bl.Runner, gates: dict[str, threading.Event]) -> None:
    """Admission cannot check the ids of ``gates`` (the journal is away): it finds so for
    each once its gate is set (the submitting caller's own lookup finds nothing), so a
    callback added before that is on the Future when it is refused."""
    find = runner.journal.find

    def find_or_fail(run_id: str) -> RunInfo | None:
        if run_id in gates and threading.current_thread().name.startswith("AdmissionActor"):
            assert gates[run_id].wait(WAIT_S)
            raise bl.JournalUnavailable("the disk is away")
        return find(run_id)

    runner.journal.find = find_or_fail  # type: ignore[method-assign]


def test_refused_runs_whose_callbacks_wait_are_each_settled_at_once(journal_dir: Path) -> None:
    """Many refused runs, each with a done-callback that waits (for something that never
    comes, here until the test ends): every one is settled at once (the settle pool gets a
    thread more while a callback waits), admission serves on, and close() returns."""
    release = threading.Event()
    gates = {f"bad{i}": threading.Event() for i in range(10)}
    started: list[int] = []
    runner = bl.Runner(journal_dir)
    try:
        _unreadable_ids(runner, gates)
        refused = []
        for run_id, gate in gates.items():
            f = runner.submit(model=_final("x"), prompt="p", run_id=run_id)
            f.add_done_callback(lambda f: (started.append(1), release.wait(WAIT_S)))
            refused.append(f)
            gate.set()
        assert runner.run(model=_final("ok"), prompt="p").status == "final"
        # One behind another, the ten would take ~9 s (a starved pool adds a thread a
        # second); each with a thread of its own, they are all settled at once.
        _, late = wait(refused, timeout=3)
        assert not late
        assert [f.result().status for f in refused] == ["journal_unavailable"] * 10
        deadline = time.monotonic() + 2
        while len(started) < 10 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(started) == 10  # all ten wait at once
        began = time.monotonic()
        runner.close(timeout=1)
        assert time.monotonic() - began < 3
    finally:
        release.set()
        runner.close(timeout=1)


def test_close_settles_a_refusal_the_settle_pool_never_took(journal_dir: Path) -> None:
    """A refused run's Future handed to the settle pool, which has not taken it when the
    runner closes (its threads busy): close() settles it, with its refusal."""
    runner, gate = bl.Runner(journal_dir), threading.Event()
    called: list[str] = []
    try:
        _unreadable_ids(runner, {"bad": gate})
        runner._workers.settle_pool.submit = lambda *a, **k: None  # type: ignore[method-assign]
        f = runner.submit(model=_final("x"), prompt="p", run_id="bad")
        f.add_done_callback(lambda f: called.append(f.result().status))
        gate.set()
        deadline = time.monotonic() + 2
        while f not in runner._settling and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not f.done()
    finally:
        runner.close(timeout=1)
    assert f.result(0).status == "journal_unavailable"
    assert called == ["journal_unavailable"]
    assert runner._settling == {}


@pytest.mark.xfail(strict=True, reason="a finished run's Future is settled on its "
                   "supervisor's thread: a callback there that waits for a run of the "
                   "same supervisor stalls it (docs/concepts.md: a callback should not wait)")
def test_a_callback_of_a_finished_run_may_wait_for_another_run(journal_dir: Path) -> None:
    """SPEC 1 (a Runner keeps serving): a done-callback of a run that ran, waiting for a
    run it submits that lands on the same supervisor, holds that supervisor's thread, so
    the run it waits for cannot start until the wait gives up."""
    with bl.Runner(journal_dir) as runner:
        shards = len(runner._supervisors)

        def shard(run_id: str) -> int:
            return zlib.crc32(run_id.encode()) % shards

        other = next(f"b{i}" for i in range(100) if shard(f"b{i}") == shard("a"))
        got: list[str] = []
        done = threading.Event()

        def wait_for_another(f: Future[bl.RunResult]) -> None:
            try:
                again = runner.submit(model=_final("b"), prompt="p", run_id=other)
                got.append(again.result(2).status)
            except Exception as exc:  # noqa: BLE001 - what the wait ended with
                got.append(type(exc).__name__)
            finally:
                done.set()

        gate = threading.Event()
        first = runner.submit(model=_held(gate, threading.Event(), "a"), prompt="p",
                              run_id="a")
        first.add_done_callback(wait_for_another)  # before it ends: runs where it ends
        gate.set()
        assert done.wait(WAIT_S)
        assert got == ["final"]
