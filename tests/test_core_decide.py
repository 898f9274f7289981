"""``core.decide`` tested as a plain function (issue #21): no thread, no journal, no clock.

A small pure interpreter answers each effect with scripted facts (model replies, attempt
outcomes, estimates), folds the Step's events with ``replay.apply`` as the real one does,
and hypothesis draws the scripts and budgets. The properties are SPEC 5's and 6's."""

from __future__ import annotations

import random
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from boundloop import events as ev
from boundloop.core import effects as fx
from boundloop.core import inputs as fact
from boundloop.core.budget import Budget, ChildSpend, LedgerReply, TreeLeft, Usage
from boundloop.core.decide import Unexpected, decide
from boundloop.core.finish import lose, outbox
from boundloop.core.kinds import RUN_STATUSES
from boundloop.core.replay import RunState, apply, replay
from boundloop.core.rules import Attempt
from boundloop.core.state import Config, Instant, Machine, ToolFacts
from boundloop.messages import CallTools, Final, ToolCall

RID = "run-1"
TOOLS = {"add": ToolFacts(read_only=True, idempotent=True),
         "send": ToolFacts(irreversible=True),
         "ask": ToolFacts(approval="rule")}

# -- scripts ---------------------------------------------------------------------------------
call = st.builds(lambda name, n: ToolCall(id=f"c{n}", name=name, arguments={"x": n}),
                 st.sampled_from(["add", "send", "ask", "nope"]), st.integers(0, 5))
reply = st.one_of(
    st.builds(lambda t, n: Final(text=t, usage=Usage(input_tokens=n, output_tokens=1)),
              st.text(max_size=5), st.integers(0, 50)),
    st.builds(lambda calls, n: CallTools(calls=calls, usage=Usage(input_tokens=n)),
              st.lists(call, min_size=1, max_size=3), st.integers(0, 50)),
    st.just("malformed"), st.just("raises"))
outcome = st.sampled_from(["ok", "error", "timeout", "skipped"])
budgets = st.builds(
    lambda steps, calls, tokens, parallel, retries, final: Budget(
        max_model_steps=steps, max_tool_calls=calls, max_input_tokens=tokens,
        max_parallel=parallel, malformed_retries=retries, reserve_final_step=final),
    st.integers(1, 6), st.integers(0, 6), st.one_of(st.none(), st.integers(1, 400)),
    st.one_of(st.none(), st.integers(1, 2)), st.one_of(st.none(), st.integers(0, 2)),
    st.booleans())


class Script:
    """Answers effects from drawn lists; records every event appended, in order."""

    def __init__(self, replies: list[Any], outcomes: list[str], approvals: list[bool],
                 estimate: int) -> None:
        self.replies, self.outcomes, self.approvals = replies, outcomes, approvals
        self.estimate = estimate
        self.appended: list[ev.Event] = []
        self.mono = 100.0

    def now(self) -> Instant:
        self.mono += 0.25
        return Instant(1_700_000_000.0 + self.mono, self.mono)

    def answer(self, m: Machine, effect: fx.Effect) -> fact.Input:
        match effect:
            case fx.Commit():
                self.appended += outbox(m)
                return fact.Committed()
            case fx.Estimate():
                return fact.Estimated(Usage(input_tokens=self.estimate))
            case fx.InvokeModel():
                r = self.replies.pop(0) if self.replies else Final(text="done")
                if r == "raises":
                    return fact.ModelReplied(error="RuntimeError: boom")
                if r == "malformed":
                    return fact.ModelReplied(response={"kind": "what"})
                return fact.ModelReplied(response=r)
            case fx.CheckCalls():
                batch = m.batch
                assert batch is not None
                return fact.CallsChecked([None] * len(batch.calls),
                                         [c.arguments for c in batch.calls],
                                         [None] * len(batch.calls))
            case fx.AskApproval():
                return fact.ApprovalsRuled([self.approvals.pop(0) if self.approvals else False
                                            for _ in effect.indexes])
            case fx.StartCalls():
                return fact.AttemptsEnded([self.ended(m, c) for c in effect.calls])
            case fx.Validate():
                return fact.Validated([None] * len(effect.execution_ids))
            case fx.Reconcile():
                return fact.Reconciled(False)
        raise AssertionError(f"unexpected effect {effect!r}")

    def ended(self, m: Machine, c: fx.CallStart) -> fact.Ended:
        kind = self.outcomes.pop(0) if self.outcomes else "ok"
        if kind == "skipped":
            return fact.Ended(c.execution_id, skipped="deadline")
        if not c.recorded:
            # As the executor does: a queued call's dispatch is durable before it starts.
            self.feed(m, fact.AttemptStarting(c.execution_id, 1, []))
        fields = {"content": "r", "size": 3, "digest": "d"}
        att = {"ok": Attempt(1, "ok", fields, latency_s=0.1),
               "error": Attempt(1, "error", error="it failed", category="ValueError"),
               "timeout": Attempt(1, "timeout", timeout_s=1.0, error="timed out")}[kind]
        return fact.Ended(c.execution_id, [att])

    def feed(self, m: Machine, inp: fact.Input) -> fx.Step:
        step = decide(m, inp, self.now())
        for event in step.events:
            apply(m.state, event)  # raises ReplayError on an illegal event: a finding
            m.pending.append(event)
        if isinstance(inp, fact.AttemptStarting):
            self.appended += outbox(m)
        return step


def machine(budget: Budget, permit: bool = False, state: RunState | None = None,
            tools: dict[str, ToolFacts] | None = None) -> Machine:
    config = Config(run_id=RID, budget=budget, tools=tools or TOOLS, history=[],
                    permit=permit)
    return Machine(config=config, state=state or RunState(), resumed=state is not None,
                   current=budget, started=100.0)


def drive(m: Machine, script: Script, limit: int = 400) -> tuple[Any, list[fx.Step]]:
    steps, inp = [], fact.Tick()
    for _ in range(limit):
        step = script.feed(m, inp)
        steps.append(step)
        # Counters stay within the budget at every point (SPEC 5).
        assert m.state.model_steps <= m.config.budget.max_model_steps
        assert m.state.tool_calls <= m.config.budget.max_tool_calls
        if not step.effects:
            inp = fact.Tick()
            continue
        effect = step.effects[0]
        if isinstance(effect, fx.Finish):
            return effect.result, steps
        inp = script.answer(m, effect)
    raise AssertionError("the run did not end")


@settings(max_examples=300, deadline=None)
@given(budgets, st.lists(reply, max_size=8), st.lists(outcome, max_size=12),
       st.lists(st.booleans(), max_size=4), st.integers(0, 120))
def test_random_runs_keep_the_rules(budget: Budget, replies: list[Any], outcomes: list[str],
                                    approvals: list[bool], estimate: int) -> None:
    m = machine(budget)
    script = Script(list(replies), outcomes, approvals, estimate)
    result, _ = drive(m, script)
    events = script.appended
    assert result.status in RUN_STATUSES
    assert isinstance(events[0], ev.RunAdmitted)
    assert isinstance(events[-1], ev.OwnerClaimed | ev.RunFinished)
    finished = [e for e in events if isinstance(e, ev.RunFinished)]
    assert len(finished) == 1 and finished[0].status == result.status
    # Every CallDispatched follows its CallDecided, as an allowed call's.
    decided: dict[str, ev.CallDecided] = {}
    for e in events:
        if isinstance(e, ev.CallDecided):
            decided[e.execution_id] = e
        elif isinstance(e, ev.CallDispatched):
            assert e.execution_id in decided
            assert decided[e.execution_id].decision == "allow"
            assert not decided[e.execution_id].approval or m.state.calls[e.execution_id].approved
    # The live state is the replayed one: the same fold over the same events.
    again = replay(events)
    assert (again.status, again.model_steps, again.tool_calls, again.usage) == \
        (m.state.status, m.state.model_steps, m.state.tool_calls, m.state.usage)
    assert result.model_steps == m.state.model_steps
    assert result.tool_calls == m.state.tool_calls


@settings(max_examples=200, deadline=None)
@given(budgets, st.lists(reply, max_size=5), st.text(max_size=8))
def test_a_final_reply_is_accepted_before_any_batch_check(budget: Budget, replies: list[Any],
                                                          text: str) -> None:
    """SPEC 5.7: a final response ends the run ``final`` even on the last step, with tools
    spent or the step reserved for a final answer; only a model step it never got stops it."""
    m = machine(budget)
    script = Script([*replies, Final(text=text)], [], [], 0)
    result, _ = drive(m, script)
    invoked = [e for e in script.appended if isinstance(e, ev.ModelStepStarted)]
    if len(invoked) == len(replies) + 1:
        # The Final was given (maybe on a final-only step, or with tools spent): accepted.
        assert result.status == "final"
        assert result.transcript[-1].text == text
    first = machine(budget)
    alone, _ = drive(first, Script([Final(text=text)], [], [], 0))
    assert alone.status == "final" and alone.model_steps == 1


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 4), st.lists(call, min_size=1, max_size=3))
def test_calls_over_the_tool_budget_dispatch_nothing(calls_left: int,
                                                     calls: list[ToolCall]) -> None:
    """SPEC 5.8: a batch that would go over max_tool_calls is refused whole."""
    budget = Budget(max_model_steps=3, max_tool_calls=calls_left)
    unique = list({c.id: c for c in calls}.values())
    m = machine(budget)
    script = Script([CallTools(calls=unique)], [], [], 0)
    result, _ = drive(m, script)
    if len(unique) > calls_left:
        assert result.status == "limit_exceeded" and result.exhausted_limit == "tool_calls"
        assert not any(isinstance(e, ev.CallDecided) for e in script.appended)


def test_a_run_that_ends_returns_finish_and_takes_no_more_input() -> None:
    m = machine(Budget(max_model_steps=2))
    result, steps = drive(m, Script([Final(text="hi")], [], [], 1))
    assert result.status == "final" and m.stage == "done"
    assert isinstance(steps[-1].effects[0], fx.Finish)
    with pytest.raises(Unexpected):
        decide(m, fact.Tick(), Instant(0.0, 200.0))


def test_effects_are_plain_data() -> None:
    """Effects name no callable: each round-trips through msgpack as data."""
    m = machine(Budget(max_model_steps=3, max_tool_calls=2))
    script = Script([CallTools(calls=[ToolCall(id="a", name="add", arguments={"x": 1})])],
                    ["ok"], [], 5)
    _, steps = drive(m, script)
    for step in steps:
        for effect in step.effects:
            if not isinstance(effect, fx.Finish):
                assert msgspec.msgpack.decode(msgspec.msgpack.encode(effect),
                                              type=type(effect)) == effect


def test_the_decider_reads_the_clock_it_is_given() -> None:
    """No clock read of its own: two machines fed the same inputs and instants produce the
    same events."""
    def run() -> list[ev.Event]:
        m = machine(Budget(max_model_steps=3, max_tool_calls=2))
        script = Script([CallTools(calls=[ToolCall(id="a", name="add", arguments={"x": 1})]),
                         Final(text="ok")], ["ok"], [], 5)
        drive(m, script)
        return script.appended

    assert run() == run()


# -- rule 1 (DESIGN): what decides lives in core/ ------------------------------------------
def _compared_literals(path: Any) -> list[tuple[int, str]]:
    import ast

    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Compare):
            for part in [node.left, *node.comparators]:
                values = part.elts if isinstance(part, ast.Tuple | ast.List | ast.Set) \
                    else [part]
                found += [(node.lineno, v.value) for v in values
                          if isinstance(v, ast.Constant) and isinstance(v.value, str)]
        elif isinstance(node, ast.MatchValue) and isinstance(node.value, ast.Constant) \
                and isinstance(node.value.value, str):
            found.append((node.lineno, node.value.value))
    return found


def test_the_interpreter_and_the_supervisor_compare_no_status_or_decision() -> None:
    """The run's interpreter and its supervisor perform what ``core.decide`` decided: a
    status, decision or stage literal compared there would be a decision made outside it."""
    from pathlib import Path
    from typing import get_args

    import boundloop
    from boundloop.core.kinds import DECISIONS
    from boundloop.core.state import Stage

    vocabulary = set(RUN_STATUSES) | set(DECISIONS) | set(get_args(Stage)) | {"running"}
    root = Path(boundloop.__file__).parent
    for name in ("loop.py", "_run.py", "_journal_form.py", "actors/supervisor.py"):
        bad = [(line, value) for line, value in _compared_literals(root / name)
               if value in vocabulary]
        assert not bad, f"{name} compares run vocabulary (decide it in core/): {bad}"


def test_the_literal_finder_finds_comparisons(tmp_path: Any) -> None:
    source = tmp_path / "m.py"
    source.write_text('x = 1\nif s == "final" or s in ("allow", "deny"):\n    pass\n')
    assert _compared_literals(source) == [(2, "final"), (2, "allow"), (2, "deny")]


def test_core_imports_nothing_that_does_io_threads_or_time() -> None:
    """core/ is pure (DESIGN rule 3): it imports no I/O, thread, clock or randomness module,
    and of boundloop only data modules and the pure text helpers."""
    import ast
    from pathlib import Path

    import boundloop

    allowed_stdlib = {"__future__", "collections", "typing", "hashlib", "json", "math",
                      "sys"}
    allowed_own = ("boundloop.core", "boundloop.events", "boundloop.messages",
                   "boundloop.results", "boundloop.errors", "boundloop.policy.redact",
                   "boundloop.policy.safe_text")
    core = Path(boundloop.__file__).parent / "core"
    for path in sorted(core.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            if isinstance(node, ast.ImportFrom) and node.module == "boundloop":
                names = [f"boundloop.{a.name}" for a in node.names]  # from boundloop import x
            for name in names:
                own = name.startswith("boundloop")
                ok = name.startswith(allowed_own) if own else \
                    name.split(".")[0] in allowed_stdlib | {"msgspec"}
                assert ok, f"core/{path.name} imports {name}"


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 3), st.lists(st.tuples(st.booleans(), st.integers(1, 4),
                                             st.sampled_from([0.0, 0.5, 30.0]),
                                             st.sampled_from([None, "cancelled", "lease"])),
                                   max_size=6))
def test_retries_are_decided_by_the_run(allowance: int, failures: list[Any]) -> None:
    """SPEC 6: a failed attempt is tried again only when it is retryable, attempts and the
    batch's call budget are left, nothing stops dispatch and the delay ends before the
    deadline; each retry spends one of the allowance."""
    m = machine(Budget(max_model_steps=2, max_tool_calls=5))
    m.allowance, m.deadline, m.stage = allowance, 110.0, "dispatch"  # its calls run
    left = allowance
    for retryable, made, delay, gate in failures:
        step = decide(m, fact.AttemptFailed("run-1:1:0", retryable, 3, made, delay, gate),
                      Instant(0.0, 100.0))
        expected = retryable and left > 0 and made < 3 and gate is None and 100.0 + delay < 110.0
        assert bool(step.effects) == expected and not step.events
        if expected:
            assert step.effects == [fx.Retry("run-1:1:0", delay)]
            left -= 1
        assert m.allowance == left


# -- defects found by review (issue #21) -----------------------------------------------------
def until(m: Machine, script: Script, inp: fact.Input, want: type) -> Any:
    """Drive ``m`` from ``inp`` until it asks for a ``want`` effect (returned)."""
    for _ in range(100):
        step = script.feed(m, inp)
        effect = step.effects[0] if step.effects else None
        if isinstance(effect, want):
            return effect
        assert not isinstance(effect, fx.Finish), effect
        inp = fact.Tick() if effect is None else script.answer(m, effect)
    raise AssertionError(f"no {want.__name__}")


def finish(m: Machine, script: Script, inp: fact.Input) -> Any:
    """Drive ``m`` from ``inp`` to its end: its result (the model may say Final)."""
    for _ in range(100):
        step = script.feed(m, inp)
        effect = step.effects[0] if step.effects else None
        if isinstance(effect, fx.Finish):
            return effect.result
        inp = fact.Tick() if effect is None else script.answer(m, effect)
    raise AssertionError("the run did not end")


def lost_record(m: Machine, inp: fact.AttemptStarting, now: Instant) -> None:
    """As the supervisor does when the append of an attempt's events fails."""
    for event in decide(m, inp, now).events:
        apply(m.state, event)
        m.pending.append(event)
    batch, m.pending = m.pending, []
    lose(m, batch)


def test_a_retry_whose_dispatch_cannot_be_recorded_ends_the_run_writing_nothing() -> None:
    """SPEC 6: a failure to record ends the run journal_unavailable before anything else is
    dispatched; the report counts what the journal holds."""
    m = machine(Budget(max_model_steps=4, max_tool_calls=4))
    script = Script([CallTools(calls=[ToolCall(id="c1", name="add", arguments={"x": 1})])],
                    [], [], 1)
    start = until(m, script, fact.Tick(), fx.StartCalls)
    eid = start.calls[0].execution_id
    failed = Attempt(1, "error", error="it failed", category="ValueError")
    retry = decide(m, fact.AttemptFailed(eid, True, 3, 1, 0.0, None), script.now())
    assert retry.effects == [fx.Retry(eid, 0.0)]
    lost_record(m, fact.AttemptStarting(eid, 2, [failed]), script.now())
    written = len(script.appended)
    # The executor: attempt 2 never started, as the journal failed to record it.
    result = finish(m, script, fact.AttemptsEnded([fact.Ended(eid, [failed], "journal")]))
    assert result.status == "journal_unavailable" and len(script.appended) == written
    assert script.replies == [] and m.state.model_steps == 1  # no model call after it
    assert result.tool_calls == replay(script.appended).tool_calls == 1
    assert [u.execution_id for u in result.unresolved] == [eid]


def test_a_resumed_retry_whose_dispatch_is_lost_leaves_a_journal_that_replays() -> None:
    m = machine(Budget(max_model_steps=4, max_tool_calls=4))
    script = Script([CallTools(calls=[ToolCall(id="c1", name="add", arguments={"x": 1})])],
                    [], [], 1)
    eid = until(m, script, fact.Tick(), fx.StartCalls).calls[0].execution_id
    # A crash here: dispatched, no outcome. Resume retries the idempotent call.
    again = machine(m.config.budget, state=replay(script.appended))
    start = until(again, script, fact.Tick(), fx.StartCalls)
    assert start.calls[0].first_attempt == 2
    lost_record(again, fact.AttemptStarting(eid, 2, []), script.now())
    written = len(script.appended)
    result = finish(again, script, fact.AttemptsEnded([fact.Ended(eid, [], "journal")]))
    assert result.status == "journal_unavailable" and len(script.appended) == written
    assert replay(script.appended).calls[eid].attempt == 1


def test_resume_closes_a_call_reconcile_says_did_not_take_effect_with_no_budget_left(
        ) -> None:
    """SPEC 6: reconcile said the action did not take effect; with no call left to retry
    it, the call is closed as not taken (never outcome_unknown after that) and the run
    goes on."""
    tools = {**TOOLS, "put": ToolFacts(idempotent=True, reconcile=True)}
    m = machine(Budget(max_model_steps=3, max_tool_calls=1), tools=tools)
    script = Script([CallTools(calls=[ToolCall(id="c1", name="put", arguments={"x": 1})]),
                     Final(text="done")], [], [], 1)
    eid = until(m, script, fact.Tick(), fx.StartCalls).calls[0].execution_id
    again = machine(m.config.budget, state=replay(script.appended), tools=tools)
    result = finish(again, script, fact.Tick())
    assert result.status == "final"
    journal = replay(script.appended)
    assert journal.calls[eid].status == again.state.calls[eid].status
    assert not any(isinstance(e, ev.CallOutcomeUnknown) for e in script.appended)


def test_a_permit_that_raised_gives_its_reason() -> None:
    m = machine(Budget(max_model_steps=3, max_tool_calls=2), permit=True)
    script = Script([CallTools(calls=[ToolCall(id="c1", name="add", arguments={"x": 1})])],
                    [], [], 1)
    until(m, script, fact.Tick(), fx.CheckCalls)
    script.feed(m, fact.CallsChecked([fact.PermitRaised("RuntimeError: policy db down")],
                                     [{"x": 1}], [None]))
    [decided] = [e for e in m.pending if isinstance(e, ev.CallDecided)]
    assert decided.decision == "denied"
    assert decided.reason == "the permission check raised RuntimeError: policy db down"


def test_a_refused_input_leaves_the_machine_as_it_was() -> None:
    m = machine(Budget(max_model_steps=3, max_tool_calls=2))
    script = Script([Final(text="x")], [], [], 1)
    until(m, script, fact.Tick(), fx.InvokeModel)
    m.committing = [ev.CallFailed(run_id=RID, ts=0.0, elapsed_s=0.0, execution_id="e",
                                  attempt=1, error_category="ValueError", content="x")]
    before = msgspec.msgpack.encode(m)
    for wrong in (fact.Committed("boom"), fact.AttemptFailed("e", True, 3, 1),
                  fact.AttemptStarting("e", 2, []), fact.Validated([])):
        with pytest.raises(Unexpected):
            decide(m, wrong, script.now())
        assert msgspec.msgpack.encode(m) == before


def test_a_failure_of_boundloop_records_what_attempts_did_with_the_run_finished() -> None:
    """``Failed``: the outcomes folded and not yet written are committed with the
    RunFinished (a resume would find them unknown), so its counters are the journal's."""
    m = machine(Budget(max_model_steps=3, max_tool_calls=2))
    script = Script([CallTools(calls=[ToolCall(id="c1", name="add", arguments={"x": 1})])],
                    ["ok"], [], 1)
    start = until(m, script, fact.Tick(), fx.StartCalls)
    script.feed(m, script.answer(m, start))  # the outcome is folded, not yet written
    assert any(isinstance(e, ev.CallSucceeded) for e in m.pending)
    result = finish(m, script, fact.Failed("boundloop failed"))
    assert result.status == "needs_review"
    journal = replay(script.appended)
    assert journal.status == "needs_review" and journal.tool_calls == result.tool_calls == 1
    assert any(isinstance(e, ev.CallSucceeded) for e in script.appended)


def test_a_retry_is_reserved_with_the_run_tree_and_counts_what_children_spent() -> None:
    """SPEC 8: with the run tree's ledger open, a retry is one more call of the tree: it is
    reserved with the authority first, and refused when the children's calls (folded from
    the reply) leave none; then the first attempt's outcome stands."""
    for children, granted, retried in ((1, True, True), (2, True, False),
                                       (0, False, False)):
        m = machine(Budget(max_model_steps=4, max_tool_calls=3))
        script = Script([CallTools(calls=[ToolCall(id="c1", name="add", arguments={"x": 1})])],
                        [], [], 1)
        eid = until(m, script, fact.Tick(), fx.StartCalls).calls[0].execution_id
        # A handler of this batch started a child run (the world's flag).
        step = decide(m, fact.AttemptFailed(eid, True, 3, 1, 0.0, None),
                      Instant(1_700_000_200.0, 200.0, children=True))
        assert step.effects == [fx.ChargeTree(reserve=1, reserve_tools={"add": 1})]
        spent = [ChildSpend("kid", children, Usage(), {"add": children})] if children else []
        reply = fact.RetryReserved(eid, LedgerReply(granted, spent, TreeLeft()))
        step = script.feed(m, reply)
        assert step.effects == ([fx.Retry(eid, 0.0)] if retried else [])
        assert m.state.tool_calls == 1 + children <= 3
        assert [e.tool_calls for e in step.events] == ([children] if children else [])


# -- a hostile interpreter (the review's fuzzer, as a property) ------------------------------
HOSTILE_TOOLS = {"add": ToolFacts(read_only=True, idempotent=True, reconcile=True),
                 "send": ToolFacts(irreversible=True), "idem": ToolFacts(idempotent=True),
                 "ask": ToolFacts(approval="rule"), "always": ToolFacts(approval="always")}
FIELDS = {"content": "r", "size": 1, "digest": "d"}


class World:
    """Answers every effect at random: the world's flags turn (cancel, lease, a closed
    journal), commits fail at any stage, the run tree's authority answers anything, calls
    ok, fail, time out and are retried. It keeps what was durably appended."""

    def __init__(self, r: Any, odds: dict[str, float], mono: float = 100.0) -> None:
        self.r, self.odds, self.mono = r, odds, mono
        self.cancelled = self.unleased = self.closed = False
        self.appended: list[ev.Event] = []
        self.failed = False

    def now(self) -> Instant:
        r, odds = self.r, self.odds
        self.mono += r.choice([0.0, 0.1, 1.0, 5.0])
        self.cancelled |= r.random() < odds["cancel"]
        self.unleased |= r.random() < odds["lease"]
        self.closed |= r.random() < odds["close"]
        return Instant(1e9 + self.mono, self.mono, self.cancelled,
                       "why" if self.cancelled else "", r.random() < odds["children"],
                       not self.unleased, not self.closed)

    def feed(self, m: Machine, inp: fact.Input) -> fx.Step:
        step = decide(m, inp, self.now())
        for event in step.events:
            apply(m.state, event)
            m.pending.append(event)
        budget = m.config.budget
        assert m.state.model_steps <= budget.max_model_steps
        assert m.state.tool_calls <= budget.max_tool_calls
        return step

    def commit(self, m: Machine) -> fact.Committed:
        batch = outbox(m)
        if self.closed or self.r.random() < self.odds["commit"] \
                or self.unleased and self.r.random() < 0.5:
            self.failed = True
            kind = self.r.choice(["error", "conflict", "lease"])
            return fact.Committed("boom", conflict=kind == "conflict", lease=kind == "lease")
        self.appended += batch
        return fact.Committed()

    def calls(self, m: Machine, effect: fx.StartCalls) -> fact.AttemptsEnded:
        r, out = self.r, []
        for c in effect.calls:
            attempts: list[Attempt] = []
            n, recorded, skipped = c.first_attempt, c.recorded, None
            while True:
                now = self.now()
                gate = "journal" if not now.recordable else "lease" if not now.leased else \
                    "cancelled" if now.cancelled else \
                    "deadline" if m.deadline_passed(now.mono) else None
                if gate is not None:
                    if not attempts:
                        skipped = gate
                    elif recorded:
                        attempts.append(Attempt(n, "error", category="NotStarted", error="-"))
                    break
                if not recorded:
                    self.feed(m, fact.AttemptStarting(c.execution_id, n, list(attempts)))
                    batch = list(m.pending)
                    if self.commit(m).error is not None:
                        lose(m, batch)  # as the supervisor does; the executor says so
                        skipped = "journal"
                        break
                m.committing = []
                kind = r.choice(["ok", "error", "timeout"])
                if kind == "ok":
                    attempts.append(Attempt(n, "ok", FIELDS))
                    break
                took = r.choice([None, False, True]) \
                    if kind == "timeout" and m.config.tools[c.tool].reconcile else None
                attempts.append(Attempt(n, "error", error="x", category="ValueError")
                                if kind == "error" else
                                Attempt(n, "timeout", timeout_s=1.0, error="t", reconciled=took,
                                        reconciled_value=FIELDS if took else None))
                if took is True:
                    break
                step = self.feed(m, fact.AttemptFailed(
                    c.execution_id, r.random() < 0.7, r.choice([1, 2, 3]),
                    n - c.first_attempt + 1, r.choice([0.0, 0.5]), None))
                if step.effects and isinstance(step.effects[0], fx.ChargeTree):
                    step = self.feed(m, fact.RetryReserved(c.execution_id, self.ledger()))
                if not step.effects:
                    break
                n, recorded = n + 1, False
            out.append(fact.Ended(c.execution_id, attempts, skipped))
        return fact.AttemptsEnded(out)

    def ledger(self) -> LedgerReply:
        r = self.r
        kids = [ChildSpend("kid", 0, Usage(input_tokens=r.randint(0, 5)))] \
            if r.random() < 0.3 else []
        return LedgerReply(r.random() < 0.8, kids, TreeLeft(tool_calls=r.randint(0, 6)))

    def answer(self, m: Machine, effect: fx.Effect) -> fact.Input:
        r = self.r
        match effect:
            case fx.Commit():
                return self.commit(m)
            case fx.ChargeTree():
                return fact.TreeReplied(self.ledger())
            case fx.Estimate():
                return fact.Estimated(Usage(input_tokens=r.randint(0, 40))) \
                    if r.random() < 0.9 else fact.Estimated(failed="it raised")
            case fx.InvokeModel():
                x = r.random()
                if x < 0.05:
                    return fact.ModelReplied(abandoned=r.choice(["deadline", "cancelled"]))
                if x < 0.1:
                    return fact.ModelReplied(error="boom")
                if x < 0.3:
                    return fact.ModelReplied(response=Final(text="done"))
                calls = [ToolCall(id=f"c{r.randint(0, 30)}",
                                  name=r.choice([*HOSTILE_TOOLS, "nope"]), arguments={"x": 1})
                         for _ in range(r.randint(1, 3))]
                return fact.ModelReplied(response=CallTools(
                    calls=calls, usage=Usage(input_tokens=r.randint(0, 20))))
            case fx.CheckCalls():
                n = len(effect.execution_ids)
                verdicts: list[fact.Verdict] = [None] * n
                for i in effect.permit or []:
                    verdicts[i] = r.choice([True, False, "no", fact.PermitRaised("E: x")])
                return fact.CallsChecked(verdicts, [{"x": 1}] * n,
                                         [None if r.random() < 0.9 else "bad"
                                          for _ in range(n)])
            case fx.AskApproval():
                return fact.ApprovalsRuled([r.random() < 0.5 for _ in effect.indexes])
            case fx.Validate():
                return fact.Validated([None if r.random() < 0.9 else "bad"
                                       for _ in effect.execution_ids])
            case fx.Reconcile():
                return fact.Reconciled(r.choice([None, False, True]), FIELDS)
            case fx.StartCalls():
                return self.calls(m, effect)
        raise AssertionError(f"unexpected effect {effect!r}")

    def drive(self, m: Machine) -> Any:
        inp: fact.Input = fact.Tick()
        for _ in range(600):
            step = self.feed(m, inp)
            if not step.effects:
                inp = fact.Tick()
                continue
            effect = step.effects[0]
            if isinstance(effect, fx.Finish):
                return effect.result
            if self.failed and not self.unleased:
                # A failure to record ends the run before anything else is dispatched.
                assert not isinstance(effect, fx.InvokeModel | fx.StartCalls), m.stage
            inp = self.answer(m, effect)
        raise AssertionError("the run did not end")


def hostile(r: Any, state: RunState | None = None, child: bool = False,
            mono: float = 100.0) -> Machine:
    b = state.budget if state is not None else Budget(
        max_model_steps=r.randint(1, 6), max_tool_calls=r.randint(0, 6),
        max_input_tokens=r.choice([None, 60, 200]), max_parallel=r.choice([None, 1, 2]),
        malformed_retries=r.choice([None, 0, 1]), reserve_final_step=r.random() < 0.5,
        deadline_s=r.choice([None, 3.0, 30.0]))
    config = Config(run_id=RID, budget=b, tools=HOSTILE_TOOLS, history=[],
                    permit=r.random() < 0.5, parent_run_id="p" if child else None,
                    parent_step=1 if child else None)
    left = None if b.deadline_s is None else \
        max(b.deadline_s - (state.elapsed_s if state is not None else 0.0), 0.0)
    return Machine(config=config, state=state or RunState(), resumed=state is not None,
                   current=b, started=mono, ledger_open=child and state is None,
                   deadline=None if left is None else mono + left)


ODDS = st.fixed_dictionaries({
    "cancel": st.sampled_from([0.0, 0.02]), "lease": st.sampled_from([0.0, 0.02]),
    "close": st.sampled_from([0.0, 0.01]), "children": st.sampled_from([0.0, 0.1]),
    "commit": st.sampled_from([0.0, 0.03, 0.1])})


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 2**32), ODDS, st.booleans(), st.floats(0.0, 1.0))
def test_a_hostile_interpreter_never_breaks_the_run(seed: int, odds: dict[str, float],
                                                    child: bool, cut: float) -> None:
    """Whatever the world does (flags, failed commits at any stage, tree replies, retries),
    the run takes every input its stage waits for, no counter goes over its budget, and
    the live state is the replay of what the Steps committed; a resume from any durable
    prefix settles it into a journal that replays. (A seeded Random, not hypothesis's own:
    its draws favour simple values and would rarely fail a commit.)"""
    r = random.Random(seed)
    m, world = hostile(r, child=child), World(r, odds)
    result = world.drive(m)
    if not world.appended:
        return
    journal = replay(world.appended)
    if not world.failed and result.status != "journal_unavailable":
        assert (journal.status, journal.model_steps, journal.tool_calls, journal.usage) == \
            (m.state.status, m.state.model_steps, m.state.tool_calls, m.state.usage)
    # The calls the run reports are those its journal holds (a call starts only once its
    # dispatch is durable); a model step it could not record did run, and counts.
    assert result.tool_calls == journal.tool_calls
    assert result.model_steps >= journal.model_steps
    if isinstance(world.appended[-1], ev.RunFinished | ev.OwnerClaimed):
        assert result.model_steps == journal.model_steps
    if child:
        return
    prefix = world.appended[:max(1, int(cut * len(world.appended)))]
    state = replay(prefix)
    if state.status == "queued":
        return
    again, later = hostile(r, state=state, mono=200.0), World(r, odds, mono=200.0)
    later.appended = list(prefix)
    later.drive(again)
    replay(later.appended)


def test_a_resumed_retry_that_never_starts_leaves_a_not_taken_call_closed() -> None:
    """Reconcile said the call did not take effect; its retry is skipped (cancelled) before
    any dispatch: the call stays closed as not taken (no outcome_unknown the fold refuses)."""
    tools = {**TOOLS, "put": ToolFacts(idempotent=True, reconcile=True)}
    m = machine(Budget(max_model_steps=3, max_tool_calls=3), tools=tools)
    script = Script([CallTools(calls=[ToolCall(id="c1", name="put", arguments={"x": 1})]),
                     Final(text="done")], [], [], 1)
    eid = until(m, script, fact.Tick(), fx.StartCalls).calls[0].execution_id
    again = machine(m.config.budget, state=replay(script.appended), tools=tools)
    until(again, script, fact.Tick(), fx.StartCalls)
    result = finish(again, script, fact.AttemptsEnded([fact.Ended(eid, [], "cancelled")]))
    assert result.status == "final"
    assert replay(script.appended).calls[eid].status == again.state.calls[eid].status
