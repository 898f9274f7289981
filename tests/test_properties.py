"""Property tests (hypothesis): random scripts through a real Runner, and the pure policy.

The loop tests generate random ScriptedModel scripts (finals, batches of calls with valid or
invalid arguments, unknown tools and reused ids, malformed responses, exceptions) and random
small budgets, run them on a real Runner and LMDB journal, and check the result against a
reference model written from SPEC 5 (not from the code), against the handlers' own counts,
and against a replay of the journal.
"""

from __future__ import annotations

import itertools
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import boundloop as bl
from boundloop.policy import budget as pb
from boundloop.policy import redact as pr

STATUSES = {"final", "limit_exceeded", "repeated_call", "cancelled", "malformed_response",
            "model_error", "needs_review", "journal_unavailable", "rejected"}
LIMITS = {"model_steps", "tool_calls", "deadline", "input_tokens", "output_tokens",
          "total_tokens", "cost"}
NOT_DISPATCHED = {"denied", "invalid_arguments", "unknown_tool"}

LOOP_SETTINGS = settings(max_examples=80, deadline=None, database=None,
                         suppress_health_check=[HealthCheck.too_slow])
PURE_SETTINGS = settings(max_examples=200, deadline=None, database=None)


# == the script model ======================================================================


@dataclass(frozen=True)
class Call:
    """A generated call and the result SPEC says it gets once dispatched/decided."""

    id: str
    name: str
    arguments: dict[str, Any]
    expect: str  # ok | error | invalid_arguments | unknown_tool
    content: Any = None  # the ok result


@dataclass(frozen=True)
class Item:
    """One script entry: ``final``, ``calls``, ``malformed`` or ``raise``."""

    kind: str
    calls: tuple[Call, ...] = ()
    form: str = "struct"  # struct | dict | mutating (a callable that mutates its history)
    malformed: Any = None


def _as_response(item: Item) -> Any:
    if item.kind == "final":
        return bl.Final("done") if item.form == "struct" else {"kind": "final", "text": "done"}
    calls = [bl.ToolCall(c.id, c.name, dict(c.arguments)) for c in item.calls]
    if item.form == "struct":
        return bl.CallTools(calls)
    return {"kind": "calls", "calls": [msgspec.to_builtins(c) for c in calls]}


def script_of(items: list[Item]) -> list[Any]:
    out: list[Any] = []
    for item in items:
        if item.kind == "raise":
            out.append(RuntimeError("the model is down"))
        elif item.kind == "malformed":
            out.append(item.malformed)
        elif item.form == "mutating":
            out.append(_mutating(_as_response(Item(item.kind, item.calls, "dict"))))
        else:
            out.append(_as_response(item))
    return out


def _mutating(response: Any) -> Callable[[list[Any], Any], Any]:
    """A model step that vandalises the history it was given, then answers (SPEC 2: the
    callback's copy is its own)."""

    def step(history: list[Any], ctx: Any) -> Any:
        for m in history:
            if getattr(m, "kind", None) == "call":
                m.arguments.clear()
                m.arguments["vandal"] = True
        history.append(bl.UserMessage("injected"))
        history.reverse()
        return response

    return step


text = st.text(alphabet="abcxyz ", max_size=6)
small_int = st.integers(-50, 50)


@st.composite
def calls(draw: st.DrawFn) -> Call:
    cid = "placeholder"  # scripts() names the calls
    name = draw(st.sampled_from(["add", "echo", "boom", "nope"]))
    valid = draw(st.booleans())
    if name == "add":
        if valid:
            a, b = draw(small_int), draw(small_int)
            return Call(cid, name, {"a": a, "b": b}, "ok", a + b)
        bad = draw(st.sampled_from([{"a": "x", "b": 1}, {"a": 1}, {"a": [1], "b": 2}, {}]))
        return Call(cid, name, bad, "invalid_arguments")
    if name == "echo":
        if valid:
            t = draw(text)
            return Call(cid, name, {"text": t}, "ok", t)
        bad = draw(st.sampled_from([{"text": 5}, {}, {"text": None}]))
        return Call(cid, name, bad, "invalid_arguments")
    if name == "boom":
        if valid:
            return Call(cid, name, {"x": draw(small_int)}, "error")
        return Call(cid, name, {"x": "y"}, "invalid_arguments")
    return Call(cid, draw(st.sampled_from(["nope", "Add", "ech0"])), {"q": 1}, "unknown_tool")


MALFORMED = [
    {"kind": "bogus", "text": "x"},
    {"kind": "calls", "calls": []},
    {"kind": "calls", "calls": [{"id": "m1", "name": "add", "arguments": [1, 2]}]},
    {"kind": "calls", "calls": [{"id": "m1", "name": "add"}]},
    {"kind": "final"},
    {"text": "no kind"},
    "just text",
    None,
    42,
    ["final", "done"],
    bl.CallTools([]),
]


@st.composite
def items(draw: st.DrawFn) -> Item:
    kind = draw(st.sampled_from(["final"] + ["calls"] * 6 + ["malformed", "raise"]))
    form = draw(st.sampled_from(["struct", "dict", "mutating"]))
    if kind == "calls":
        size = draw(st.sampled_from([1, 1, 1, 2, 3]))
        return Item("calls", tuple(draw(calls()) for _ in range(size)), form)
    if kind == "malformed":
        return Item("malformed", malformed=draw(st.sampled_from(MALFORMED)))
    return Item(kind, form=form)


@st.composite
def scripts(draw: st.DrawFn) -> list[Item]:
    """Items whose call ids are fresh, except that about one in seven reuses an earlier id
    (of the same batch or an earlier one)."""
    out: list[Item] = []
    used: list[str] = []
    for item in draw(st.lists(items(), min_size=1, max_size=7)):
        if item.kind == "calls":
            renamed = []
            for c in item.calls:
                if used and draw(st.integers(0, 6)) == 0:
                    cid = draw(st.sampled_from(used))
                else:
                    cid = f"c{len(used)}"
                used.append(cid)
                renamed.append(Call(cid, c.name, c.arguments, c.expect, c.content))
            item = Item("calls", tuple(renamed), item.form)
        out.append(item)
    return out


budgets = st.builds(
    bl.Budget,
    # Every value in range, weighted toward budgets that let a run go several rounds.
    max_model_steps=st.sampled_from([1, 2, 3, 4, 4, 5, 5, 5]),
    max_tool_calls=st.sampled_from([0, 1, 2, 3, 4, 4, 5, 5, 5]),
    reserve_final_step=st.booleans(),
    malformed_retries=st.integers(0, 1),
    max_parallel=st.one_of(st.none(), st.integers(1, 3)),
)


# == the reference model (SPEC 5, no tokens, no deadline, no cancellation) ==================


@dataclass
class Expected:
    status: str
    limit: str | None
    model_steps: int
    tool_calls: int
    handler_calls: int
    transcript: list[tuple[Any, ...]] = field(default_factory=list)
    tools_allowed: list[bool] = field(default_factory=list)


def reference(items_: list[Item], budget: bl.Budget) -> Expected:
    steps = calls_ = malformed = handlers = 0
    reserved: set[str] = set()
    transcript: list[tuple[Any, ...]] = [("user", "go")]
    allowed_seen: list[bool] = []

    def end(status: str, limit: str | None = None) -> Expected:
        return Expected(status, limit, steps, calls_, handlers, transcript, allowed_seen)

    while True:
        # 5.1 before the model call
        if steps == budget.max_model_steps:
            return end("limit_exceeded", "model_steps")
        # 5.2 the final-only step; tools not allowed when the call budget is spent
        final_only = budget.reserve_final_step and steps + 1 == budget.max_model_steps
        allowed = not final_only and calls_ < budget.max_tool_calls
        allowed_seen.append(allowed)
        steps += 1
        if steps > len(items_):
            return end("model_error")  # ScriptExhausted: the callback raised
        item = items_[steps - 1]
        if item.kind == "raise":  # 5.3
            return end("model_error")
        if item.kind == "malformed":  # 5.5
            malformed += 1
            if malformed <= budget.malformed_retries:
                transcript.append(("notice",))
                continue
            return end("malformed_response")
        if item.kind == "final":  # 5.7
            transcript.append(("final", "done"))
            return end("final")
        batch = item.calls  # 5.8, in order
        if not allowed:
            return end("limit_exceeded", "model_steps" if final_only else "tool_calls")
        ids = [c.id for c in batch]
        if len(set(ids)) != len(ids) or reserved & set(ids):
            return end("repeated_call")
        if calls_ + len(batch) > budget.max_tool_calls:
            return end("limit_exceeded", "tool_calls")
        # 5.9-5.11
        reserved |= set(ids)
        calls_ += len(batch)
        for c in batch:
            if c.expect in ("ok", "error"):
                handlers += 1
            transcript.append(("call", c.id, c.name, c.arguments))
            transcript.append(("tool_result", c.id, c.expect)
                              + ((c.content,) if c.expect == "ok" else ()))


def shape(transcript: list[bl.Message]) -> list[tuple[Any, ...]]:
    """The transcript in the reference model's terms (notice and error texts left out)."""
    out: list[tuple[Any, ...]] = []
    for m in transcript:
        match m:
            case bl.UserMessage():
                out.append(("user", m.text))
            case bl.NoticeMessage():
                out.append(("notice",))
            case bl.FinalMessage():
                out.append(("final", m.text))
            case bl.CallMessage():
                out.append(("call", m.id, m.name, m.arguments))
            case bl.ToolResultMessage():
                out.append(("tool_result", m.id, m.status)
                           + ((m.content,) if m.status == "ok" else ()))
    return out


# == running a script ======================================================================


class Counting:
    """The test's tools, counting every handler invocation (thread-safe)."""

    def __init__(self) -> None:
        self.invocations = 0
        self._lock = threading.Lock()

        def bump() -> None:
            with self._lock:
                self.invocations += 1

        @bl.tool(read_only=True, idempotent=True)
        def add(a: int, b: int) -> int:
            bump()
            return a + b

        @bl.tool(read_only=True)
        def echo(text: str) -> str:
            bump()
            return text

        @bl.tool
        def boom(x: int) -> int:
            bump()
            raise RuntimeError(f"boom {x}")

        self.tools = [add, echo, boom]


@dataclass
class Outcome:
    result: bl.RunResult
    model: bl.ScriptedModel
    tools: Counting
    state: bl.RunState


def run_script(runner: bl.Runner, items_: list[Item], budget: bl.Budget) -> Outcome:
    model = bl.ScriptedModel(script_of(items_))
    tools = Counting()
    run_id = f"prop-{uuid.uuid4().hex}"
    result = runner.run(model=model, tools=tools.tools, prompt="go", budget=budget,
                        run_id=run_id)
    state = bl.replay(runner.journal.events(run_id))
    return Outcome(result, model, tools, state)


@pytest.fixture
def runner(tmp_path: Path) -> Iterator[bl.Runner]:
    with bl.Runner(tmp_path / "journal") as r:
        yield r


# == properties of the loop ================================================================


def test_counters_status_and_replay(runner: bl.Runner) -> None:
    @LOOP_SETTINGS
    @given(scripts(), budgets)
    def check(items_: list[Item], budget: bl.Budget) -> None:
        out = run_script(runner, items_, budget)
        r = out.result
        # status and limit are SPEC names
        assert r.status in STATUSES
        assert (r.exhausted_limit is None) == (r.status != "limit_exceeded")
        assert r.exhausted_limit is None or r.exhausted_limit in LIMITS
        assert r.explanation
        # model_steps: bounded, and every callback invocation counts
        assert r.model_steps <= budget.max_model_steps
        assert r.model_steps == out.model.calls
        # tool_calls: bounded, and = handler invocations + decided-but-not-dispatched calls
        not_dispatched = sum(1 for m in r.transcript if isinstance(m, bl.ToolResultMessage)
                             and m.status in NOT_DISPATCHED)
        assert r.tool_calls <= budget.max_tool_calls
        assert r.tool_calls == out.tools.invocations + not_dispatched
        # the journal's replay is the live result
        s = out.state
        assert (s.status, s.exhausted_limit, s.model_steps, s.tool_calls) == \
            (r.status, r.exhausted_limit, r.model_steps, r.tool_calls)
        assert s.transcript == r.transcript
        # nothing is left unresolved by handlers that returned or raised
        assert r.unresolved == []

    check()


def test_matches_the_reference_model_of_spec_5(runner: bl.Runner) -> None:
    @LOOP_SETTINGS
    @given(scripts(), budgets)
    def check(items_: list[Item], budget: bl.Budget) -> None:
        out = run_script(runner, items_, budget)
        r = out.result
        want = reference(items_, budget)
        event(f"status={want.status} limit={want.limit}")
        assert (r.status, r.exhausted_limit) == (want.status, want.limit)
        assert (r.model_steps, r.tool_calls) == (want.model_steps, want.tool_calls)
        assert out.tools.invocations == want.handler_calls
        assert shape(r.transcript) == want.transcript
        assert [c.tools_allowed for c in out.model.contexts] == want.tools_allowed
        assert [c.step for c in out.model.contexts] == list(range(1, r.model_steps + 1))

    check()


def test_transcript_pairs_calls_with_their_results(runner: bl.Runner) -> None:
    @LOOP_SETTINGS
    @given(scripts(), budgets)
    def check(items_: list[Item], budget: bl.Budget) -> None:
        out = run_script(runner, items_, budget)
        for transcript in (out.result.transcript, out.state.transcript):
            i = 0
            while i < len(transcript):
                m = transcript[i]
                if isinstance(m, bl.CallMessage):
                    assert i + 1 < len(transcript), "a call without its result"
                    nxt = transcript[i + 1]
                    assert isinstance(nxt, bl.ToolResultMessage)
                    assert nxt.id == m.id
                    i += 2
                    continue
                assert not isinstance(m, bl.ToolResultMessage), "a result without its call"
                i += 1
            ids = [m.id for m in transcript if isinstance(m, bl.CallMessage)]
            assert len(ids) == len(set(ids)), "a call id entered the transcript twice"
            finals = [k for k, m in enumerate(transcript) if isinstance(m, bl.FinalMessage)]
            assert finals in ([], [len(transcript) - 1])
            assert (finals != []) == (out.result.status == "final")

    check()


@st.composite
def spend_then_final(draw: st.DrawFn) -> tuple[list[Item], bl.Budget]:
    """Batches that spend max_tool_calls exactly, then a Final, with a step to spare."""
    reserve = draw(st.booleans())
    max_calls = draw(st.integers(1, 5))
    sizes: list[int] = []
    left = max_calls
    while left:
        n = draw(st.integers(1, min(3, left)))
        sizes.append(n)
        left -= n
    # The calls' steps, then the final's step; reserve_final_step keeps one more for it.
    steps = len(sizes) + 1 + draw(st.integers(0, 2))
    ids = iter(f"k{i}" for i in itertools.count())
    items_ = [Item("calls", tuple(Call(next(ids), "add", {"a": 1, "b": k}, "ok", 1 + k)
                                  for k in range(n)), draw(st.sampled_from(["struct", "dict"])))
              for n in sizes]
    items_.append(Item("final", form=draw(st.sampled_from(["struct", "dict"]))))
    budget = bl.Budget(max_model_steps=steps, max_tool_calls=max_calls,
                       reserve_final_step=reserve)
    return items_, budget


def test_final_after_the_last_permitted_call_is_accepted(runner: bl.Runner) -> None:
    @LOOP_SETTINGS
    @given(spend_then_final())
    def check(case: tuple[list[Item], bl.Budget]) -> None:
        items_, budget = case
        out = run_script(runner, items_, budget)
        r = out.result
        assert (r.status, r.exhausted_limit) == ("final", None), r.explanation
        assert r.tool_calls == budget.max_tool_calls
        assert r.model_steps == len(items_)
        assert out.tools.invocations == budget.max_tool_calls
        assert isinstance(r.transcript[-1], bl.FinalMessage)
        # The step after the last call is told tools are no longer allowed.
        assert out.model.contexts[-1].tools_allowed is False

    check()


# == pure policy: budget arithmetic ========================================================

tokens = st.integers(0, 10**9)
costs = st.one_of(st.none(), st.floats(0, 1e6, allow_nan=False, allow_infinity=False))
usages = st.builds(bl.Usage, input_tokens=tokens, output_tokens=tokens,
                   cache_write_tokens=tokens, cache_read_tokens=tokens, cost=costs)
INT_FIELDS = ("input_tokens", "output_tokens", "cache_write_tokens", "cache_read_tokens")


def ints(u: bl.Usage) -> tuple[int, ...]:
    return tuple(getattr(u, f) for f in INT_FIELDS)


@PURE_SETTINGS
@given(usages, usages, usages)
def test_usage_addition(a: bl.Usage, b: bl.Usage, c: bl.Usage) -> None:
    s = a + b
    assert ints(s) == tuple(x + y for x, y in zip(ints(a), ints(b), strict=True))
    assert ints(a + b) == ints(b + a)
    assert ints((a + b) + c) == ints(a + (b + c))
    assert a + bl.Usage() == a and bl.Usage() + a == a
    if a.cost is None and b.cost is None:
        assert s.cost is None
    else:
        assert s.cost == pytest.approx((a.cost or 0.0) + (b.cost or 0.0))
    assert s.all_input_tokens == a.all_input_tokens + b.all_input_tokens
    assert s.total_tokens == a.total_tokens + b.total_tokens


@PURE_SETTINGS
@given(usages, usages)
def test_usage_subtraction(a: bl.Usage, b: bl.Usage) -> None:
    d = a - b
    assert ints(d) == tuple(max(0, x - y) for x, y in zip(ints(a), ints(b), strict=True))
    assert all(v >= 0 for v in ints(d))
    assert d.cost is None or d.cost >= 0
    assert ints((a + b) - b) == ints(a)
    assert ints(a - a) == (0, 0, 0, 0)
    if a.cost is not None or b.cost is not None:
        assert ((a + b) - b).cost == pytest.approx(a.cost or 0.0, rel=1e-9, abs=1e-6)


@PURE_SETTINGS
@given(usages)
def test_usage_totals(u: bl.Usage) -> None:
    # SPEC 7: all input is input + cache writes + cache reads; total adds output.
    assert u.all_input_tokens == u.input_tokens + u.cache_write_tokens + u.cache_read_tokens
    assert u.total_tokens == u.all_input_tokens + u.output_tokens


limits = st.one_of(st.none(), st.integers(0, 1000))
small = st.integers(0, 600)


@PURE_SETTINGS
@given(limits, limits, limits, st.one_of(st.none(), st.floats(0, 10)),
       small, small, small, small, st.one_of(st.none(), st.floats(0, 20)))
def test_exceeded(max_in: int | None, max_out: int | None, max_total: int | None,
                  max_cost: float | None, i: int, o: int, cw: int, cr: int,
                  cost: float | None) -> None:
    budget = bl.Budget(max_input_tokens=max_in, max_output_tokens=max_out,
                       max_total_tokens=max_total, max_cost=max_cost)
    usage = bl.Usage(i, o, cw, cr, cost)
    all_in = i + cw + cr
    over = {
        "input_tokens": max_in is not None and all_in > max_in,
        "output_tokens": max_out is not None and o > max_out,
        "total_tokens": max_total is not None and all_in + o > max_total,
        "cost": max_cost is not None and (cost or 0.0) > max_cost,
    }
    got = pb.exceeded(budget, usage)
    if any(over.values()):
        assert got is not None and over[got], (got, over)
    else:
        assert got is None
    # Reaching a limit exactly is not exceeding it ("above a limit", SPEC 5.1).
    exact = bl.Budget(max_input_tokens=all_in, max_output_tokens=o, max_total_tokens=all_in + o,
                      max_cost=cost)
    assert pb.exceeded(exact, usage) is None


remainings = st.builds(
    bl.Remaining,
    model_steps=st.integers(0, 10), tool_calls=st.integers(0, 30),
    deadline_s=st.one_of(st.none(), st.floats(0, 100)),
    input_tokens=limits, output_tokens=limits, total_tokens=limits,
    cost=st.one_of(st.none(), st.floats(0, 10)))
asked_budgets = st.builds(
    bl.Budget,
    max_model_steps=st.integers(1, 10), max_tool_calls=st.integers(0, 30),
    max_parallel=st.one_of(st.none(), st.integers(1, 8)),
    deadline_s=st.one_of(st.none(), st.floats(0.001, 100)),
    max_input_tokens=limits, max_output_tokens=limits, max_total_tokens=limits,
    max_cost=st.one_of(st.none(), st.floats(0, 10)),
    max_result_bytes=st.one_of(st.none(), st.integers(0, 10_000)),
    reserve_final_step=st.booleans(), malformed_retries=st.integers(0, 3))

SHARED = [("max_tool_calls", "tool_calls"), ("max_input_tokens", "input_tokens"),
          ("max_output_tokens", "output_tokens"), ("max_total_tokens", "total_tokens"),
          ("max_cost", "cost"), ("deadline_s", "deadline_s")]


@PURE_SETTINGS
@given(remainings, asked_budgets)
def test_carve_never_grants_more_than_the_parent_has(parent: bl.Remaining,
                                                     asked: bl.Budget) -> None:
    child = pb.carve(parent, asked)
    for limit, left in SHARED:
        mine, theirs, want = getattr(child, limit), getattr(parent, left), getattr(asked, limit)
        if theirs is not None:
            # Never a fresh allowance: bounded whenever the parent is bounded. A spent deadline
            # is kept just above 0, since a Budget's deadline_s must be above 0.
            assert mine is not None, limit
            bound = max(theirs, 1e-6) if limit == "deadline_s" else theirs
            assert mine <= bound, (limit, mine, theirs)
        if want is not None:
            assert mine is not None and mine <= want, (limit, mine, want)
        if theirs is not None and want is not None and limit != "deadline_s":
            assert mine == min(theirs, want)
        if theirs is None and want is None:
            assert mine is None
    # What is not shared is what the child asked for.
    for name in ("max_model_steps", "max_parallel", "max_result_bytes", "reserve_final_step",
                 "malformed_retries"):
        assert getattr(child, name) == getattr(asked, name)
    # The carved budget is a valid Budget.
    bl.Budget(**msgspec.structs.asdict(child))


# == pure policy: redaction ================================================================

NEUTRAL = ["user", "client", "refresh", "x", "new", "db", "my", "max", "limit", "query",
           "upstream", "id"]
NEAR_MISSES = ["tokens", "tokenizer", "author", "keyboard", "secretary", "keys", "monkey",
               "passage", "input"]
CREDENTIALS: list[tuple[str, ...]] = [("password",), ("token",), ("secret",),
                                      ("authorization",), ("api", "key")]


def join(words: list[str], style: str) -> str:
    match style:
        case "snake":
            return "_".join(words)
        case "upper":
            return "_".join(w.upper() for w in words)
        case "kebab":
            return "-".join(w.capitalize() for w in words)
        case "camel":
            return words[0] + "".join(w.capitalize() for w in words[1:])
        case "pascal":
            return "".join(w.capitalize() for w in words)
        case _:
            return ".".join(words)


styles = st.sampled_from(["snake", "upper", "kebab", "camel", "pascal", "dot"])


@st.composite
def credential_keys(draw: st.DrawFn) -> str:
    before = draw(st.lists(st.sampled_from(NEUTRAL), max_size=2))
    after = draw(st.lists(st.sampled_from(NEUTRAL), max_size=2))
    core = list(draw(st.sampled_from(CREDENTIALS)))
    return join(before + core + after, draw(styles))


@st.composite
def safe_keys(draw: st.DrawFn) -> str:
    words = draw(st.lists(st.sampled_from(NEUTRAL + NEAR_MISSES), min_size=1, max_size=3))
    return join(words, draw(styles))


secrets_ = st.text(alphabet="ABCDEFGHJKLMNPQRSTUVWXYZ0123456789", min_size=12, max_size=24)
keys32 = st.binary(min_size=32, max_size=32)


def test_named_keys() -> None:
    for key in ("max_tokens", "maxTokens", "MAX_TOKENS", "tokenizer", "author", "keyboard"):
        assert not pr.is_credential(key), key
    for key in ("api_key", "X-Api-Key", "accessToken", "password", "apiKey", "APIKey",
                "Authorization", "client_secret", "refresh_token", "DB_PASSWORD"):
        assert pr.is_credential(key), key
    k = b"k" * 32
    value = {"max_tokens": 100, "api_key": "sk-123", "headers": {"X-Api-Key": "abc",
             "accept": "json"}, "accessToken": "t0k", "password": "hunter2"}
    red, changed = pr.redact(value, k)
    assert changed
    assert red["max_tokens"] == 100 and red["headers"]["accept"] == "json"
    for got, clear in ((red["api_key"], "sk-123"), (red["headers"]["X-Api-Key"], "abc"),
                       (red["accessToken"], "t0k"), (red["password"], "hunter2")):
        assert got == pr.digest(k, clear) and got.startswith("hmac-sha256:")


@PURE_SETTINGS
@given(credential_keys(), secrets_, keys32, st.lists(st.integers(0, 3), max_size=3))
def test_credential_keys_are_redacted_at_any_depth(key: str, secret: str, journal_key: bytes,
                                                   path: list[int]) -> None:
    assert pr.is_credential(key), key
    value: Any = {key: secret, "max_tokens": 7}
    for n in path:  # bury it under dicts and lists
        value = {"wrap": value, "n": n} if n % 2 else [n, value]
    original = msgspec.json.encode(value)
    red, changed = pr.redact(value, journal_key)
    assert changed
    assert msgspec.json.encode(value) == original, "redact changed its input"
    flat = msgspec.json.encode(red).decode()
    assert secret not in flat
    assert pr.digest(journal_key, secret) in flat
    assert '"max_tokens":7' in flat


@PURE_SETTINGS
@given(safe_keys(), secrets_, keys32)
def test_other_keys_are_kept(key: str, value: str, journal_key: bytes) -> None:
    assert not pr.is_credential(key), key
    red, changed = pr.redact({key: value, "nested": [{key: value}]}, journal_key)
    assert not changed
    assert red == {key: value, "nested": [{key: value}]}


@PURE_SETTINGS
@given(secrets_, keys32)
def test_sensitive_fields_are_redacted_too(value: str, journal_key: bytes) -> None:
    # A field a tool marks sensitive is redacted whatever its name, at any depth.
    red, changed = pr.redact({"card": value, "note": "x", "more": [{"card": value}]},
                             journal_key, sensitive={"card"})
    digest = pr.digest(journal_key, value)
    assert changed and red == {"card": digest, "note": "x", "more": [{"card": digest}]}


json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.text(max_size=10)),
    lambda inner: st.one_of(st.lists(inner, max_size=3),
                            st.dictionaries(st.text(max_size=5), inner, max_size=3)),
    max_leaves=8)


@PURE_SETTINGS
@given(json_values, json_values, keys32, keys32)
def test_digest_is_stable_and_keyed(a: Any, b: Any, k1: bytes, k2: bytes) -> None:
    d = pr.digest(k1, a)
    assert d == pr.digest(k1, a)
    assert d.startswith(pr.PREFIX) and len(d) == len(pr.PREFIX) + 64
    if k1 != k2:
        assert pr.digest(k2, a) != d
    if msgspec.json.encode(a) != msgspec.json.encode(b):
        assert pr.digest(k1, b) != d
