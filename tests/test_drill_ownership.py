"""The ownership drill (issue 8, SPEC 6 "Ownership and fencing"), bounded for the suite.

``boundloop drill --workers 3 --pause`` SIGKILLs workers and freezes them (SIGSTOP) past
their lease while the others take their runs over, then wakes them as zombies. The big
run for the note is ``boundloop drill --workers 3 --pause --runs 2000 --kills 1000``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

import boundloop as bl
from boundloop.drill import Downstream, StaleAttempt, can_unshare, effects

HERE = Path(__file__)
needs_unshare = pytest.mark.skipif(not can_unshare(),
                                   reason="needs root and unshare(1) for pid namespaces")
def drill(tmp: Path, *args: str) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-m", "boundloop", "drill", *args, "--dir",
                          str(tmp / "drill"), "--json"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode in (0, 1), out.stderr
    report: dict[str, Any] = json.loads(out.stdout)
    assert report["ok"] is (out.returncode == 0)
    return report


def assert_invariants(report: dict[str, Any]) -> None:
    """Everything the drill checks, each by name (so a failure says which)."""
    assert report["runs_not_final"] == 0
    assert report["duplicate_executions"] == 0 and report["executed_without_intent"] == 0
    assert report["unresolved_missed"] == 0 and report["unresolved_spurious"] == 0
    assert report["events_lost"] == 0 and report["replay_mismatches"] == 0
    assert report["acks_lost"] == 0 and report["acks_checked"] > 0
    assert report["zombie_appends_accepted"] == 0
    assert report["epoch_gaps"] == 0 and report["epoch_mismatches"] == 0
    assert report["worker_errors"] == 0
    assert report["faults_injected"] == report["crashes_injected"] + report["pauses_injected"]
    assert report["zombie_executions"] == 0
    assert report["unowned_bound_s"] == report["lease_s"] * 1.5 + 1.0
    # Only the time in which another worker could claim counts against the bound.
    assert report["max_unowned_s"] <= report["unowned_bound_s"]
    assert report["max_unowned_wall_s"] >= report["max_unowned_s"]


@needs_unshare
@pytest.mark.timeout(120)
def test_three_workers_in_their_own_pid_namespaces_killed_and_frozen(tmp_path: Path) -> None:
    report = drill(tmp_path, "--workers", "3", "--pause", "--runs", "30", "--kills", "12",
                   "--lease", "1.0", "--seed", "1")
    assert report["pid_namespaces"] is True and report["notes"] == []
    assert report["workers"] == 3 and report["lease_s"] == 1.0
    assert report["faults_injected"] >= 4  # faults land while work remains (timing)
    assert report["pauses_injected"] >= 1
    assert report["takeovers_after_kill"] + report["takeovers_after_pause"] >= 1
    assert report["unowned_bound_s"] == 2.5  # lease + claim interval (lease / 2) + 1 s
    assert_invariants(report)
    assert report["ok"] is True


@pytest.mark.timeout(120)
def test_on_one_pid_namespace_a_paused_worker_is_never_taken_over(tmp_path: Path) -> None:
    report = drill(tmp_path, "--workers", "3", "--pause", "--no-pidns", "--runs", "20",
                   "--kills", "6", "--seed", "2")
    assert report["pid_namespaces"] is False
    assert any("never taken over" in n for n in report["notes"])
    assert report["faults_injected"] >= 2
    assert report["takeovers_after_pause"] == 0 and report["takeovers_of_live_owners"] == 0
    assert report["zombie_appends_refused"] == 0 and report["zombie_executions"] == 0
    assert_invariants(report)
    assert report["ok"] is True


def test_the_downstream_honours_the_fencing_token(tmp_path: Path) -> None:
    d = Downstream(tmp_path / "ledger")
    d.act("k1", 2, "k1 charge r 2 w1 1.0")
    d.act("k1", 2, "k1 charge r 2 w1 2.0")  # the same epoch again: an idempotent retry
    with pytest.raises(StaleAttempt):
        d.act("k1", 1, "k1 charge r 1 w0 3.0")  # the zombie, after the takeover's retry
    assert d.reconcile("k1") is True
    assert d.reconcile("k2") is False  # not done: and now it never will be
    with pytest.raises(StaleAttempt):
        d.act("k2", 1, "k2 book r 1 w0 4.0")
    assert [(e.key, e.epoch) for e in effects(d.ledger)] == [("k1", 2), ("k1", 2)]
    assert [(e.key, e.epoch) for e in effects(d.refused)] == [("k1", 1), ("k2", 1)]


def test_only_time_in_which_another_worker_could_claim_counts_as_unowned() -> None:
    from boundloop.drill._invariants import _able_time
    from boundloop.drill._processes import _Life

    def life(owner: str, ready: float, killed: float = 0.0,
             pauses: list[list[float]] | None = None) -> _Life:
        return _Life(owner, 0, [], None, Path("o"), Path("e"), owner=owner, ready_at=ready,
                     killed_at=killed, pauses=pauses or [])

    dead = life("a", 1.0, killed=10.0)  # the owner whose runs are taken over
    frozen = life("b", 1.0, pauses=[[9.0, 12.0]])  # frozen from 9 to 12
    late = life("c", 11.5)  # a new worker, ready at 11.5
    # From the kill at 10 to the claim at 13: b is frozen until 12, c ready from 11.5.
    assert _able_time([dead, frozen, late], "a", 10.0, 13.0) == 1.5
    assert _able_time([dead, frozen], "a", 10.0, 13.0) == 1.0
    assert _able_time([dead], "a", 10.0, 13.0) == 0.0  # the owner itself never counts
    still = life("d", 1.0, pauses=[[9.0, 0.0]])  # frozen and never woken
    assert _able_time([still], "a", 10.0, 13.0) == 0.0


# -- a zombie execution, made deterministic --------------------------------
def _zombie_worker(journal: str, ledger: str, marker: str) -> None:
    """One run, two calls in one batch, one tool thread: c2 waits for c1's thread. c1
    holds it until the process was frozen, and 0.5 s after it woke (the lease renews)."""

    def mail(n: int, ctx: bl.ToolContext) -> str:
        with open(ledger, "a") as f:
            f.write(f"{n} {ctx.epoch} {time.time():.6f}\n")
        if n == 1:
            Path(marker).write_text("in c1")
            last = time.time()
            while True:
                time.sleep(0.01)
                now = time.time()
                if now - last > 0.5:  # it was frozen
                    time.sleep(0.5)
                    break
                last = now
        return f"mail {n} sent"

    model = bl.ScriptedModel([bl.CallTools([bl.ToolCall("c1", "mail", {"n": 1}),
                                            bl.ToolCall("c2", "mail", {"n": 2})]),
                              bl.Final("done")])
    with bl.Runner(journal, lease_s=1.0, tool_threads=1, max_threads=1) as runner:
        result = runner.run(model=model, tools=[bl.Tool("mail", mail, timeout_s=None)],
                            prompt="two mails", run_id="zombie-run")
    print(json.dumps({"status": result.status, "explanation": result.explanation}))


@needs_unshare
@pytest.mark.timeout(60)
def test_a_woken_runner_starts_no_attempt_of_a_run_claimed_meanwhile(tmp_path: Path) -> None:
    journal, ledger, marker = tmp_path / "j", tmp_path / "ledger", tmp_path / "marker"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    a = subprocess.Popen(["unshare", "--pid", "--fork", "--mount-proc", sys.executable,
                          str(HERE), "zombie-worker", str(journal), str(ledger), str(marker)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                         start_new_session=True)
    try:
        end = time.monotonic() + 20
        while not marker.exists():
            assert a.poll() is None and time.monotonic() < end, a.communicate()
            time.sleep(0.01)
        os.killpg(a.pid, signal.SIGSTOP)
        time.sleep(2.5)  # past A's lease of 1 s: only its lease can judge it from here
        with bl.Runner(journal, lease_s=1.0) as b:
            [found] = b.recover()  # epoch 2: from now on, A owns nothing
            assert found.state.epoch == 2
            claimed = time.time()
            os.killpg(a.pid, signal.SIGCONT)
            out, err = a.communicate(timeout=30)
        assert a.returncode == 0, err.decode()
        assert json.loads(out)["status"] == "journal_unavailable"  # fenced at its append
    finally:
        if a.poll() is None:
            os.killpg(a.pid, signal.SIGCONT)
            os.killpg(a.pid, signal.SIGKILL)
            a.wait()
    started = [(int(n), int(epoch), float(at)) for n, epoch, at in
               (line.split() for line in ledger.read_text().splitlines())]
    # SPEC 6: a runner never starts an attempt unless it owns the run. A started c1 at
    # epoch 1 before the claim; c2 (dispatched before the freeze) must not start after it.
    assert [(n, epoch) for n, epoch, _ in started] == [(1, 1)], (started, claimed)


if __name__ == "__main__" and sys.argv[1:2] == ["zombie-worker"]:
    _zombie_worker(*sys.argv[2:5])


def test_a_worker_that_woke_and_left_is_counted_as_gone_from_when_it_began_leaving(
        tmp_path: Path) -> None:
    # Closing removes the owner record before the process is gone: a claim in between,
    # within a lease of the worker's last pause, is a takeover after an exit, not after a
    # pause (on one pid namespace a frozen worker is never taken over).
    from boundloop import events as ev
    from boundloop.drill import DrillReport
    from boundloop.drill._invariants import _takeover
    from boundloop.drill._processes import _Life

    out = tmp_path / "w1.out"
    out.write_text("ready o1 1.0\nidle\nleaving 12.5\nbye 12.9\n")
    life = _Life("w1", 0, [], None, out, tmp_path / "w1.err", pauses=[[10.0, 12.0]])
    assert life.ready() and life.owner == "o1" and life.left_at() == 12.5
    life.exited_at = life.left_at()
    report = DrillReport(1, lease_s=1.0)
    claim = ev.OwnerClaimed(run_id="r", owner="o2", epoch=2, ts=12.7)
    record = _takeover(report, [], {"o1": life}, "person", "o1", claim)
    assert record["cause"] == "exit" and report.takeovers_after_pause == 0
    out.write_text("ready o1 1.0\nidle\n")  # killed before it left: no time to read
    assert _Life("w1", 0, [], None, out, tmp_path / "e").left_at() == 0.0
