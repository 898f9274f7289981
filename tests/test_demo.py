"""``boundloop demo`` tells the story: each scenario's status, the limit that stopped it with
its value, its completed and unresolved actions; a needs_review run a person resolves, the
deadline, a token limit and a child run on its parent's budget; then what to run next."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import boundloop as bl
from boundloop import events as ev
from boundloop.demo import Scenario, completed_text, run_demo

#: scenario -> (status, limit with its value, completed, unresolved, tool calls)
EXPECTED: dict[str, tuple[str, str | None, str, int, int]] = {
    "tool then final": ("final", None, "1", 0, 1),
    "call beyond budget": ("limit_exceeded", "tool_calls=1", "1", 0, 1),
    "repeated call id": ("repeated_call", None, "1", 0, 1),
    "cancel from the model": ("cancelled", None, "0", 0, 0),
    "malformed output": ("malformed_response", None, "0", 0, 0),
    "model exception": ("model_error", None, "0", 0, 0),
    "tools on the final-only step": ("limit_exceeded", "model_steps=2", "1", 0, 1),
    "parallel partial failure": ("final", None, "2 (1 error)", 0, 2),
    "timeout -> outcome unknown": ("final", None, "0", 1, 1),
    "irreversible timeout": ("needs_review", None, "0", 1, 1),
    "resolved, then resumed": ("final", None, "1", 0, 1),
    "deadline": ("limit_exceeded", "deadline=0.3s", "0", 1, 1),
    "token limit": ("limit_exceeded", "total_tokens=1500", "1", 0, 1),
    "nested: parent": ("final", None, "1", 0, 4),
    "nested: child": ("limit_exceeded", "tool_calls=3", "3", 0, 3),
}


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Scenario]]:
    path = tmp_path_factory.mktemp("demo") / "journal"
    with bl.Runner(path) as runner:
        return path, run_demo(runner)


def test_every_row_shows_status_limit_completed_and_unresolved(
        demo: tuple[Path, list[Scenario]]) -> None:
    _, scenarios = demo
    assert [s.name for s in scenarios] == list(EXPECTED)
    for s in scenarios:
        status, limit, completed, unresolved, calls = EXPECTED[s.name]
        got = (s.result.status, s.limit, completed_text(s.result), len(s.result.unresolved),
               s.result.tool_calls)
        assert got == (status, limit, completed, unresolved, calls), (s.name, s.result)
        assert s.story, s.name
    by_name = {s.name: s for s in scenarios}
    failed = by_name["parallel partial failure"].result.completed
    assert sorted((c.tool, c.status) for c in failed) == [("deploy", "error"), ("deploy", "ok")]
    [unknown] = by_name["timeout -> outcome unknown"].result.unresolved
    assert unknown.tool == "slow_report"
    tool_results = [m for m in by_name["timeout -> outcome unknown"].result.transcript
                    if m.kind == "tool_result"]
    assert [m.status for m in tool_results] == ["outcome_unknown"]  # the model was told
    assert by_name["token limit"].result.usage.total_tokens == 1600
    assert by_name["deadline"].result.unresolved[0].tool == "crawl"


def test_needs_review_then_resolved_and_resumed(demo: tuple[Path, list[Scenario]]) -> None:
    path, scenarios = demo
    by_name = {s.name: s for s in scenarios}
    review, resolved = by_name["irreversible timeout"], by_name["resolved, then resumed"]
    assert review.result.run_id == resolved.result.run_id
    [action] = review.result.unresolved
    assert (action.tool, action.phase) == ("transfer", "dispatched")
    assert [(c.tool, c.status) for c in resolved.result.completed] == [("transfer", "ok")]
    with bl.Runner(path) as runner:
        events = list(runner.journal.events(review.result.run_id))
    [decision] = [e for e in events if isinstance(e, ev.CallResolved)]
    assert (decision.execution_id, decision.outcome, decision.by) == \
        (action.execution_id, "succeeded", "demo")
    finished = [e.status for e in events if isinstance(e, ev.RunFinished)]
    assert finished == ["needs_review", "final"]


def test_the_nested_run_draws_on_its_parents_budget(demo: tuple[Path, list[Scenario]]) -> None:
    path, scenarios = demo
    by_name = {s.name: s for s in scenarios}
    parent, child = by_name["nested: parent"], by_name["nested: child"]
    assert child.parent_run_id == parent.result.run_id
    assert parent.parent_run_id is None
    with bl.Runner(path) as runner:
        admitted = next(iter(runner.journal.events(child.result.run_id)))
        charged = [e for e in runner.journal.events(parent.result.run_id)
                   if isinstance(e, ev.ChildCharged)]
    assert isinstance(admitted, ev.RunAdmitted)
    assert admitted.parent_run_id == parent.result.run_id
    assert admitted.budget.max_tool_calls == 3  # asked for 10, got what the parent had left
    assert sum(e.tool_calls for e in charged) == 3
    assert parent.result.tool_calls == 1 + child.result.tool_calls


def test_the_command_prints_the_columns_the_stories_and_what_next(tmp_path: Path) -> None:
    journal = tmp_path / "journal"
    env = {k: v for k, v in os.environ.items() if k not in ("BOUNDLOOP_JOURNAL", "FORCE_COLOR",
                                                            "TTY_COMPATIBLE")}
    env["COLUMNS"] = "200"
    text, as_json = (subprocess.run([sys.executable, "-m", "boundloop", "demo", "--journal",
                                     str(journal / name), *extra], capture_output=True,
                                    text=True, timeout=120, env=env)
                     for name, extra in (("text", []), ("json", ["--json"])))
    assert text.returncode == 0 and text.stderr == "", text
    lines = text.stdout.splitlines()
    assert lines[0] == "boundloop demo"
    assert lines[1].split() == ["scenario", "status", "limit", "steps", "calls", "completed",
                                "unresolved"]
    for name, (status, limit, completed, unresolved, _) in EXPECTED.items():
        [row] = [line for line in lines[2:] if line.startswith(name + "  ")]
        cells = row[len(name):].split()
        assert cells[0] == status and cells[1] == (limit or "-"), row
        assert " ".join(cells[4:-1]) == completed and cells[-1] == str(unresolved), row
        assert any(line.startswith(f"- {name} (") for line in lines), name
    review = next(line for line in lines if line.startswith("- irreversible timeout ("))
    run_id = review.split("(", 1)[1].split(")", 1)[0]
    flag = f"--journal {journal / 'text'}"
    assert f"  boundloop {flag} show {run_id}" in lines
    assert f"  boundloop {flag} stats" in lines
    assert f"  boundloop {flag} runs --tree" in lines
    rows = json.loads(as_json.stdout)
    assert [r["scenario"] for r in rows] == list(EXPECTED)
    for r in rows:
        status, limit, completed, unresolved, calls = EXPECTED[r["scenario"]]
        assert (r["status"], r["budget_limit"], r["unresolved"], r["tool_calls"]) == \
            (status, limit, unresolved, calls), r
        assert r["completed"] == int(completed.split()[0])
    assert sum(r["failed"] for r in rows) == 1
