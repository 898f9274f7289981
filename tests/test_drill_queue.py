"""``boundloop drill --queue`` (issue "Workers that run themselves", SPEC 14), bounded for
the suite: every run enqueued up front, ``bl.Worker`` processes serving the drill agent
while they are SIGKILLed, SIGTERMed and (with --pause) frozen past their lease, and a person
thread approving or denying the calls that wait for one. The soak variant is the size of
the note's run (``--runs 400 --kills 100``).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import boundloop as bl
from boundloop.drill import QueueDrillReport, can_unshare, decision, queue_plan
from boundloop.drill._queue_drill import _check_queue
from boundloop.drill._queue_worker import APPROVAL_SHARE
from boundloop.drill._workload import _append_line

needs_unshare = pytest.mark.skipif(not can_unshare(),
                                   reason="needs root and unshare(1) for pid namespaces")


def drill(tmp: Path, *args: str, timeout: float = 120) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-m", "boundloop", "drill", "--queue", *args,
                          "--dir", str(tmp / "drill"), "--json"], capture_output=True,
                         text=True, timeout=timeout)
    assert out.returncode in (0, 1), out.stderr
    report: dict[str, Any] = json.loads(out.stdout)
    assert report["ok"] is (out.returncode == 0), report
    return report


def assert_invariants(report: dict[str, Any]) -> None:
    """Everything the queue drill checks, each by name (so a failure says which)."""
    assert report["queue"] is True
    assert report["runs_not_final"] == 0  # every run ended (final)
    assert report["duplicate_executions"] == 0 and report["executed_without_intent"] == 0
    assert report["unresolved_missed"] == 0 and report["unresolved_spurious"] == 0
    assert report["events_lost"] == 0 and report["replay_mismatches"] == 0
    assert report["acks_lost"] == 0 and report["acks_checked"] > 0
    assert report["zombie_appends_accepted"] == 0 and report["zombie_executions"] == 0
    assert report["epoch_gaps"] == 0 and report["epoch_mismatches"] == 0
    assert report["worker_errors"] == 0
    assert report["denied_executed"] == 0 and report["executed_without_approval"] == 0
    # The second fault is a SIGTERM; every worker alive at the end is SIGTERMed too: each
    # exited 0.
    assert report["terms_injected"] >= 1 and report["exits_not_graceful"] == 0
    assert report["exits_graceful"] >= report["terms_injected"] + report["workers"]
    assert report["faults_injected"] == (report["crashes_injected"] + report["pauses_injected"]
                                         + report["terms_injected"])
    # Every run came from the queue; each call that waited for a person was decided.
    assert report["claims_from_queue"] >= report["runs"]
    assert report["approvals_asked"] == report["approvals"] + report["denials"]
    assert report["approvals"] >= 1 and report["denials"] >= 1
    assert report["max_unowned_s"] <= report["unowned_bound_s"]
    assert report["takeovers_over_bound"] == 0
    assert not any("did not end every run" in n for n in report["notes"])


@pytest.mark.timeout(90)
def test_three_workers_serve_the_queue_through_kills_and_sigterms(tmp_path: Path) -> None:
    report = drill(tmp_path, "--workers", "3", "--runs", "60", "--kills", "10", "--seed", "1")
    assert report["workers"] == 3 and report["pid_namespaces"] is False
    assert report["crashes_injected"] >= 1 and report["takeovers_after_kill"] >= 1
    assert_invariants(report)
    assert report["ok"] is True
    # The checker sees a denied call that ran: a ledger line for one makes the drill fail.
    base = tmp_path / "drill"
    with bl.Runner(base / "journal") as runner:
        denied = [(run_id, rec) for run_id in runner.journal.runs()
                  for rec in runner.state(run_id).calls.values() if rec.status == "denied"]
        run_id, rec = denied[0]
        _append_line(base / "ledger", f"{rec.idempotency_key} refund {run_id} 2 w1 0.0")
        again = QueueDrillReport(report["runs"])
        _check_queue(runner, base, list(runner.journal.runs()), again)
    assert again.denied_executed == 1 and not again.ok


@needs_unshare
@pytest.mark.timeout(90)
def test_three_workers_in_pid_namespaces_killed_frozen_and_sigtermed(tmp_path: Path) -> None:
    report = drill(tmp_path, "--workers", "3", "--pause", "--runs", "60", "--kills", "10",
                   "--seed", "2")
    assert report["pid_namespaces"] is True and report["notes"] == []
    assert report["pauses_injected"] >= 1
    assert report["takeovers_after_kill"] + report["takeovers_after_pause"] >= 1
    assert_invariants(report)
    assert report["ok"] is True


@pytest.mark.timeout(120)
def test_the_queue_drill_on_postgresql(pg: Any, tmp_path: Path) -> None:
    pytest.importorskip("psycopg", reason="PostgreSQL tests need psycopg 3")
    report = drill(tmp_path, "--journal", pg.url(), "--workers", "3", "--runs", "40",
                   "--kills", "8", "--seed", "3")
    assert report["journal"] == "postgresql" and report["database"].startswith("drill_")
    assert report["crashes_injected"] >= 1
    assert_invariants(report)
    assert report["ok"] is True


@pytest.mark.soak
@pytest.mark.timeout(900)
def test_the_queue_drill_of_400_runs_and_100_faults(tmp_path: Path) -> None:
    args = ["--workers", "3", "--runs", "400", "--kills", "100", "--seed", "7"]
    report = drill(tmp_path, *args, *(["--pause"] if can_unshare() else []), timeout=900)
    assert_invariants(report)
    assert report["ok"] is True


def test_one_run_in_five_asks_for_approval_and_the_person_is_seeded() -> None:
    plans = [queue_plan(f"drill-1-{i:05d}", 1) for i in range(1000)]
    asking = sum("refund" in p for p in plans)
    assert 1000 / APPROVAL_SHARE * 0.7 < asking < 1000 / APPROVAL_SHARE * 1.3
    assert all(sorted(p) in (["book", "charge", "ship"], ["book", "charge", "refund", "ship"])
               for p in plans)
    assert plans[0] == queue_plan("drill-1-00000", 1)  # a resumed run follows its plan
    decisions = [decision(1, f"x{i}") for i in range(1000)]
    assert decisions == [decision(1, f"x{i}") for i in range(1000)]
    assert 600 < sum(decisions) < 800


def test_the_queue_drill_does_not_restart_the_server(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "boundloop", "drill", "--queue", "--journal",
                          "postgresql://u@h/db", "--pg-restart-cmd", "true"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--queue" in out.stderr
    assert "Traceback" not in out.stderr
