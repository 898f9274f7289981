"""`boundloop recover`, `resolve` and `drill` through real subprocesses."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from crash_worker import RUN_ID, ledger_lines, make_tools, model_for
from raw_journal import stored_bodies, stored_format

import boundloop as bl

WORKER = Path(__file__).with_name("crash_worker.py")


def boundloop(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "boundloop", *args], capture_output=True,
                          text=True, timeout=120)


def test_recover_then_resolve_then_resume(tmp_path: Path) -> None:
    journal, ledger = tmp_path / "j", tmp_path / "ledger"
    died = subprocess.run([sys.executable, str(WORKER), str(journal), str(ledger), "ship",
                           "--die"], capture_output=True, text=True, timeout=60)
    assert died.returncode == -9
    out = boundloop("recover", "--journal", str(journal), "--json")
    assert out.returncode == 0, out.stderr
    [found] = json.loads(out.stdout)
    assert found["run_id"] == RUN_ID and found["tool_calls"] == 1
    [action] = found["unresolved"]
    assert action["tool"] == "ship" and action["idempotency_key"] == ledger_lines(ledger)[0][0]

    bad = boundloop("resolve", "--journal", str(journal), RUN_ID, action["execution_id"],
                    "--outcome", "maybe")
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    unknown = boundloop("resolve", "--journal", str(journal), RUN_ID, "no-such-execution",
                        "--outcome", "failed")
    assert unknown.returncode == 2 and unknown.stderr.count("\n") == 1
    assert "Traceback" not in unknown.stderr

    ok = boundloop("resolve", "--journal", str(journal), RUN_ID, action["execution_id"],
                   "--outcome", "succeeded", "--note", "seen at the dock", "--by", "ops")
    assert ok.returncode == 0, ok.stderr
    assert "0 unresolved" in ok.stdout
    again = boundloop("resolve", "--journal", str(journal), RUN_ID, action["execution_id"],
                      "--outcome", "failed")
    assert again.returncode == 2  # already resolved

    with bl.Runner(journal) as runner:
        result = runner.resume(RUN_ID, model=model_for(["ship"]), tools=make_tools(ledger))
    assert result.status == "final"
    assert len(ledger_lines(ledger)) == 1
    assert [c.status for c in result.completed] == ["ok"]


def test_recover_on_a_missing_journal_fails_cleanly(tmp_path: Path) -> None:
    out = boundloop("recover", "--journal", str(tmp_path / "none"))
    assert out.returncode == 4
    assert out.stderr.startswith("boundloop: ") and "Traceback" not in out.stderr
    assert not (tmp_path / "none").exists()


def test_a_short_drill_passes(tmp_path: Path) -> None:
    out = boundloop("drill", "--runs", "16", "--kills", "4", "--seed", "2", "--dir",
                    str(tmp_path / "drill"), "--json")
    assert out.returncode == 0, out.stderr + out.stdout
    report = json.loads(out.stdout)
    assert report["ok"] is True
    assert report["crashes_injected"] >= 2  # kills land while work remains (timing)
    assert report["runs"] == 16 and report["runs_not_final"] == 0
    assert report["duplicate_executions"] == 0 and report["executed_without_intent"] == 0
    assert report["unresolved_missed"] == 0 and report["replay_mismatches"] == 0


def test_a_short_drill_passes_with_the_records_compressed(tmp_path: Path) -> None:
    out = boundloop("drill", "--runs", "16", "--kills", "4", "--seed", "3", "--compress",
                    "--dir", str(tmp_path / "drill"), "--json")
    assert out.returncode == 0, out.stderr + out.stdout
    report = json.loads(out.stdout)
    assert report["ok"] is True and report["compress"] is True
    assert report["crashes_injected"] >= 2 and report["runs_not_final"] == 0
    assert report["duplicate_executions"] == 0 and report["executed_without_intent"] == 0
    assert report["unresolved_missed"] == 0 and report["replay_mismatches"] == 0
    assert stored_format(tmp_path / "drill" / "journal") == 3
    bodies = stored_bodies(tmp_path / "drill" / "journal")
    assert len(bodies) > 16 * 10 and all(b[0] == 0xC1 for b in bodies)


def test_journal_option_before_the_command_and_positional_outcome(tmp_path: Path) -> None:
    journal, ledger = tmp_path / "j", tmp_path / "ledger"
    demo = boundloop("--journal", str(journal), "demo")
    assert demo.returncode == 0, demo.stderr
    assert demo.stderr == ""  # no stray tracebacks from late handler completions
    listed = boundloop("--journal", str(journal), "runs", "--json")
    assert listed.returncode == 0 and len(json.loads(listed.stdout)) == 14  # 15 rows, 14 runs
    died = subprocess.run([sys.executable, str(WORKER), str(journal), str(ledger), "book",
                           "--die"], capture_output=True, text=True, timeout=60)
    assert died.returncode == -9
    [found] = json.loads(boundloop("--journal", str(journal), "recover", "--json").stdout)
    [action] = found["unresolved"]
    assert action["phase"] == "dispatched"
    ok = boundloop("--journal", str(journal), "resolve", RUN_ID, action["execution_id"],
                   "failed", "--note", "no booking found")
    assert ok.returncode == 0, ok.stderr
    with bl.Runner(journal) as runner:
        state = runner.state(RUN_ID)
    assert state.open_actions == [] and state.calls[action["execution_id"]].status == "error"
