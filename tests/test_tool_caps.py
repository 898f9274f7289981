"""Per-tool caps (issue #24): ``bl.tool(max_calls=N)``, counted like the call budget
(denied calls count, a retry is the same call), durable in the journal, and shared across
nested runs at every level, parallel children included."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import msgspec
import pytest
from loop_helpers import journal_of

import boundloop as bl
from boundloop import events as ev
from boundloop.core import rules as decide
from boundloop.journal import LmdbJournal
from boundloop.testing import FaultyJournal


def calls(*ids: str, name: str = "send") -> bl.CallTools:
    return bl.CallTools([bl.ToolCall(i, name, {}) for i in ids])


def capped_send(effects: list[str], cap: int = 3) -> bl.Tool:
    @bl.tool(max_calls=cap)
    def send() -> str:
        effects.append("sent")
        return "sent"

    return send


# -- configuration ---------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [-1, 1.5, "3", True, 2 ** 63])
def test_a_bad_cap_is_refused_saying_what_is_valid(bad: Any) -> None:
    def send() -> str:
        return "x"

    for make in (lambda: bl.tool(max_calls=bad)(send),
                 lambda: bl.Tool("send", send, max_calls=bad),
                 lambda: bl.Tool.from_schema("send", {"type": "object"}, lambda: "x",
                                             max_calls=bad)):
        with pytest.raises(bl.ConfigError, match="max_calls must be a whole number from 0"):
            make()


def test_valid_caps_are_kept() -> None:
    assert bl.tool(max_calls=0)(lambda: "x").max_calls == 0
    assert bl.Tool("t", lambda: "x").max_calls is None
    assert bl.Tool.from_schema("t", {"type": "object"}, lambda: "x", max_calls=2).max_calls == 2


# -- the pure rule ----------------------------------------------------------------------------
def test_cap_denials_count_every_call_of_the_batch_in_order() -> None:
    names = ["send", "look", "send", "send"]
    out = decide.cap_denials(names, {"send": 3}, {"send": 1})
    assert [bool(r) for r in out] == [False, False, False, True]
    assert out[3] == "tool 'send' reached its cap of 3 calls in this run (max_calls=3)"
    # A nested run: the tree granted one call of it; the second is denied.
    out = decide.cap_denials(["send", "send"], {}, {}, granted={"send": 1},
                             tree_caps={"send": 4})
    assert out[0] == "" and "enclosing run (max_calls=4" in out[1]


# -- one run ----------------------------------------------------------------------------------
def test_calls_past_the_cap_are_denied_and_the_run_goes_on(runner: bl.Runner) -> None:
    effects: list[str] = []
    send = capped_send(effects)
    model = bl.ScriptedModel([calls("a", "b"), calls("c", "d"), calls("e"),
                              bl.Final("done")])
    result = runner.run(model=model, tools=[send], prompt="go",
                        budget=bl.Budget(max_model_steps=6, max_tool_calls=10))
    assert result.status == "final"
    assert result.tool_calls == 5 and effects == ["sent"] * 3
    statuses = {m.id: m.status for m in result.transcript if m.kind == "tool_result"}
    assert statuses == {"a": "ok", "b": "ok", "c": "ok", "d": "denied", "e": "denied"}
    reason = next(m.content for m in result.transcript
                  if m.kind == "tool_result" and m.id == "d")
    assert reason == "tool 'send' reached its cap of 3 calls in this run (max_calls=3)"
    _, events = journal_of(runner, result)
    decided = [e for e in events if isinstance(e, ev.CallDecided)]
    assert [e.decision for e in decided] == ["allow"] * 3 + ["denied"] * 2
    # Each denial is durable before anything of its step, and no denied call dispatches.
    denied = {e.execution_id for e in decided if e.decision == "denied"}
    assert not [e for e in events if isinstance(e, ev.CallDispatched)
                and e.execution_id in denied]
    # Step 2 (c runs, d is denied): both decisions come before c's dispatch.
    at = {(type(e).__name__, getattr(e, "execution_id", "")): i for i, e in enumerate(events)}
    run_id = result.run_id
    assert at[("CallDecided", f"{run_id}:2:1")] < at[("CallDispatched", f"{run_id}:2:0")]
    assert isinstance(events[0], ev.RunAdmitted) and events[0].tool_caps == {"send": 3}
    state = bl.replay(events)
    assert state.tool_counts == {"send": 5} and state.tool_caps == {"send": 3}
    assert state.tool_calls == result.tool_calls


def test_the_cap_is_checked_before_the_permit(runner: bl.Runner) -> None:
    asked: list[str] = []

    def permit(call: bl.ToolCall, tool: bl.Tool, ctx: bl.ModelContext) -> bool:
        asked.append(call.id)
        return call.id != "a"  # a denied call counts against the cap too

    effects: list[str] = []
    send = capped_send(effects, cap=2)
    model = bl.ScriptedModel([calls("a", "b", "c"), bl.Final("done")])
    result = runner.run(model=model, tools=[send], prompt="go", permit=permit)
    assert asked == ["a", "b"] and effects == ["sent"]
    assert [c.status for c in result.completed] == ["denied", "ok", "denied"]


def test_a_cap_of_zero_denies_every_call_and_other_tools_are_free(runner: bl.Runner) -> None:
    effects: list[str] = []
    send = capped_send(effects, cap=0)

    @bl.tool
    def look() -> str:
        return "seen"

    model = bl.ScriptedModel([bl.CallTools([bl.ToolCall("a", "send", {}),
                                            bl.ToolCall("b", "look", {})]), bl.Final("ok")])
    result = runner.run(model=model, tools=[send, look], prompt="go")
    assert [c.status for c in result.completed] == ["denied", "ok"] and effects == []


def test_a_retry_is_the_same_call(runner: bl.Runner) -> None:
    tries: list[int] = []

    @bl.tool(max_calls=1, retry=bl.RetryPolicy(max_attempts=3, retry_on=(ValueError,)))
    def flaky(ctx: bl.ToolContext) -> str:
        tries.append(ctx.attempt)
        if ctx.attempt < 3:
            raise ValueError("not yet")
        return "done"

    model = bl.ScriptedModel([calls("a", name="flaky"), calls("b", name="flaky"),
                              bl.Final("ok")])
    result = runner.run(model=model, tools=[flaky], prompt="go")
    assert tries == [1, 2, 3] and result.tool_calls == 4  # 3 attempts + the denied call
    assert [c.status for c in result.completed] == ["ok", "denied"]
    assert bl.replay(runner.journal.events(result.run_id)).tool_counts == {"flaky": 2}


def test_a_resumed_run_keeps_its_count(tmp_path: Path) -> None:
    effects: list[str] = []

    def sent(key: str) -> str:
        return "sent"  # every send took effect

    @bl.tool(max_calls=3, reconcile=sent)
    def send() -> str:
        effects.append("sent")
        return "sent"

    # Append 1 admits the run, 2 holds step 1's decisions, 3 (a and b's outcomes with
    # step 2's decision) fails: the run stops with a and b open, as a crash leaves it.
    journal = FaultyJournal(LmdbJournal(tmp_path / "j"), fail_at=3, mode="raise")
    with bl.Runner(journal) as runner:
        first = runner.run(model=bl.ScriptedModel([calls("a", "b"), calls("x")]),
                           tools=[send], prompt="go", run_id="r")
        assert first.status == "journal_unavailable" and effects == ["sent"] * 2
    journal.close()
    with bl.Runner(tmp_path / "j") as runner:
        [found] = runner.recover()
        assert found.state.tool_counts == {"send": 2}
        result = runner.resume("r", model=bl.ScriptedModel([calls("c", "d"), bl.Final("ok")]),
                               tools=[send])
        assert result.status == "final" and effects == ["sent"] * 3
        assert [c.status for c in result.completed] == ["ok", "ok", "ok", "denied"]
        events = list(runner.journal.events("r"))
        assert bl.replay(events).tool_counts == {"send": 4}


# -- nested runs ------------------------------------------------------------------------------
def test_a_childs_calls_count_against_the_parents_cap(runner: bl.Runner) -> None:
    effects: list[str] = []
    send = capped_send(effects, cap=3)

    @bl.tool
    def delegate(ctx: bl.ToolContext) -> str:
        child = bl.ScriptedModel([calls("k1", "k2"), calls("k3"), bl.Final("child done")])
        result = ctx.run_child(model=child, tools=[bl.Tool("send", send.handler)],
                               prompt="go")
        return f"{result.status} {[c.status for c in result.completed]}"

    parent = bl.ScriptedModel([calls("p1"), calls("d1", name="delegate"), calls("p2"),
                               bl.Final("done")])
    result = runner.run(model=parent, tools=[send, delegate], prompt="go",
                        budget=bl.Budget(max_tool_calls=20), run_id="parent")
    # p1 runs; the child gets 2 of its 3 calls (the uncapped child tool is capped by its
    # parent's send); p2 is denied: 1 + 3 (the child's) reached 3.
    assert effects == ["sent"] * 3
    delegated = next(m.content for m in result.transcript
                     if m.kind == "tool_result" and m.id == "d1")
    assert delegated == "final ['ok', 'ok', 'denied']"
    assert [c.status for c in result.completed if c.tool == "send"] == ["ok", "denied"]
    state = bl.replay(runner.journal.events("parent"))
    assert state.tool_counts == {"send": 5, "delegate": 1}
    assert state.child_tool_counts == {"send": 3}
    charged = [e for e in runner.journal.events("parent") if isinstance(e, ev.ChildCharged)]
    assert sum(e.tools.get("send", 0) for e in charged) == 3


def test_a_grandchilds_calls_count_at_every_level(runner: bl.Runner) -> None:
    effects: list[str] = []
    send = capped_send(effects, cap=2)
    free_send = bl.Tool("send", send.handler)  # uncapped itself: the root's cap binds

    @bl.tool
    def inner(ctx: bl.ToolContext) -> str:
        grandchild = bl.ScriptedModel([calls("g1", "g2", "g3"), bl.Final("done")])
        result = ctx.run_child(model=grandchild, tools=[free_send], prompt="go")
        return ",".join(c.status for c in result.completed)

    @bl.tool
    def outer(ctx: bl.ToolContext) -> str:
        child = bl.ScriptedModel([calls("i1", name="inner"), bl.Final("done")])
        return ctx.run_child(model=child, tools=[inner], prompt="go").status

    root = bl.ScriptedModel([calls("o1", name="outer"), calls("r1"), bl.Final("done")])
    result = runner.run(model=root, tools=[send, outer], prompt="go", run_id="root")
    assert effects == ["sent"] * 2
    assert [c.status for c in result.completed] == ["ok", "denied"]
    assert bl.replay(runner.journal.events("root")).tool_counts == {
        "outer": 1, "inner": 1, "send": 4}


def test_parallel_children_never_exceed_the_cap_together(journal_dir: Path) -> None:
    effects: list[str] = []
    lock = threading.Lock()
    inside = threading.Barrier(4, timeout=10)

    @bl.tool(max_calls=3)
    def send() -> str:
        with lock:
            effects.append("sent")
        return "sent"

    @bl.tool
    async def delegate(i: int, ctx: bl.ToolContext) -> str:
        child = bl.ScriptedModel([calls(f"c{i}a", f"c{i}b"), calls(f"c{i}c"),
                                  bl.Final("done")])
        result = await ctx.arun_child(model=child, tools=[send], prompt="go")
        return ",".join(c.status for c in result.completed)

    @bl.tool
    def sync_delegate(i: int, ctx: bl.ToolContext) -> str:
        inside.wait()  # the four children start together
        child = bl.ScriptedModel([calls(f"s{i}a"), calls(f"s{i}b", f"s{i}c"),
                                  bl.Final("done")])
        result = ctx.run_child(model=child, tools=[send], prompt="go")
        return ",".join(c.status for c in result.completed)

    batch = bl.CallTools(
        [bl.ToolCall(f"d{i}", "sync_delegate", {"i": i}) for i in range(4)]
        + [bl.ToolCall(f"a{i}", "delegate", {"i": i}) for i in range(3)])
    parent = bl.ScriptedModel([batch, calls("p1"), bl.Final("done")])
    with bl.Runner(journal_dir, tool_threads=8) as runner:
        result = runner.run(model=parent, tools=[send, delegate, sync_delegate], prompt="go",
                            budget=bl.Budget(max_tool_calls=100, max_parallel=7),
                            run_id="parent")
        assert result.status == "final"
        assert len(effects) == 3  # 21 calls asked for across 7 children, 3 ran
        denied = [m for m in result.transcript if m.kind == "tool_result" and m.id == "p1"]
        assert denied[0].status == "denied"
        state = bl.replay(runner.journal.events("parent"))
        assert state.tool_counts["send"] == 22 and state.child_tool_counts["send"] == 21
        assert state.tool_calls == result.tool_calls == 7 + 21 + 1


def test_old_events_decode_with_new_fields_defaulted() -> None:
    enc = msgspec.msgpack.Encoder()
    old = {"type": "child.charged", "run_id": "r", "child_run_id": "c", "tool_calls": 2}
    event = msgspec.msgpack.decode(enc.encode(old), type=ev.ChildCharged)
    assert event.tools == {}
    admitted = {"type": "run.admitted", "run_id": "r", "budget": {}, "history": [],
                "tools": ["send"]}
    assert msgspec.msgpack.decode(enc.encode(admitted), type=ev.RunAdmitted).tool_caps == {}


def test_show_states_each_caps_count(journal_dir: Path) -> None:
    from click.testing import CliRunner

    from boundloop.cli import cli

    effects: list[str] = []
    with bl.Runner(journal_dir) as runner:
        runner.run(model=bl.ScriptedModel([calls("a", "b", "c", "d"), bl.Final("ok")]),
                   tools=[capped_send(effects)], prompt="go", run_id="r")
    out = CliRunner().invoke(cli, ["--journal", str(journal_dir), "show", "r"])
    assert out.exit_code == 0, out.output
    assert "tool caps: send 4/3" in out.output
    assert "tools: send (max_calls=3)" in out.output


def test_a_parents_own_calls_of_a_batch_count_before_its_children_reserve(
        runner: bl.Runner) -> None:
    effects: list[str] = []
    send = capped_send(effects, cap=3)

    @bl.tool
    def delegate(ctx: bl.ToolContext) -> str:
        child = bl.ScriptedModel([calls(f"{ctx.call_id}-k1", f"{ctx.call_id}-k2"),
                                  bl.Final("done")])
        result = ctx.run_child(model=child, tools=[send], prompt="go")
        return ",".join(c.status for c in result.completed)

    # Step 1 opens the run tree's ledger (a child). Step 2's own send is decided before
    # its child reserves: the child must see it (1 + 1 + 1 = 3, the cap).
    parent = bl.ScriptedModel([
        calls("d1", name="delegate"),
        bl.CallTools([bl.ToolCall("p1", "send", {}), bl.ToolCall("d2", "delegate", {})]),
        bl.Final("done")])
    result = runner.run(model=parent, tools=[send, delegate], prompt="go",
                        budget=bl.Budget(max_parallel=1), run_id="parent")
    assert result.status == "final"
    assert len(effects) == 3, effects
    state = bl.replay(runner.journal.events("parent"))
    assert state.tool_counts["send"] == 5


CRASH = '''
import os, signal, sys
import boundloop as bl

ledger = sys.argv[2]

@bl.tool(max_calls=2)
def send(to: str, ctx: bl.ToolContext) -> str:
    with open(ledger, "a") as f:
        f.write(ctx.idempotency_key + "\\n")
        f.flush()
        os.fsync(f.fileno())
    if to == "bob":
        os.kill(os.getpid(), signal.SIGKILL)  # dies right after the side effect
    return "sent"

model = bl.ScriptedModel([bl.CallTools([bl.ToolCall("a", "send", {"to": "ann"})]),
                          bl.CallTools([bl.ToolCall("b", "send", {"to": "bob"})])])
with bl.Runner(sys.argv[1]) as runner:
    runner.run(model=model, tools=[send], prompt="go", run_id="crashed")
'''


def test_a_run_killed_mid_call_resumes_with_its_count(tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    journal, ledger = tmp_path / "j", tmp_path / "ledger"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    proc = subprocess.run([sys.executable, "-c", CRASH, str(journal), str(ledger)],
                          env=env, timeout=60, capture_output=True, text=True)
    assert proc.returncode == -9, proc.stderr
    assert len(ledger.read_text().splitlines()) == 2

    def took(key: str) -> str | None:
        return "sent" if key in ledger.read_text().splitlines() else None

    @bl.tool(max_calls=2, reconcile=took)
    def send(to: str) -> str:
        with open(ledger, "a") as f:
            f.write("resumed\n")
        return "sent"

    with bl.Runner(journal) as runner:
        [found] = runner.recover()
        assert found.state.tool_counts == {"send": 2}
        assert [u.call_id for u in found.unresolved] == ["b"]
        model = bl.ScriptedModel([bl.CallTools([bl.ToolCall("c", "send", {"to": "cy"})]),
                                  bl.Final("done")])
        result = runner.resume("crashed", model=model, tools=[send])
    assert result.status == "final"
    assert [(c.call_id, c.status) for c in result.completed] == [
        ("a", "ok"), ("b", "ok"), ("c", "denied")]
    assert len(ledger.read_text().splitlines()) == 2  # c never ran


def test_a_later_batchs_children_see_its_own_calls_in_max_tool_calls(
        runner: bl.Runner) -> None:
    ran: list[str] = []

    @bl.tool
    def ping(ctx: bl.ToolContext) -> str:
        ran.append(ctx.call_id)
        return "pong"

    @bl.tool
    def delegate(ctx: bl.ToolContext) -> str:
        child = bl.ScriptedModel([calls(f"{ctx.call_id}-k", name="ping"), bl.Final("done")])
        return ctx.run_child(model=child, tools=[ping], prompt="go").status

    parent = bl.ScriptedModel([
        calls("d1", name="delegate"),                       # 1 + its child's 1
        bl.CallTools([bl.ToolCall("p1", "ping", {}), bl.ToolCall("p2", "ping", {}),
                      bl.ToolCall("d2", "delegate", {})]),  # 2 + 3 = 5: nothing left
        bl.Final("done")])
    result = runner.run(model=parent, tools=[ping, delegate], prompt="go",
                        budget=bl.Budget(max_tool_calls=5, max_parallel=1), run_id="parent")
    assert result.tool_calls == 5 and "d2-k" not in ran
    d2 = next(m.content for m in result.transcript if m.kind == "tool_result" and m.id == "d2")
    assert d2 == "limit_exceeded"
