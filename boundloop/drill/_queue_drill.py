"""``boundloop drill --queue``: the crash drill with workers that run themselves (SPEC 14).

The drill enqueues every run up front (``runner.enqueue`` of a drill agent whose tools are
the drill's tools); the worker processes are ``bl.Worker`` processes serving that agent,
which take queued runs and orphaned ones by themselves (no sweeps of the drill's own). One
run in ``APPROVAL_SHARE`` also calls ``refund`` (irreversible, ``needs_approval=True``): a
"person" thread of the drill approves or denies each such call (by a seeded rule) as its
run comes to wait. Meanwhile workers are SIGKILLed, paused past their lease (``--pause``)
and SIGTERMed (a graceful exit must be exit code 0). At the end the person settles what is
left and the journal is checked against the ledger as in ``boundloop.drill`` (the same
figures and invariants), plus: no denied call ran, no call that needed approval ran without
one, every SIGTERMed worker exited 0.
"""

from __future__ import annotations

import os
import random
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from boundloop import events as ev
from boundloop.core import kinds
from boundloop.drill._chaos import (
    _counting,
    _fault,
    _kill,
    _next_fault,
    _pause,
    _prepare,
    _resume,
    _Rig,
    settle,
)
from boundloop.drill._invariants import _check, _jsonl
from boundloop.drill._processes import _Life, _Lines, _popen, _TidBlocks
from boundloop.drill._queue_worker import APPROVAL_SHARE, GRACE_S, drill_agent
from boundloop.drill._report import QueueDrillReport
from boundloop.drill._workload import effects

#: The share of the calls waiting for approval that the person approves (seeded per call).
APPROVE_SHARE = 0.7

#: How often the person looks for runs that wait for a decision.
LOOK_S = 0.05

# -- the drill ----------------------------------------------------------------------------
def decision(seed: int, execution_id: str) -> bool:
    """The person's seeded rule: approve (True) or deny the call ``execution_id``."""
    return random.Random(f"{seed}:{execution_id}:decision").random() < APPROVE_SHARE


class _Person:
    """The drill's person: in a thread of its own, decides (``decision``) each call that
    waits for approval as its run comes to wait, and counts the runs the workers still have
    to move (open, or waiting for a decision) in ``pending`` (-1 until it first looked)."""

    def __init__(self, runner: Any, seed: int) -> None:
        self.runner, self.seed = runner, seed
        self.pending = -1
        self.failures = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="drill-person", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _watch(self) -> None:
        from boundloop.errors import BoundloopError

        while not self._stop.wait(LOOK_S):
            try:
                self.look()
            except BoundloopError:
                self.failures += 1  # the journal busy or a run moved meanwhile: look again

    def look(self) -> None:
        """Decide what waits now; count what is still to move."""
        infos = self.runner.journal.infos()
        waiting = [i.run_id for i in infos if kinds.awaits_approval(i.status)]
        self.pending = sum(i.status is None for i in infos) + len(waiting)
        for run_id in waiting:
            if self._stop.is_set():
                return
            self.decide(run_id)

    def decide(self, run_id: str) -> None:
        """Approve or deny each call of ``run_id`` that waits for a decision."""
        for call in self.runner.state(run_id).awaiting:
            verb = self.runner.approve if decision(self.seed, call.execution_id) \
                else self.runner.deny
            verb(run_id, call.execution_id, by="drill-person", note="seeded rule")


class _Fleet:
    """The worker processes: started into free slots, faulted, reaped and stopped; a
    SIGTERMed worker leaves its slot at once (another starts) and is reaped once it exits."""

    def __init__(self, base: Path, rig: _Rig, report: QueueDrillReport, seed: int,
                 concurrency: int, out: Callable[[str], None]) -> None:
        self.base, self.rig, self.report, self.seed, self.concurrency, self.out = \
            base, rig, report, seed, concurrency, out
        self.procs: dict[int, _Life] = {}
        self.leaving: list[_Life] = []
        self.lives: list[_Life] = []

    def spawn(self) -> None:
        """A new worker in every free slot."""
        report, logs = self.report, self.base / "logs"
        logs.mkdir(exist_ok=True)
        for slot in range(report.workers):
            if slot in self.procs:
                continue
            name = f"w{len(self.lives) + 1}"
            argv = [sys.executable, "-m", "boundloop.drill", "queue-worker", self.rig.where,
                    str(self.base / "ledger"), str(self.seed), str(self.concurrency),
                    str(logs / f"{name}.jsonl"), "--lease", str(report.lease_s), "--name",
                    name] + (["--compress"] if report.compress else [])
            life = _popen(logs, name, slot, [], argv, report.pid_namespaces, self.rig.tids)
            self.lives.append(life)
            self.procs[slot] = life

    def reap(self) -> None:
        """Note the workers that exited (by their exit codes)."""
        for slot, life in list(self.procs.items()):
            if life.proc.poll() is not None:
                del self.procs[slot]
                self._exited(life, termed=False)
        for life in [life for life in self.leaving if life.proc.poll() is not None]:
            self.leaving.remove(life)
            self._exited(life, termed=True)

    def _exited(self, life: _Life, termed: bool) -> None:
        report, code = self.report, life.proc.returncode
        life.exited_at = life.exited_at or time.time()
        if self.rig.tids is not None:
            self.rig.tids.give_back(life.name)
        if termed and code == 0:
            report.exits_graceful += 1
            return
        if not termed and code == -signal.SIGKILL and life.killed_at:
            return
        if termed:
            report.exits_not_graceful += 1  # SIGTERM must end a worker with exit code 0
        else:
            report.worker_errors += 1  # it crashed (or left unasked)
        err = life.err.read_text(errors="replace").strip().splitlines()
        report.notes.append(f"worker {life.name} exited {code}"
                            f"{' after SIGTERM' if termed else ''}: "
                            f"{err[-1] if err else '(nothing on stderr)'}")
        if report.worker_errors > 3 * report.workers:
            raise RuntimeError(f"drill workers keep failing; the last, {life.name}: "
                               f"{' '.join(err[-20:])}")

    def inject(self, rng: random.Random, pause: bool, kills: int) -> bool:
        """One fault on a serving worker: SIGTERM (one in five, and always the second, so
        a short drill has one), a pause past the lease (``pause``: half of the rest, some
        worker left awake), else SIGKILL."""
        live = [life for life in self.procs.values() if not life.paused
                and not life.killed_at and life.proc.poll() is None and life.ready()]
        if not live:
            return False
        life = rng.choice(live)
        frozen = sum(life.paused for life in self.procs.values())
        roll = rng.random()
        time.sleep(rng.uniform(0.0, 0.005))
        if roll < 0.2 or self.report.faults_injected == 1 and not self.report.terms_injected:
            self._term(life, kills)
            return True
        probe = self.rig.probe
        if pause and probe is not None and frozen < self.report.workers - 1 and roll < 0.6:
            return _pause(life, probe, rng, self.report.lease_s, self.report, kills, self.out,
                          list(self.procs.values()))
        if life.proc.poll() is not None:
            return False
        _kill(self.base, life, self.report, kills, self.out)
        return True

    def _term(self, life: _Life, kills: int) -> None:
        """SIGTERM ``life`` (it serves: its handler is in place); its slot is free at once."""
        life.signal(signal.SIGTERM)
        _fault(self.base, "term", life, time.time())
        self.report.terms_injected += 1
        self.report.faults_injected += 1
        self.out(f"  term {self.report.faults_injected}/{kills}: {life.name} "
                 f"(pid {life.proc.pid})")
        del self.procs[life.slot]
        self.leaving.append(life)

    def stop(self, graceful: bool) -> None:
        """SIGTERM every worker (each once it serves) and wait for their exits; a worker
        still there after the grace and a margin is SIGKILLed (and counted). Not
        ``graceful`` (the drill failed): SIGKILL them all."""
        until = time.monotonic() + 30
        for life in self.procs.values():
            if life.paused:
                _resume(life)
            while graceful and not life.killed_at and life.proc.poll() is None \
                    and not life.ready() and time.monotonic() < until:
                time.sleep(0.05)
            if graceful and not life.killed_at:
                life.signal(signal.SIGTERM)
                self.leaving.append(life)
            else:
                life.signal(signal.SIGKILL)
                life.proc.wait()
        self.procs.clear()
        until = time.monotonic() + GRACE_S + 30
        for life in self.leaving:
            try:
                life.proc.wait(max(until - time.monotonic(), 0.1) if graceful else 0.1)
            except Exception:  # noqa: BLE001 - TimeoutExpired: it did not leave in time
                life.signal(signal.SIGKILL)
                life.proc.wait()
        self.reap()


def run_queue_drill(base: Path, runs: int, kills: int, seed: int, workers: int = 3,
                    concurrency: int = 4, out: Callable[[str], None] = print, *,
                    pause: bool = False, lease_s: float = 1.0, pidns: bool | None = None,
                    journal: str | None = None,
                    progress: Callable[[int, int | None], None] | None = None,
                    compress: bool = False) -> QueueDrillReport:
    """Run the queue drill in directory ``base`` and return its report (see the module).

    ``kills`` is the number of faults to inject: SIGTERMs (about one in five), SIGKILLs, and
    with ``pause`` SIGSTOPs past the lease too. ``journal`` (a ``postgresql://`` URL) runs it
    on a fresh database of that server, else on LMDB in ``base/journal``; ``pidns``,
    ``out``, ``progress`` and ``compress`` as for ``boundloop.drill.run_drill``.
    """
    from boundloop.runner import Runner

    started = time.monotonic()
    report = QueueDrillReport(runs, workers=workers, lease_s=lease_s, compress=compress)
    rig = _prepare(base, report, kills, pause, pidns, journal)
    run_ids = [f"drill-{seed}-{i:05d}" for i in range(runs)]
    agent = drill_agent(base / "ledger", seed, "person")
    fleet = _Fleet(base, rig, report, seed, concurrency, _counting(out, progress, report, kills))
    with Runner(rig.where, lease_s=lease_s, compress=compress) as runner:
        for run_id in run_ids:
            runner.enqueue(agent, "run the plan", run_id=run_id)
        person = _Person(runner, seed)
        person.start()
        _avoid_own_threads(rig.tids)
        graceful = False
        try:
            _drive(fleet, person, kills, pause, random.Random(seed), runs)
            graceful = True
        finally:
            fleet.stop(graceful)
            person.stop()
            if rig.probe is not None:
                rig.probe.close()
        report.worker_lives = len(fleet.lives)
        settle(runner, base, run_ids, agent, agent.tools, person.decide)
        _check(runner, base, run_ids, report, fleet.lives)
        _check_queue(runner, base, run_ids, report)
    report.elapsed_s = round(time.monotonic() - started, 2)
    return report


def _avoid_own_threads(tids: _TidBlocks | None) -> None:
    """Keep the workers' thread-id blocks away from this process's threads: the person's
    Runner shares LMDB's robust mutexes with the workers (see _TidBlocks)."""
    if tids is not None:
        for tid in os.listdir("/proc/self/task"):
            tids.avoid.add(int(tid) // _TidBlocks.SIZE)


def _drive(fleet: _Fleet, person: _Person, kills: int, pause: bool, rng: random.Random,
           runs: int) -> None:
    """Keep the slots full and inject the faults, spread over the side effects, until the
    person sees no run left to move (or the drill gives up: a note says so)."""
    report = fleet.report
    lines = _Lines(fleet.base / "ledger")
    expected = 3 * runs + runs // APPROVAL_SHARE
    trigger = _next_fault(rng, report, kills, lines, expected, 0)
    give_up = time.monotonic() + 60 + runs * (0.2 + 0.1 * report.lease_s)
    while person.pending != 0:
        if time.monotonic() > give_up:
            report.notes.append(f"the workers did not end every run in time: "
                                f"{person.pending} left to the person at the end")
            return
        now = time.time()
        fleet.reap()
        fleet.spawn()
        for life in fleet.procs.values():
            if life.paused and now >= life.resume_at:
                _resume(life)
        if report.faults_injected < kills and lines() >= trigger and person.pending > 0 \
                and fleet.inject(rng, pause, kills):
            trigger = _next_fault(rng, report, kills, lines, expected, trigger)
        time.sleep(0.003)


def _check_queue(runner: Any, base: Path, run_ids: list[str],
                     report: QueueDrillReport) -> None:
    """The approvals against the ledger: no denied call ran, no call that waited for a
    person ran before its approval; the claims of queued runs, apart from takeovers; and
    the runs the workers took over."""
    started: dict[str, list[float]] = {}
    for x in effects(base / "ledger"):
        started.setdefault(x.key, []).append(x.started)
    for run_id in run_ids:
        state = runner.state(run_id)
        decided: dict[str, tuple[bool, float]] = {}
        for _, e in runner.journal.read(run_id):
            if isinstance(e, ev.ApprovalRequested):
                report.approvals_asked += 1
            elif isinstance(e, ev.ApprovalDecided):
                decided[e.execution_id] = (e.approved, e.ts)
                report.approvals += e.approved
                report.denials += not e.approved
        for rec in state.calls.values():
            ran = started.get(rec.idempotency_key, [])
            approved, at = decided.get(rec.execution_id, (False, float("inf")))
            if rec.execution_id in decided and not approved:
                report.denied_executed += len(ran)
            elif rec.approval:
                report.executed_without_approval += sum(t < at for t in ran)
    notes = _jsonl(sorted((base / "logs").glob("*.jsonl")))
    report.runs_drained = sum(n.get("kind") == "drained" for n in notes)
    claims = _jsonl([base / "takeovers.jsonl"])
    report.claims_from_queue = sum(t["cause"] == "queue" for t in claims)
    # The workers resume what they take over by themselves (no sweep logs it): count the
    # runs they took from an owner that died, froze, left or lapsed.
    report.runs_recovered += len({t["run_id"] for t in claims
                                  if t["cause"] in ("kill", "pause", "exit", "live")})
