"""Hostile or careless input on the way to the journal (SPEC 1, 2, 4, 5, 6, 9).

Nothing a model, a tool or a caller hands the runner may raise out of ``run()`` or leave a
run open: values nested deeper than ``redact.MAX_DEPTH`` (64) levels or holding themselves,
objects whose ``__repr__``/``__str__`` raise, integers beyond 64 bits, lone surrogates,
limits no journal or timer can take. Each is refused where it enters: ``ConfigError`` at
the call (run ids, ``history=``, budgets, tools), ``invalid_arguments`` for the call whose
arguments cannot be kept, an ``error`` result for a result that cannot be recorded.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from loop_helpers import journal_of

import boundloop as bl
from boundloop import events as ev
from boundloop.core.budget import MAX_SECONDS, MAX_WHOLE
from boundloop.policy import redact as pr
from boundloop.policy.safe_text import MAX_TEXT, describe_exception

DEPTH = pr.MAX_DEPTH


# -- helpers -------------------------------------------------------------------------------
@pytest.fixture
def runner(tmp_path: Path) -> Iterator[bl.Runner]:
    with bl.Runner(tmp_path / "j") as r:
        yield r


def nest(levels: int) -> dict[str, Any]:
    """A dict with ``levels`` levels of dicts (the outermost is level 1)."""
    value: dict[str, Any] = {"leaf": 1}
    for _ in range(levels - 1):
        value = {"a": value}
    return value


def cyclic_dict() -> dict[str, Any]:
    d: dict[str, Any] = {"x": 1}
    d["self"] = d
    return d


def cyclic_list() -> list[Any]:
    lst: list[Any] = [1]
    lst.append(lst)
    return lst


class BadRepr:
    def __repr__(self) -> str:
        raise RuntimeError("no repr for you")


class BadStr(Exception):
    def __str__(self) -> str:
        raise RuntimeError("no str for you")


class NotAStr(Exception):
    def __str__(self) -> Any:
        return 42


def results(result: bl.RunResult) -> list[tuple[str, Any]]:
    return [(m.status, m.content) for m in result.transcript if m.kind == "tool_result"]


def still_serves(runner: bl.Runner) -> None:
    done = runner.run(model=bl.ScriptedModel([bl.Final("ok")]), prompt="p")
    assert done.status == "final"


def nothing_journaled(runner: bl.Runner) -> None:
    assert list(runner.journal.runs()) == []


def call_model(arguments: Any, *, as_dict: bool, name: str = "probe") -> bl.ScriptedModel:
    call: Any = {"id": "c1", "name": name, "arguments": arguments} if as_dict else \
        bl.ToolCall("c1", name, arguments)
    first: Any = {"kind": "calls", "calls": [call]} if as_dict else bl.CallTools([call])
    return bl.ScriptedModel([first, bl.Final("done")])


# -- 1. tool arguments nested too deep, or holding themselves ------------------------------
@pytest.mark.parametrize("as_dict", [False, True], ids=["structs", "dicts"])
@pytest.mark.parametrize(("make", "why"), [
    (lambda: {"a": nest(1000)}, f"nested deeper than {DEPTH} levels"),
    (lambda: {"a": nest(DEPTH)}, f"nested deeper than {DEPTH} levels"),  # 65 levels
    (lambda: {"a": [[[[nest(DEPTH - 4)]]]]}, f"nested deeper than {DEPTH} levels"),
    (cyclic_dict, "contain themselves"),
    (lambda: {"a": cyclic_list()}, "contain themselves"),
], ids=["1000-deep", "65-deep", "65-deep-lists", "cyclic-dict", "cyclic-list"])
def test_arguments_that_cannot_be_kept_make_the_call_invalid_arguments(
        runner: bl.Runner, make: Any, why: str, as_dict: bool) -> None:
    ran: list[Any] = []

    @bl.tool
    def probe(a: Any = None, x: Any = None, self: Any = None) -> str:
        ran.append(a)
        return "ran"

    result = runner.run(model=call_model(make(), as_dict=as_dict), tools=[probe], prompt="p")

    assert (result.status, result.model_steps, result.tool_calls) == ("final", 2, 1)
    assert ran == []
    [(status, content)] = results(result)
    assert status == "invalid_arguments"
    assert why in content and "probe" in content
    names, events = journal_of(runner, result)  # RunFinished, replay == result
    decided = next(e for e in events if isinstance(e, ev.CallDecided))
    assert decided.decision == "invalid_arguments"
    assert list(decided.arguments) == [pr.ARGUMENTS_NOT_KEPT]
    still_serves(runner)


def test_arguments_64_levels_deep_are_kept(runner: bl.Runner) -> None:
    got: list[Any] = []

    @bl.tool
    def probe(a: Any = None) -> str:
        got.append(a)
        return "ran"

    arguments = {"a": nest(DEPTH - 1)}  # the arguments dict is level 1: 64 in all
    assert pr.shape_problem(arguments) is None
    result = runner.run(model=call_model(arguments, as_dict=True), tools=[probe], prompt="p")
    assert (result.status, result.tool_calls) == ("final", 1)
    assert results(result) == [("ok", "ran")]
    assert got == [nest(DEPTH - 1)]
    journal_of(runner, result)


class Opaque:
    pass


@pytest.mark.parametrize("as_dict", [False, True], ids=["structs", "dicts"])
@pytest.mark.parametrize(("make", "words"), [
    (lambda: {"a": {(1, 2): 3}}, ("a tuple key (1, 2) at `a`", "JSON keys")),
    (lambda: {"a": [{None: 1}]}, ("key None at `a[0]`",)),
    (lambda: {"a": {True: 1}}, ("a bool key True",)),
    (lambda: {"a": Opaque()}, ("a value of type Opaque at `a`", "not JSON-like")),
    (lambda: {"a": [1, 2j]}, ("a value of type complex at `a[1]`",)),
], ids=["tuple-key", "none-key", "bool-key", "object", "complex"])
def test_arguments_json_cannot_hold_make_the_call_invalid_arguments(
        runner: bl.Runner, make: Any, words: tuple[str, ...], as_dict: bool) -> None:
    ran: list[Any] = []

    @bl.tool
    def probe(a: Any = None) -> str:
        ran.append(a)
        return "ran"

    result = runner.run(model=call_model(make(), as_dict=as_dict), tools=[probe], prompt="p")
    assert (result.status, result.model_steps, result.tool_calls) == ("final", 2, 1)
    assert ran == []
    [(status, content)] = results(result)
    assert status == "invalid_arguments"
    for word in words:
        assert word in content, content
    journal_of(runner, result)


def test_odd_but_storable_arguments_still_run(runner: bl.Runner) -> None:
    # Non-string keys below the top level, bytes, sets and long text: msgpack stores them.
    got: list[Any] = []

    @bl.tool
    def probe(a: Any = None) -> str:
        got.append(a)
        return "ran"

    arguments = {"a": {"k": {1: "one"}, "b": b"\x00\xff", "s": {1, 2}, "t": "x" * 1_000_000}}
    result = runner.run(model=call_model(arguments, as_dict=True), tools=[probe], prompt="p")
    assert (result.status, result.tool_calls) == ("final", 1)
    assert results(result) == [("ok", "ran")]
    journal_of(runner, result)


# -- 1. tool results that cannot be recorded -----------------------------------------------
UNRECORDABLE: list[tuple[str, Any, str]] = [
    ("1000-deep", lambda: nest(1000), f"nested deeper than {DEPTH} levels"),
    ("65-deep", lambda: nest(DEPTH + 1), f"nested deeper than {DEPTH} levels"),
    ("cyclic-dict", cyclic_dict, "contains itself"),
    ("cyclic-list", cyclic_list, "contains itself"),
    ("raising-repr", BadRepr, "no repr for you"),
    ("raising-repr-inside", lambda: {"ok": 1, "bad": [BadRepr()]}, "no repr for you"),
    ("tuple-keys", lambda: {(1, 2): "pair"}, "cannot be converted"),
]


@pytest.mark.parametrize(("make", "why"), [(m, w) for _, m, w in UNRECORDABLE],
                         ids=[i for i, _, _ in UNRECORDABLE])
def test_a_result_that_cannot_be_recorded_is_ok_with_a_note_and_the_run_goes_on(
        runner: bl.Runner, make: Any, why: str) -> None:
    @bl.tool
    def probe() -> Any:
        return make()

    result = runner.run(model=call_model({}, as_dict=False), tools=[probe], prompt="p")
    assert (result.status, result.model_steps, result.tool_calls) == ("final", 2, 1)
    [(status, content)] = results(result)
    # The action took effect: the model must not be told it failed (it might repeat it).
    assert status == "ok"
    assert content.startswith("The tool's result cannot be recorded: ") and why in content
    assert [(c.call_id, c.status) for c in result.completed] == [("c1", "ok")]
    names, events = journal_of(runner, result)  # RunFinished, replay == result
    [succeeded] = [e for e in events if isinstance(e, ev.CallSucceeded)]
    assert (succeeded.status, succeeded.content) == ("ok", content)
    still_serves(runner)


def test_a_result_64_levels_deep_is_kept(runner: bl.Runner) -> None:
    @bl.tool
    def probe() -> Any:
        return nest(DEPTH)

    result = runner.run(model=call_model({}, as_dict=False), tools=[probe], prompt="p")
    assert results(result) == [("ok", nest(DEPTH))]
    journal_of(runner, result)


def test_plain_content_explains_what_it_cannot_record() -> None:
    for _, make, why in UNRECORDABLE:
        content, problem = pr.plain_content(make())
        assert content is None and problem is not None and why in problem
    assert pr.plain_content({"n": 2 ** 70, "t": "a\ud800"}) == (
        {"n": str(2 ** 70), "t": "a\ufffd"}, None)
    assert pr.plain_content(nest(DEPTH)) == (nest(DEPTH), None)


# -- 2. exception text ---------------------------------------------------------------------
def test_describe_exception_never_raises() -> None:
    class Fancy(str):
        def __format__(self, spec: str) -> str:
            raise ValueError("no format")

    class FancyMessage(Exception):
        def __str__(self) -> str:
            return Fancy("fancy")

    class Exit(BaseException):
        def __str__(self) -> str:
            raise SystemExit(3)

    assert describe_exception(ValueError("message")) == "ValueError: message"
    assert describe_exception(ValueError()) == "ValueError"
    assert describe_exception(BadStr()) == \
        "BadStr (its message could not be read: RuntimeError)"
    assert describe_exception(NotAStr()) == \
        "NotAStr (its message could not be read: TypeError)"
    assert describe_exception(Exit()) == "Exit (its message could not be read: SystemExit)"
    assert describe_exception(FancyMessage()) == "FancyMessage: fancy"
    assert describe_exception(ValueError("a\ud800b")) == "ValueError: a\ufffdb"
    long = describe_exception(ValueError("x" * 10_000))
    assert len(long) == MAX_TEXT and long.endswith("\u2026")
    assert pr.storable(long)


def test_exceptions_whose_text_cannot_be_read_end_with_a_status(runner: bl.Runner) -> None:
    @bl.tool
    def probe() -> str:
        raise BadStr()

    result = runner.run(model=call_model({}, as_dict=False), tools=[probe], prompt="p")
    assert (result.status, result.tool_calls) == ("final", 1)
    assert results(result) == [("error", "BadStr (its message could not be read: "
                                         "RuntimeError)")]
    journal_of(runner, result)

    def model(history: Any, ctx: Any) -> Any:
        raise NotAStr()

    failed = runner.run(model=model, prompt="p")
    assert failed.status == "model_error"
    assert "NotAStr (its message could not be read: TypeError)" in failed.explanation
    journal_of(runner, failed)


# -- 3. run ids ----------------------------------------------------------------------------
@pytest.mark.parametrize(("run_id", "words"), [
    ("a\ud800", ("lone surrogate", "position 1", "errors='replace'")),
    ("\udcff" * 3, ("lone surrogate", "position 0")),
    ("", ("must not be empty", "run_id=None")),
    ("x" * 257, ("at most 256 bytes", "has 257", "shorter id")),
    ("é" * 129, ("at most 256 bytes", "has 258")),
    ("a\x00b", ("NUL",)),
    (42, ("must be a string", "int")),
])
def test_a_run_id_the_journal_cannot_hold_is_a_config_error(runner: bl.Runner, run_id: Any,
                                                            words: tuple[str, ...]) -> None:
    with pytest.raises(bl.ConfigError) as caught:
        runner.run(model=bl.ScriptedModel([bl.Final("x")]), prompt="p", run_id=run_id)
    for word in words:
        assert word in str(caught.value)
    nothing_journaled(runner)
    still_serves(runner)


def test_a_run_id_of_256_bytes_is_fine(runner: bl.Runner) -> None:
    for run_id in ("x" * 256, "é" * 128):
        result = runner.run(model=bl.ScriptedModel([bl.Final("x")]), prompt="p",
                            run_id=run_id)
        assert (result.status, result.run_id) == ("final", run_id)
        journal_of(runner, result)


# -- 4. history= ---------------------------------------------------------------------------
def _history(call_arguments: Any = None, content: Any = "r", text: str = "hi") -> list[Any]:
    return [{"kind": "user", "text": text},
            {"kind": "call", "id": "h1", "name": "probe",
             "arguments": {} if call_arguments is None else call_arguments},
            {"kind": "tool_result", "id": "h1", "status": "ok", "content": content}]


@pytest.mark.parametrize(("history", "words"), [
    (_history(call_arguments={"n": 2 ** 70}),
     ("history[1]", "`call` message", "integer beyond 64 bits", "`arguments.n`")),
    (_history(content=2 ** 70), ("history[2]", "`tool_result`", "beyond 64 bits", "`content`")),
    (_history(content={"rows": [1, -(2 ** 64)]}), ("history[2]", "`content.rows[1]`")),
    (_history(text="a\ud800"), ("history[0]", "lone surrogate", "`text`")),
    (_history(content={"k\udcff": 1}), ("history[2]", "lone surrogate")),
    (_history(content=nest(1000)), ("history[2]", f"nested deeper than {DEPTH} levels")),
    (_history(call_arguments=cyclic_dict()), ("history[1]", "contains itself")),
    (_history(content=cyclic_list()), ("history[2]", "contains itself")),
    (_history(content=BadRepr()), ("history[2]", "BadRepr")),
    (_history(call_arguments={"a": {(1, 2): 3}}), ("history[1]", "tuple key (1, 2)",
                                                   "`arguments.a`")),
    (_history(content={None: 1}), ("history[2]", "key None")),
    (_history() + [42], ("history[3]", "not a message")),
    ([bl.CallMessage("h1", "probe", {"n": 2 ** 70})], ("history[0]", "beyond 64 bits")),
    ([bl.ToolResultMessage("h1", "ok", cyclic_dict())], ("history[0]", "contains itself")),
])
def test_a_history_the_journal_cannot_hold_is_a_config_error_naming_where(
        runner: bl.Runner, history: list[Any], words: tuple[str, ...]) -> None:
    with pytest.raises(bl.ConfigError) as caught:
        runner.run(model=bl.ScriptedModel([bl.Final("x")]), history=history)
    for word in words:
        assert word in str(caught.value), str(caught.value)
    nothing_journaled(runner)
    still_serves(runner)


def test_a_history_with_big_but_storable_values_runs(runner: bl.Runner) -> None:
    history = _history(call_arguments={"n": 2 ** 64 - 1, "m": -(2 ** 63)},
                       content=nest(DEPTH))
    result = runner.run(model=bl.ScriptedModel([bl.Final("x")]), history=history)
    assert result.status == "final"
    journal_of(runner, result)


# -- 5. budgets ----------------------------------------------------------------------------
INT_LIMITS = ["max_model_steps", "max_tool_calls", "max_parallel", "max_input_tokens",
              "max_output_tokens", "max_total_tokens", "max_result_bytes", "malformed_retries"]


@pytest.mark.parametrize("name", INT_LIMITS)
@pytest.mark.parametrize("value", [2 ** 70, 2 ** 63, 2 ** 64 - 1])
def test_a_whole_limit_beyond_64_bits_is_refused_when_the_budget_is_made(
        name: str, value: int) -> None:
    with pytest.raises(bl.ConfigError) as caught:
        bl.Budget(**{name: value})
    assert f"Budget.{name}" in str(caught.value)
    assert f"at most {MAX_WHOLE} (2**63 - 1)" in str(caught.value)


@pytest.mark.parametrize(("kwargs", "words"), [
    ({"max_cost": math.inf}, ("max_cost", "finite", "None for no limit")),
    ({"max_cost": -math.inf}, ("max_cost", "at least 0")),
    ({"max_cost": math.nan}, ("max_cost", "finite")),
    ({"deadline_s": math.nan}, ("deadline_s", "above 0", "1e+09", "None for no deadline")),
    ({"deadline_s": math.inf}, ("deadline_s", "None for no deadline")),
    ({"deadline_s": 1e10}, ("deadline_s", "at most 1e+09")),
    ({"deadline_s": 0}, ("deadline_s", "above 0")),
    ({"max_model_steps": 0}, ("max_model_steps must be at least 1",)),
    ({"max_tool_calls": 2.0}, ("whole number",)),
    ({"max_tool_calls": "3"}, ("a number",)),
])
def test_an_invalid_budget_says_what_is_allowed(kwargs: dict[str, Any],
                                                words: tuple[str, ...]) -> None:
    with pytest.raises(bl.ConfigError) as caught:
        bl.Budget(**kwargs)
    for word in words:
        assert word in str(caught.value), str(caught.value)


def test_the_largest_budget_runs_to_the_end(runner: bl.Runner) -> None:
    @bl.tool
    def probe() -> str:
        return "ran"

    budget = bl.Budget(max_model_steps=MAX_WHOLE, max_tool_calls=MAX_WHOLE,
                       max_parallel=MAX_WHOLE, deadline_s=MAX_SECONDS,
                       max_input_tokens=MAX_WHOLE, max_output_tokens=MAX_WHOLE,
                       max_total_tokens=MAX_WHOLE, max_cost=1e300,
                       max_result_bytes=MAX_WHOLE, malformed_retries=MAX_WHOLE)
    result = runner.run(model=call_model({}, as_dict=False), tools=[probe], prompt="p",
                        budget=budget)
    assert (result.status, result.tool_calls) == ("final", 1)
    journal_of(runner, result)


def test_a_child_of_a_huge_budget_stays_a_valid_budget() -> None:
    from boundloop.core.budget import TreeLeft, Usage, within_tree

    budget = bl.Budget(max_tool_calls=MAX_WHOLE)
    narrowed = within_tree(budget, 5, Usage(input_tokens=5, cost=1e308),
                           TreeLeft(tool_calls=MAX_WHOLE, input_tokens=MAX_WHOLE,
                                    cost=1e308))
    assert narrowed.max_tool_calls == MAX_WHOLE and narrowed.max_input_tokens == MAX_WHOLE
    assert narrowed.max_cost is not None and math.isfinite(narrowed.max_cost)


# -- 6. tools' own numbers -----------------------------------------------------------------
def _handler() -> str:
    return "x"


@pytest.mark.parametrize("timeout_s", [math.inf, math.nan, 1e300, 0, -1, True])
def test_a_tool_timeout_no_timer_can_wait_is_a_config_error(timeout_s: Any) -> None:
    with pytest.raises(bl.ConfigError, match="timeout_s"):
        bl.Tool("t", _handler, timeout_s=timeout_s)


@pytest.mark.parametrize("kwargs", [{"backoff_s": math.nan}, {"backoff_s": math.inf},
                                    {"backoff_s": 1e300}, {"max_attempts": 2 ** 70}])
def test_a_retry_policy_out_of_range_is_a_config_error(kwargs: dict[str, Any]) -> None:
    with pytest.raises(bl.ConfigError, match="RetryPolicy"):
        bl.RetryPolicy(**kwargs)


def test_retry_delays_stay_finite_whatever_the_attempt() -> None:
    policy = bl.RetryPolicy(max_attempts=10_000, backoff_s=0.5)
    assert policy.delay(2) == 0.5 and policy.delay(4) == 2.0
    assert policy.delay(5_000) == MAX_SECONDS
    assert bl.RetryPolicy(max_attempts=10_000).delay(5_000) == 0.0


# -- redaction and storability never raise -------------------------------------------------
def test_redaction_and_storability_are_bounded() -> None:
    key = b"k" * 32
    for value in (nest(1000), cyclic_dict(), cyclic_list(), [nest(1000)]):
        red, changed = pr.redact(value, key)
        assert changed and pr.storable(red)
        assert pr.TOO_DEEP_TEXT in msgspec.json.encode(red).decode()
        assert not pr.storable(value)
    # Credentials at depth are still digested, and a digest never raises.
    red, changed = pr.redact({"a": [{"api_key": BadRepr()}], "token": nest(1000)}, key)
    assert changed and red["a"][0]["api_key"].startswith(pr.PREFIX)
    assert red["token"].startswith(pr.PREFIX)
    assert pr.digest(key, cyclic_dict()).startswith(pr.PREFIX)
    assert pr.digest(key, "a\ud800") != pr.digest(key, "a\udc00")


def test_shape_problem_is_exact_at_the_limit() -> None:
    assert pr.shape_problem(nest(DEPTH)) is None
    assert pr.shape_problem(nest(DEPTH + 1)) == "too_deep"
    assert pr.shape_problem([[]] * 3) is None  # shared, not cyclic
    shared: list[Any] = [1]
    assert pr.shape_problem({"a": shared, "b": [shared, shared]}) is None
    assert pr.shape_problem(cyclic_dict()) == "cycle"
    assert pr.shape_problem({"t": (1, [cyclic_list()])}) == "cycle"
    assert pr.shape_problem({"deep": frozenset({(((1,),),)})}) is None
    assert pr.shape_problem("x" * 10) is None and pr.shape_problem(5) is None
