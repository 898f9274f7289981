"""The fault loop: start workers, SIGKILL and freeze them (and restart the server) at
random moments while they work, then let a person settle what is left."""

from __future__ import annotations

import json
import os
import random
import signal
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, NamedTuple

from boundloop.core import kinds
from boundloop.drill._invariants import _check
from boundloop.drill._postgres import _Server, fresh_database, pg_restart_argv
from boundloop.drill._processes import (
    _FlockProbe,
    _Life,
    _Lines,
    _spawn,
    _TidBlocks,
    _WriteLockProbe,
    can_unshare,
)
from boundloop.drill._report import DrillReport
from boundloop.drill._workload import Downstream, _append_line, drill_model, drill_tools, ledger
from boundloop.tools import Tool

#: A takeover may come this much later than lease + claim interval on a loaded machine: a
#: sweep reads every open run, and a worker that just said it is ready needs ~0.5 s to sweep.
SLACK_S = 1.0
#: Pauses last this many leases (some end before a takeover, most after one).
PAUSE_LEASES = (1.2, 2.5)
#: How long a probe may wait for the locks the workers share before the drill concludes the
#: frozen worker holds one (and lets it go at once: a pause inside an LMDB commit or
#: reader-slot registration stalls every process of the journal, which is not the fault
#: under test).
WRITE_LOCK_PROBE_S = 0.25

def run_drill(base: Path, runs: int, kills: int, seed: int, workers: int = 2,
              concurrency: int = 4, out: Callable[[str], None] = print, *,
              pause: bool = False, lease_s: float = 1.0,
              pidns: bool | None = None, journal: str | None = None,
              pgdata: str | os.PathLike[str] | None = None,
              restart_cmd: str | None = None, restarts: int | None = None,
              progress: Callable[[int, int | None], None] | None = None,
              compress: bool = False) -> DrillReport:
    """Run the drill in directory ``base`` and return its report.

    ``kills`` is the number of faults to inject: SIGKILLs, and with ``pause`` also SIGSTOPs
    past the lease (about half, at most ``workers - 1`` workers frozen at once). ``pidns``
    (default: ``pause`` and available) runs each worker in its own pid namespace.

    ``journal`` (a ``postgresql://`` URL) runs the drill on PostgreSQL, in a database of its
    own created for it (``fresh_database``) on that server; else on an LMDB journal in
    ``base/journal``. With ``pgdata`` (the server's data directory, see
    ``pg_restart_argv``) or ``restart_cmd`` (a shell command that crash-restarts the server
    and returns), ``restarts`` of the faults (default: one in 50, at least one) are server
    restarts; the time the server was down does not count against the takeover bound.

    Work is handed out in small slices, one per worker life, so the kills spread over the
    whole workload; a killed worker's slice goes back to the queue (the next worker skips
    runs already started; whoever sweeps first takes the orphans over).

    ``out`` gets a line per fault injected (and the phases); ``progress``, if given,
    ``(faults injected, kills)`` with each.
    """
    from boundloop.runner import Runner

    started = time.monotonic()
    rng = random.Random(seed)
    rig = _prepare(base, DrillReport(runs, workers=workers, lease_s=lease_s,
                                     compress=compress), kills, pause, pidns, journal,
                   pgdata, restart_cmd, restarts)
    report, where, server, probe, tids = rig
    run_ids = [f"drill-{seed}-{i:05d}" for i in range(runs)]
    expected_kills = kills // 2 if pause else kills
    size = max(1, runs // (expected_kills + workers))
    queue = [run_ids[i:i + size] for i in range(0, runs, size)]
    out = _counting(out, progress, report, kills)
    lines = _Lines(base / "ledger")

    def next_fault(previous: int) -> int:
        return _next_fault(rng, report, kills, lines, 3 * runs, previous)

    trigger = next_fault(0)
    procs: dict[int, _Life] = {}
    lives: list[_Life] = []
    lingering: set[int] = set()  # slots given a last, lingering worker
    try:
        while queue or procs:
            now = time.time()
            if server is not None and server.error:
                raise RuntimeError(server.error)
            for slot, life in list(procs.items()):
                if life.proc.poll() is None:
                    continue
                life.exited_at = life.exited_at or now
                if tids is not None:
                    tids.give_back(life.name)
                if life.proc.returncode not in (0, -signal.SIGKILL):
                    # A worker that crashed (a traceback): a failure of the drill, counted;
                    # its slice goes back to the queue, as a killed worker's.
                    report.worker_errors += 1
                    err = life.err.read_text(errors="replace").strip().splitlines()
                    report.notes.append(f"worker {life.name} exited {life.proc.returncode}: "
                                        f"{err[-1] if err else '(nothing on stderr)'}")
                    if report.worker_errors > 3 * workers:
                        raise RuntimeError(f"drill workers keep failing; the last, "
                                           f"{life.name}: {' '.join(err[-20:])}")
                    if life.piece:
                        queue.insert(0, life.piece)
                    lingering.discard(life.slot)
                del procs[slot]
            if not queue and not (base / "linger").exists():
                (base / "linger").touch()  # from now on workers stay until all is done
            for slot in range(workers):
                if slot in procs or (not queue and slot in lingering):
                    continue
                piece = queue.pop(0) if queue else []
                if not queue:
                    lingering.add(slot)
                life = _spawn(base, len(lives) + 1, slot, piece, seed, concurrency,
                              lease_s, report.pid_namespaces, tids,
                              None if journal is None else where, compress)
                lives.append(life)
                procs[slot] = life
            for life in procs.values():
                if life.paused and now >= life.resume_at:
                    _resume(life)
            if report.faults_injected < kills and lines() >= trigger \
                    and (queue or any(life.working() for life in procs.values())):
                # The restarts are spread evenly over the faults: the k-th of R comes as
                # fault number about k * kills / (R + 1) (later while one is under way).
                planned = report.restarts_planned
                k = report.restarts_injected + 1
                if server is not None and k <= planned and not server.busy \
                        and report.faults_injected + 1 >= round(k * kills / (planned + 1)):
                    server.restart()
                    _append_line(base / "faults.jsonl", json.dumps(
                        {"kind": "restart", "worker": "", "owner": "",
                         "at": server.down[-1][0]}))
                    report.restarts_injected += 1
                    report.faults_injected += 1
                    out(f"  restart {report.faults_injected}/{kills}: the PostgreSQL server "
                        "(pg_ctl -m immediate)")
                    trigger = next_fault(trigger)
                    continue
                live = [life for life in procs.values()
                        if not life.paused and life.proc.poll() is None and life.ready()]
                frozen = sum(life.paused for life in procs.values())
                if live:
                    life = rng.choice(live)
                    want_pause = pause and frozen < workers - 1 and rng.random() < 0.5
                    time.sleep(rng.uniform(0.0, 0.005))
                    if want_pause and probe is not None:
                        if _pause(life, probe, rng, lease_s, report, kills, out,
                                  list(procs.values())):
                            trigger = next_fault(trigger)
                    elif life.proc.poll() is None:
                        _kill(base, life, report, kills, out)
                        if life.piece:
                            queue.insert(0, life.piece)
                        lingering.discard(life.slot)
                        trigger = next_fault(trigger)
            time.sleep(0.003)
    finally:
        for life in procs.values():
            life.signal(signal.SIGCONT)
            life.signal(signal.SIGKILL)
            life.proc.wait()
        if probe is not None:
            probe.close()
        if server is not None:
            server.join()
    if server is not None:
        if server.error:
            raise RuntimeError(server.error)
        report.server_down_s = round(sum(b - a for a, b in server.down), 3)
    report.worker_lives = len(lives)
    with Runner(where, lease_s=lease_s, compress=compress) as runner:
        settle(runner, base, run_ids, drill_model(seed), drill_tools(base / "ledger", "person"))
        _check(runner, base, run_ids, report, lives, [] if server is None else server.down)
    report.elapsed_s = round(time.monotonic() - started, 2)
    return report


def settle(runner: Any, base: Path, run_ids: list[str], model: Any, tools: list[Tool],
           decide: Callable[[str], None] | None = None) -> None:
    """The person at the end: take over what is left (leases must run out first), resolve
    what needs review from the ledger (and with ``decide``, decide the calls of runs that
    wait for approval), then resume, until done. Again and again: a resume can end
    needs_review (or awaiting_approval) once more, and the person's own runner can fence
    itself (a lease renewal late on a loaded machine) and leave a run open, to be recovered
    like any other."""
    stops = ("needs_review", "awaiting_approval") if decide else ("needs_review",)
    give_up = time.monotonic() + 10 + 4 * runner.lease_s
    while True:
        for r in runner.recover():
            _append_line(base / "recovered.jsonl", json.dumps({
                "run_id": r.run_id, "by": "person", "unresolved": [
                    [u.idempotency_key, u.tool, u.phase] for u in r.unresolved]}))
            _resume_free(runner, r.run_id, model, tools)
        keys = {k for k, _ in ledger(base / "ledger")}
        waiting = [i for i in run_ids if runner.state(i).status in stops]
        for run_id in waiting:
            if decide is not None and kinds.awaits_approval(runner.state(run_id).status):
                decide(run_id)
            for action in runner.state(run_id).open_actions:
                outcome = "succeeded" if action.idempotency_key in keys else "failed"
                runner.resolve(run_id, action.execution_id, outcome, note="ledger checked",
                               by="drill")
            _resume_free(runner, run_id, model, tools)
        settled = not waiting and next(iter(runner.journal.open_runs()), None) is None
        if settled or time.monotonic() > give_up:
            break
        if not waiting:
            time.sleep(runner.lease_s / 4)


def _resume_free(runner: Any, run_id: str, model: Any, tools: list[Tool]) -> None:
    """Resume ``run_id``; a run another runner holds at that moment (a claim that lost a
    race) is left for the person's next round, which ``_check`` bounds."""
    from boundloop.errors import RecoveryError

    try:
        runner.resume(run_id, model, tools)
    except RecoveryError:
        time.sleep(0.05)


def _kill(base: Path, life: _Life, report: DrillReport, kills: int,
          out: Callable[[str], None]) -> None:
    """SIGKILL ``life``, and count it."""
    life.killed_at = time.time()
    life.signal(signal.SIGKILL)
    _fault(base, "kill", life, life.killed_at)
    report.crashes_injected += 1
    report.faults_injected += 1
    out(f"  kill {report.faults_injected}/{kills}: {life.name} (pid {life.proc.pid})")


class _Rig(NamedTuple):
    """What a drill runs on: its report, the journal every worker opens (a directory or a
    URL), the PostgreSQL server it restarts, its lock probe and its thread-id blocks."""

    report: DrillReport
    where: str
    server: _Server | None
    probe: _WriteLockProbe | _FlockProbe | None
    tids: _TidBlocks | None


def _prepare(base: Path, report: DrillReport, kills: int, pause: bool, pidns: bool | None,
             journal: str | None, pgdata: str | os.PathLike[str] | None = None,
             restart_cmd: str | None = None, restarts: int | None = None) -> _Rig:
    """Check the settings and set a drill up in ``base``: its journal (a fresh database on
    PostgreSQL), and the lock probe the pauses need; ``report`` gets the settings."""
    from boundloop.journal.postgres import is_url
    from boundloop.runner import Runner

    base.mkdir(parents=True, exist_ok=True)
    if journal is not None and not is_url(journal):
        raise ValueError(f"journal must be a postgresql:// URL, got {journal!r} (the LMDB "
                         "drill keeps its journal in its directory)")
    if journal is None and (pgdata is not None or restart_cmd is not None):
        raise ValueError("a server restart needs a PostgreSQL journal (a postgresql:// URL)")
    report.pid_namespaces = pause and can_unshare() if pidns is None else pidns
    report.unowned_bound_s = round(report.lease_s * 1.5 + SLACK_S, 3)
    if pause and not report.pid_namespaces:
        report.notes.append("the workers share one pid namespace: a paused worker is alive "
                            "by SPEC 6 (its process exists), so its runs are never taken "
                            "over; pauses test self-fencing only")
    where = str(base / "journal")
    server: _Server | None = None
    if journal is not None:
        report.journal = "postgresql"
        report.database, where = fresh_database(journal)
        (base / "journal.url").write_text(where + "\n")
        report.notes.append(f"PostgreSQL: database {report.database} was created for this "
                            "drill on the server of --journal, and kept (DROP DATABASE "
                            f"{report.database} when done with it)")
        restart: list[str] | str | None = restart_cmd
        if restart is None and pgdata is not None:
            restart = pg_restart_argv(pgdata)
        if restart is None:
            report.notes.append("no --pgdata or --pg-restart-cmd: the server was not "
                                "restarted")
        else:
            server = _Server(where, restart, base / "pg-restarts.log")
            report.restarts_planned = min(kills, max(1, kills // 50)
                                          if restarts is None else restarts)
    tids = _TidBlocks() if journal is None else None
    probe: _WriteLockProbe | _FlockProbe | None = None
    if journal is not None:
        with Runner(where, lease_s=report.lease_s, compress=report.compress):
            pass  # the schema and the redaction key, before any worker
        probe = _FlockProbe(Downstream(base / "ledger").lock)
    elif pause:
        # The probe first (on a journal made for it), so no worker's block holds its pid.
        with Runner(base / "journal", lease_s=report.lease_s, compress=report.compress):
            pass
        lmdb_probe = _WriteLockProbe(base / "journal", Downstream(base / "ledger").lock)
        probe = lmdb_probe
        assert tids is not None
        tids.avoid.add(lmdb_probe.proc.pid // _TidBlocks.SIZE)
    return _Rig(report, where, server, probe, tids)


def _counting(out: Callable[[str], None], progress: Callable[[int, int | None], None] | None,
              report: DrillReport, kills: int) -> Callable[[str], None]:
    """``out``, also telling ``progress`` how many faults are injected with each line."""
    if progress is None:
        return out

    def told(text: str) -> None:  # every fault is told as a line: count them there
        out(text)
        progress(report.faults_injected, kills)

    return told


def _next_fault(rng: random.Random, report: DrillReport, kills: int, lines: _Lines,
                expected_lines: int, previous: int) -> int:
    """The ledger line at which the next fault is due: the faults left spread over the side
    effects left, counted from the previous fault's mark, so faults delayed (no worker up
    to take one) catch up."""
    left = max(kills - report.faults_injected, 1)
    gap = max(1, int(0.8 * (expected_lines - lines()) / left))
    return previous + rng.randint(1, 2 * gap - 1 if gap > 1 else 1)


def _fault(base: Path, kind: str, life: _Life, at: float) -> None:
    """The drill's own record of what it did to whom, and when (``faults.jsonl``)."""
    life.ready()
    _append_line(base / "faults.jsonl", json.dumps({"kind": kind, "worker": life.name,
                                                    "owner": life.owner, "at": at}))


def _resume(life: _Life) -> None:
    """End ``life``'s pause (SIGCONT), and say when (the moment before the signal: the
    worker may run before this process does again)."""
    life.pauses[-1][1] = time.time()
    life.signal(signal.SIGCONT)
    _fault(life.out.parent.parent, "resume", life, life.pauses[-1][1])


def _pause(life: _Life, probe: _WriteLockProbe | _FlockProbe, rng: random.Random,
           lease_s: float,
           report: DrillReport, kills: int, out: Callable[[str], None],
           frozen: Iterable[_Life] = ()) -> bool:
    """Freeze ``life`` past its lease; False when it was caught holding a lock the others
    need (a journal commit...): then it is let go at once and a fault is tried again.
    ``frozen`` are the workers paused before: woken early if one of them holds the lock."""
    if life.proc.poll() is not None:
        return False
    life.signal(signal.SIGSTOP)
    stopped = time.time()

    def wake_frozen() -> None:
        for other in frozen:
            if other is not life and other.paused:
                _resume(other)

    free = probe.free(WRITE_LOCK_PROBE_S, lambda: life.signal(signal.SIGCONT), wake_frozen) \
        if isinstance(probe, _WriteLockProbe) else \
        probe.free(WRITE_LOCK_PROBE_S, lambda: life.signal(signal.SIGCONT))
    if not free:
        report.pauses_backed_off += 1
        _fault(life.out.parent.parent, "backoff", life, stopped)
        return False
    life.pauses.append([stopped, 0.0])
    _fault(life.out.parent.parent, "pause", life, stopped)
    life.resume_at = stopped + rng.uniform(*PAUSE_LEASES) * lease_s
    report.pauses_injected += 1
    report.faults_injected += 1
    out(f"  pause {report.faults_injected}/{kills}: {life.name} (pid {life.proc.pid}) for "
        f"{life.resume_at - stopped:.2f} s")
    return True
