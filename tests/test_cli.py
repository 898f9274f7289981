"""The ``boundloop`` command, driven as users drive it: ``python -m boundloop ...`` in a
subprocess, against a journal made by real runs (the demo, and a run killed by SIGKILL)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

import boundloop as bl

GOLDEN = Path(__file__).with_name("golden")
SECRET = "s3cret-value-never-in-clear"
CRASH = textwrap.dedent(f"""
    import os, signal, sys
    import boundloop as bl

    @bl.tool(irreversible=True)
    def deploy(service: str, token: str) -> str:
        os.kill(os.getpid(), signal.SIGKILL)  # dies inside the side effect
        return "unreachable"

    call = bl.ToolCall("c1", "deploy", {{"service": "api", "token": {SECRET!r}}})
    with bl.Runner(sys.argv[1]) as runner:
        runner.run(model=bl.ScriptedModel([bl.CallTools([call])]), tools=[deploy],
                   prompt="deploy api", run_id="crashed-run")
""")


class Done:
    def __init__(self, args: Sequence[str], proc: subprocess.CompletedProcess[str]) -> None:
        self.args, self.code, self.out, self.err = list(args), proc.returncode, proc.stdout, \
            proc.stderr

    def json(self) -> Any:
        return json.loads(self.out)

    def __repr__(self) -> str:
        return f"boundloop {' '.join(self.args)} -> {self.code}\n{self.out}\n{self.err}"


def env() -> dict[str, str]:
    e = dict(os.environ)
    e.pop("BOUNDLOOP_JOURNAL", None)
    e.pop("BOUNDLOOP_DEBUG", None)
    e["COLUMNS"] = "160"
    return e


def many(*commands: Sequence[str]) -> list[Done]:
    """Run several ``python -m boundloop`` commands at once (each its own process)."""
    procs = [subprocess.Popen([sys.executable, "-m", "boundloop", *c], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env()) for c in commands]
    out = []
    for c, p in zip(commands, procs, strict=True):
        stdout, stderr = p.communicate(timeout=60)
        out.append(Done(c, subprocess.CompletedProcess(c, p.returncode, stdout, stderr)))
    return out


def bl_(*args: str) -> Done:
    return many(args)[0]


def assert_one_line_error(done: Done, code: int, *words: str) -> None:
    assert done.code == code, done
    assert "Traceback" not in done.err, done
    lines = done.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("boundloop: "), done
    for w in words:
        assert w in lines[0], done
    assert done.out == "", done


@pytest.fixture(scope="module")
def journal(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    path = tmp_path_factory.mktemp("cli") / "journal"
    demo, = many(["demo", "--journal", str(path), "--json"])
    assert demo.code == 0, demo
    crash = subprocess.run([sys.executable, "-c", CRASH, str(path)], timeout=60,
                           capture_output=True, text=True)
    assert crash.returncode == -signal.SIGKILL, crash.stderr
    scenarios = {row["scenario"]: row for row in demo.json()}
    return {"path": str(path), "scenarios": scenarios,
            "ids": {name: row["run_id"] for name, row in scenarios.items()}}


def test_runs_lists_newest_first(journal: dict[str, Any]) -> None:
    j = journal["path"]
    table, as_json, limited, recent, old, interrupted = many(
        ["runs", "--journal", j],
        ["runs", "--journal", j, "--json"],
        ["runs", "--journal", j, "--json", "--status", "limit_exceeded",
         "--limit-hit", "tool_calls"],
        ["runs", "--journal", j, "--json", "--since", "1h", "-n", "2"],
        ["runs", "--journal", j, "--json", "--older-than", "1h"],
        ["runs", "--journal", j, "--status", "interrupted"],
    )
    for done in (table, as_json, limited, recent, old, interrupted):
        assert done.code == 0 and done.err == "", done
    rows = as_json.json()
    ids = journal["ids"]
    # The needs_review scenario's run shows up twice in the demo (then resolved and resumed).
    assert [r["run_id"] for r in rows] == ["crashed-run",
                                           *reversed(list(dict.fromkeys(ids.values())))]
    for r in rows:
        assert {"run_id", "status", "model_steps", "tool_calls", "exhausted_limit",
                "explanation", "unresolved", "created_ts"} <= set(r)
    by_id = {r["run_id"]: r for r in rows}
    last = {scenario["run_id"]: name for name, scenario in journal["scenarios"].items()}
    for name, scenario in journal["scenarios"].items():
        if last[scenario["run_id"]] != name:
            continue  # the run went on after this row (resolved, then resumed)
        got = by_id[scenario["run_id"]]
        assert (got["status"], got["exhausted_limit"], got["model_steps"], got["tool_calls"]) \
            == (scenario["status"], scenario["limit"], scenario["model_steps"],
                scenario["tool_calls"]), name
    crashed = by_id["crashed-run"]
    assert (crashed["status"], crashed["unresolved"], crashed["tool_calls"]) == \
        ("interrupted", 1, 1)
    assert [r["run_id"] for r in limited.json()] == [ids["nested: child"],
                                                     ids["call beyond budget"]]
    assert [r["run_id"] for r in recent.json()] == [rows[0]["run_id"], rows[1]["run_id"]]
    assert old.json() == []
    for run_id in by_id:
        assert run_id in table.out
    assert "newest first" in table.out and "limit_exceeded" in table.out
    assert "crashed-run" in interrupted.out and ids["tool then final"] not in interrupted.out


def test_show_gives_the_timeline(journal: dict[str, Any]) -> None:
    j, ids = journal["path"], journal["ids"]
    parallel, as_json, crashed, unknown = many(
        ["show", ids["parallel partial failure"], "--journal", j],
        ["show", ids["timeout -> outcome unknown"], "--journal", j, "--json"],
        ["show", "crashed-run", "--journal", j],
        ["show", "crashed-run", "--journal", j, "--json"],
    )
    for done in (parallel, as_json, crashed, unknown):
        assert done.code == 0 and done.err == "", done
    out = parallel.out
    for word in ("RunAdmitted", "ModelStepStarted", "CallDecided", "CallSucceeded",
                 "CallFailed", "RunFinished", "allow", "deploy", "RuntimeError",
                 "status: final", "explanation: The model gave a final answer.",
                 "completed actions", "unresolved actions: none", "2/20"):
        assert word in out, word
    tl = as_json.json()
    assert tl["status"] == "final" and tl["finished"] is True
    assert [r["seq"] for r in tl["rows"]] == list(range(1, len(tl["rows"]) + 1))
    timed = [r for r in tl["rows"] if r["event"] == "CallTimedOut"]
    assert timed and timed[0]["call_id"] == "c1" and timed[0]["latency_s"] > 0
    assert timed[0]["tool"] == "slow_report" and timed[0]["outcome"] == "timed_out"
    assert [u["call_id"] for u in tl["unresolved"]] == ["c1"]
    assert all({"offset_s", "step", "decision", "model_steps", "tool_calls", "usage"} <= set(r)
               for r in tl["rows"])
    assert "no RunFinished event yet" in crashed.out and "unresolved actions" in crashed.out
    assert SECRET not in crashed.out and SECRET not in unknown.out
    assert unknown.json()["unresolved"][0]["tool"] == "deploy"


def test_replay_rebuilds_and_checks(journal: dict[str, Any], tmp_path: Path) -> None:
    j, ids = journal["path"], journal["ids"]
    run = ids["parallel partial failure"]
    tampered = tmp_path / "tampered.jsonl"
    lines = (GOLDEN / "limit_tool_calls.jsonl").read_text().splitlines()
    last = json.loads(lines[-1])
    last["tool_calls"] += 1
    tampered.write_text("\n".join([*lines[:-1], json.dumps(last)]) + "\n")
    plain, checked, lower, golden, golden_lower, bad, crashed = many(
        ["replay", run, "--journal", j],
        ["replay", run, "--journal", j, "--check", "--json"],
        ["replay", run, "--journal", j, "--check", "--max-tool-calls", "1"],
        ["replay", "--events", str(GOLDEN / "final.msgpack"), "--check"],
        ["replay", "--events", str(GOLDEN / "final.jsonl"), "--check", "--max-tool-calls",
         "3", "--json"],
        ["replay", "--events", str(tampered)],
        ["replay", "crashed-run", "--journal", j, "--check"],
    )
    assert plain.code == 0, plain
    assert "status: final" in plain.out
    assert "consistency: ok, the fold agrees with RunFinished (seq 15)" in plain.out
    assert "tool_result" in plain.out and "deploy of broken failed" in plain.out
    assert checked.code == 0, checked
    data = checked.json()
    assert (data["status"], data["consistent"], data["check"]["ok"]) == ("final", True, True)
    assert data["check"]["decisions"] == 5 and data["check"]["divergence"] is None
    assert lower.code == 1, lower
    assert "check: DIVERGES at step 1, seq 5: recorded call c1 (deploy) at step 1: allow" \
        in lower.out
    assert "limit_exceeded (tool_calls)" in lower.out
    assert golden.code == 0 and "check: ok" in golden.out, golden
    assert golden_lower.code == 1, golden_lower
    div = golden_lower.json()["check"]["divergence"]
    assert (div["seq"], div["step"]) == (5, 1) and "c1" in div["recorded"]
    assert golden_lower.json()["check"]["budget"]["max_tool_calls"] == 3
    assert bad.code == 1 and "consistency: MISMATCH tool_calls" in bad.out, bad
    assert crashed.code == 0, crashed
    assert "not finished" in crashed.out and "recording ends" in crashed.out


def test_export_is_redacted_json_lines(journal: dict[str, Any], tmp_path: Path) -> None:
    j, ids = journal["path"], journal["ids"]
    out = tmp_path / "crashed.jsonl"
    crashed, stripped, demo_run = many(
        ["export", "crashed-run", "--journal", j],
        ["export", "crashed-run", "--journal", j, "--strip-content", "-o", str(out)],
        ["export", ids["tool then final"], "--journal", j],
    )
    for done in (crashed, stripped, demo_run):
        assert done.code == 0 and done.err == "", done
    events = [json.loads(line) for line in crashed.out.splitlines()]
    assert [e["seq"] for e in events] == list(range(1, len(events) + 1))
    assert events[0]["type"] == "RunAdmitted"  # as `show` names events
    assert "CallDecided" in [e["type"] for e in events]
    assert SECRET not in crashed.out and "hmac-sha256:" in crashed.out
    assert stripped.out == "" and SECRET not in out.read_text()
    assert "deploy api" in crashed.out and "deploy api" not in out.read_text()
    assert [json.loads(x)["type"] for x in out.read_text().splitlines()] == \
        [e["type"] for e in events]
    back = bl_("replay", "--events", str(out), "--json")
    assert back.code == 0 and back.json()["tool_calls"] == 1, back
    assert json.loads(demo_run.out.splitlines()[-1])["status"] == "final"


def test_prune_removes_only_old_finished_runs(journal: dict[str, Any], tmp_path: Path) -> None:
    j = tmp_path / "copy"
    shutil.copytree(journal["path"], j)
    finished = set(journal["ids"].values())
    nothing, dry = many(
        ["prune", "--journal", str(j), "--older-than", "30d"],
        ["prune", "--journal", str(j), "--older-than", "0s", "--dry-run", "--json"],
    )
    assert nothing.code == 0 and nothing.out.startswith("removed 0 finished runs"), nothing
    assert dry.code == 0, dry
    assert set(dry.json()["pruned"]) == finished and dry.json()["dry_run"] is True
    done = bl_("prune", "--journal", str(j), "--older-than", "0s")
    assert done.code == 0 and done.out.startswith(f"removed {len(finished)} finished runs")
    left = bl_("runs", "--journal", str(j), "--json")
    assert [r["run_id"] for r in left.json()] == ["crashed-run"]
    with bl.Runner(j) as runner:  # recovery still works: the open run and its index are intact
        assert list(runner.journal.open_runs()) == ["crashed-run"]
        recovered = runner.recover()
        assert [r.run_id for r in recovered] == ["crashed-run"]
        assert [(u.call_id, u.tool) for u in recovered[0].unresolved] == [("c1", "deploy")]


def test_bad_input_is_one_line_and_a_usable_exit_code(journal: dict[str, Any],
                                                      tmp_path: Path) -> None:
    j, ids = journal["path"], journal["ids"]
    run = ids["tool then final"]
    not_dir = tmp_path / "file"
    not_dir.write_text("x")
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "data.mdb").write_bytes(b"not an lmdb file" * 512)
    locked = tmp_path / "locked"
    shutil.copytree(j, locked)
    (locked / "lock.mdb").unlink()
    (locked / "lock.mdb").mkdir()  # the lock cannot be taken
    cases: list[tuple[list[str], int, tuple[str, ...]]] = [
        (["show", "nope", "--journal", j], 3, ("no run 'nope'",)),
        (["replay", "nope", "--journal", j, "--check"], 3, ("no run 'nope'",)),
        (["export", "nope", "--journal", j], 3, ("no run 'nope'",)),
        (["runs", "--journal", str(tmp_path / "missing")], 4, ("no journal at",)),
        (["show", run, "--journal", str(not_dir)], 4, ("not a journal directory",)),
        (["runs", "--journal", str(corrupt)], 4, ("is not an LMDB file", "from a backup")),
        (["runs", "--journal", str(locked)], 4, ("cannot open the journal",)),
        (["prune", "--journal", j, "--older-than", "30x"], 2, ("bad duration '30x'",)),
        (["runs", "--journal", j, "--since", "soon"], 2, ("bad duration",)),
        (["prune", "--journal", j], 2, ("--older-than",)),
        (["runs", "--journal", j, "--status", "bogus"], 2, ("not a status",)),
        (["replay", run, "--journal", j, "--max-tool-calls", "1"], 2, ("need --check",)),
        (["replay", run, "--journal", j, "--check", "--max-model-steps", "0"], 2,
         ("max_model_steps must be at least 1",)),
        (["replay", "--journal", j], 2, ("RUN_ID or --events",)),
        (["replay", "--events", str(tmp_path / "none.jsonl")], 2, ("cannot read",)),
        (["replay", "--events", str(not_dir)], 4, ("not an event",)),
        (["frobnicate"], 2, ("No such command",)),
        (["show", "--journal", j], 2, ("Missing argument",)),
        (["runs", "--bogus"], 2, ("No such option",)),
    ]
    results = many(*(args for args, _, _ in cases))
    for (_, code, words), done in zip(cases, results, strict=True):
        assert_one_line_error(done, code, *words)
    assert not (tmp_path / "missing").exists()  # a read never creates a journal


def test_help_and_demo_still_work(journal: dict[str, Any]) -> None:
    top, bare, replay_help = many(["--help"], [], ["replay", "--help"])
    for done in (top, bare, replay_help):
        assert done.code == 0 and done.err == "", done
    for command in ("demo", "runs", "show", "replay", "prune", "export", "Exit codes"):
        assert command in top.out and command in bare.out
    assert "--max-tool-calls" in replay_help.out and "--check" in replay_help.out
    assert len(journal["scenarios"]) == 15


def test_import_boundloop_stays_light() -> None:
    code = ("import boundloop, boundloop.ops, sys; "
            "assert 'rich' not in sys.modules and 'click' not in sys.modules, "
            "sorted(m for m in sys.modules if m.split('.')[0] in ('rich', 'click'))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
