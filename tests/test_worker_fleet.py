"""SPEC 14 with real processes: workers serve a durable queue while they are SIGKILLed,
SIGSTOPped past their lease and SIGTERMed; approvals survive a worker's death.

The bounded runs here take a few hundred runs; the soak variants (``-m soak``) take 2,000.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

import boundloop as bl
from boundloop import events as ev
from boundloop.ops import open_journal

sys.path.insert(0, str(Path(__file__).parent))
from queue_worker import effects, fleet_agents  # noqa: E402

WORKER = Path(__file__).with_name("queue_worker.py")


class Fleet:
    """Worker processes on one journal, started, faulted and stopped by the test."""

    def __init__(self, journal: str, ledger: Path, logs: Path, lease: float) -> None:
        self.journal, self.ledger, self.logs, self.lease = journal, ledger, logs, lease
        self.procs: list[subprocess.Popen[str]] = []
        self.log_of: dict[int, Path] = {}
        self.faults: Counter[str] = Counter()
        self.exits: list[int] = []

    def start(self) -> subprocess.Popen[str]:
        path = self.logs / f"worker-{len(self.log_of)}.log"
        log = open(path, "w")  # noqa: SIM115
        proc = subprocess.Popen([sys.executable, str(WORKER), self.journal, str(self.ledger),
                                 "--lease", str(self.lease), "--concurrency", "4",
                                 "--grace", "3"], stdout=log, stderr=subprocess.STDOUT,
                                text=True)
        self.procs.append(proc)
        self.log_of[proc.pid] = path
        return proc

    def owning(self) -> list[subprocess.Popen[str]]:
        """The workers that own an open run at this moment."""
        with open_journal(self.journal, readonly=True) as j:
            owners = {i.owner for i in j.open_infos() if i.owner}
            pids = {rec.pid for o, rec in j.owners().items() if o in owners}
        return [p for p in self.procs if p.pid in pids]

    def ready(self, proc: subprocess.Popen[str]) -> bool:
        """True once the worker serves (its SIGTERM handler is in place)."""
        return "ready" in self.log_of[proc.pid].read_text()

    def fault(self, rng: random.Random, kind: str | None = None) -> bool:
        """One fault on a random worker: SIGKILL, a pause past the lease, or SIGTERM; a
        killed or stopped worker is replaced at once."""
        kind = kind or rng.choice(["kill", "kill", "pause", "term"])
        # SIGTERM before a worker serves ends it as any process (no handler yet): sent only
        # to workers that serve.
        ready = [p for p in self.procs if self.ready(p)] if kind == "term" else self.procs
        if kind == "kill":
            # A worker that drives runs now, so a takeover follows (any, if none does).
            ready = self.owning() or ready
        if not ready:
            return False
        proc = rng.choice(ready)
        self.faults[kind] += 1
        if kind == "pause":
            proc.send_signal(signal.SIGSTOP)
            time.sleep(self.lease * 1.6)
            proc.send_signal(signal.SIGCONT)
            return True
        self.procs.remove(proc)
        proc.send_signal(signal.SIGKILL if kind == "kill" else signal.SIGTERM)
        code = proc.wait(30)
        if kind == "term":
            self.exits.append(code)
        self.start()
        return True

    def stop(self) -> None:
        until = time.monotonic() + 30
        for proc in self.procs:  # each serves before its SIGTERM (see fault)
            while proc.poll() is None and not self.ready(proc) and time.monotonic() < until:
                time.sleep(0.05)
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                self.exits.append(proc.wait(30))
            except subprocess.TimeoutExpired:
                proc.kill()
                self.exits.append(proc.wait(10))
        self.procs = []


def statuses(journal: str) -> dict[str, str | None]:
    with open_journal(journal, readonly=True) as j:
        infos = getattr(j, "infos")()  # noqa: B009
        return {i.run_id: i.status for i in infos}


def journal_events(journal: str) -> dict[str, list[ev.Event]]:
    with open_journal(journal, readonly=True) as j:
        return {run_id: list(j.events(run_id)) for run_id in j.runs()}


def check_effects(journal: str, ledger: Path) -> dict[str, Any]:
    """0 duplicate effects, 0 effects without a durable intent and attempt, 0 results lost."""
    done = effects(ledger)
    keys = Counter(e["key"] for e in done)
    duplicates = [k for k, n in keys.items() if n > 1]
    by_run = journal_events(journal)
    without_intent, lost = [], []
    for e in done:
        run = by_run.get(e["run"], [])
        decided = any(isinstance(x, ev.CallDecided) and x.idempotency_key == e["key"]
                      and x.execution_id == e["eid"] for x in run)
        dispatched = any(isinstance(x, ev.CallDispatched) and x.execution_id == e["eid"]
                         and x.attempt == e["attempt"] for x in run)
        if not (decided and dispatched):
            without_intent.append(e)
        known = any(isinstance(x, ev.CallSucceeded | ev.CallReconciled)
                    and x.execution_id == e["eid"]
                    and getattr(x, "took_effect", True) for x in run)
        if not known:
            lost.append(e)
    return {"effects": len(done), "duplicates": duplicates, "without_intent": without_intent,
            "lost": lost, "events": by_run}


def serve_a_queue(journal: str, tmp: Path, runs: int, workers: int, lease: float,
                  limit_s: float, seed: int) -> None:
    ledger, logs = tmp / "ledger", tmp / "logs"
    logs.mkdir()
    fleet_agent = fleet_agents(ledger)[0]
    with bl.Runner(journal) as runner:
        ids = [runner.enqueue(fleet_agent, prompt=f"job {i}", run_id=f"job-{i:05d}",
                              labels={"batch": "fleet"}) for i in range(runs)]
    fleet = Fleet(journal, ledger, logs, lease)
    rng = random.Random(seed)
    try:
        for _ in range(workers):
            fleet.start()
        t0 = time.monotonic()
        # Each kind of fault at least once, while the queue is still long, then at random.
        first = ["kill", "pause", "term", "kill"]
        while time.monotonic() - t0 < limit_s:
            time.sleep(rng.uniform(0.05, 0.25))
            left = [r for r, s in statuses(journal).items() if s is None]
            if not left:
                break
            if sum(fleet.faults.values()) < 40 \
                    and fleet.fault(rng, first[0] if first else None) and first:
                first.pop(0)
    finally:
        fleet.stop()
    ended = statuses(journal)
    stuck = [r for r in ids if ended.get(r) is None]
    assert not stuck, f"{len(stuck)} runs never ended: {stuck[:5]} (faults {fleet.faults})"
    assert Counter(ended.values()) == Counter({"final": runs}), Counter(ended.values())
    assert set(fleet.exits) == {0}, fleet.exits  # SIGTERM: a graceful exit, every time
    assert min(fleet.faults[k] for k in ("kill", "pause", "term")) >= 1, fleet.faults
    found = check_effects(journal, ledger)
    assert found["duplicates"] == [] and found["without_intent"] == [] and found["lost"] == []
    # A run acted once, or a crash came between its attempt's durable dispatch and the
    # effect: then reconcile said it did not take effect, and (the tool not being
    # idempotent) the model was told so instead of it running again.
    acted = {e["run"] for e in effects(ledger)}
    for run_id in set(ids) - acted:
        kinds = [(type(x).__name__, getattr(x, "took_effect", None))
                 for x in found["events"][run_id]]
        assert ("CallReconciled", False) in kinds, (run_id, kinds)
    # runs of killed workers were taken over by others with no call from the test
    taken_over = [r for r, run in found["events"].items()
                  if sum(1 for x in run if isinstance(x, ev.OwnerClaimed) and x.owner) > 1]
    assert taken_over, "no run was taken over from a worker that died or stopped"


def test_three_workers_serve_a_queue_through_kills_pauses_and_sigterm(tmp_path: Path) -> None:
    serve_a_queue(str(tmp_path / "j"), tmp_path, runs=int(os.environ.get(
        "BOUNDLOOP_FLEET_RUNS", "400")), workers=3, lease=1.0, limit_s=150, seed=3)


@pytest.mark.soak
def test_three_workers_serve_a_queue_of_2000(tmp_path: Path) -> None:
    serve_a_queue(str(tmp_path / "j"), tmp_path, runs=2000, workers=3, lease=1.0,
                  limit_s=1200, seed=4)


def test_four_workers_on_postgresql_serve_a_queue(pg: Any, tmp_path: Path) -> None:
    url = pg.create_database(f"fleet_{uuid.uuid4().hex[:8]}")
    serve_a_queue(url, tmp_path, runs=int(os.environ.get("BOUNDLOOP_FLEET_RUNS", "300")),
                  workers=4, lease=1.5, limit_s=150, seed=5)


@pytest.mark.soak
def test_four_workers_on_postgresql_serve_a_queue_of_2000(pg: Any, tmp_path: Path) -> None:
    url = pg.create_database(f"fleet_{uuid.uuid4().hex[:8]}")
    serve_a_queue(url, tmp_path, runs=2000, workers=4, lease=1.5, limit_s=1800, seed=6)


def test_an_approval_survives_the_worker_that_asked(tmp_path: Path) -> None:
    journal, ledger, logs = str(tmp_path / "j"), tmp_path / "ledger", tmp_path / "logs"
    logs.mkdir()
    gated = fleet_agents(ledger)[1]
    with bl.Runner(journal) as runner:
        for name in ("yes", "no"):
            runner.enqueue(gated, prompt="pay", run_id=name)
    fleet = Fleet(journal, ledger, logs, lease=1.0)
    first = fleet.start()
    try:
        t0 = time.monotonic()
        while set(statuses(journal).values()) != {"awaiting_approval"} \
                and time.monotonic() - t0 < 30:
            time.sleep(0.1)
        assert set(statuses(journal).values()) == {"awaiting_approval"}
        first.kill()  # the worker that paused the runs dies
        first.wait(10)
        fleet.procs.remove(first)
        cli = [sys.executable, "-m", "boundloop"]
        shown = subprocess.run([*cli, "show", "yes", "--journal", journal, "--json"],
                               capture_output=True, text=True, timeout=60)
        assert shown.returncode == 0, shown.stderr
        [waiting] = json.loads(shown.stdout)["awaiting"]
        assert waiting["tool"] == "pay" and waiting["arguments"] == {"n": "yes"}
        for verb, run in (("approve", "yes"), ("deny", "no")):
            done = subprocess.run([*cli, verb, run, waiting["execution_id"].replace("yes", run),
                                   "--journal", journal, "--by", "alice"],
                                  capture_output=True, text=True, timeout=60)
            assert done.returncode == 0, done.stderr
        assert effects(ledger) == []  # nothing ran before a person decided
        fleet.start()  # another worker finishes both
        while set(statuses(journal).values()) != {"final"} and time.monotonic() - t0 < 60:
            time.sleep(0.1)
    finally:
        fleet.stop()
    assert statuses(journal) == {"yes": "final", "no": "final"}
    assert [(e["run"], e["tool"]) for e in effects(ledger)] == [("yes", "pay")]
    found = check_effects(journal, ledger)
    assert found["duplicates"] == [] and found["without_intent"] == [] and found["lost"] == []
    denied = [x for x in found["events"]["no"] if isinstance(x, bl.ApprovalDecided)]
    assert [(d.approved, d.by) for d in denied] == [(False, "alice")]
    assert set(fleet.exits) == {0}
