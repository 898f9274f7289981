"""boundloop.ops: golden journals replay and check with the current code; the check
catches changed policies; listing, timeline, prune and export on journals of real runs."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

import boundloop as bl
from boundloop import events as ev
from boundloop import ops as bi
from boundloop.journal import codec
from boundloop.ops._events import _scrub
from boundloop.testing import FaultyJournal

GOLDEN = Path(__file__).with_name("golden")
#: golden journal -> (status, exhausted_limit); one per status a run can be recorded with.
EXPECTED = {
    "final": ("final", None),
    "final_retry_timeout": ("final", None),
    "limit_tool_calls": ("limit_exceeded", "tool_calls"),
    "limit_model_steps": ("limit_exceeded", "model_steps"),
    "limit_deadline": ("limit_exceeded", "deadline"),
    "limit_total_tokens": ("limit_exceeded", "total_tokens"),
    "limit_input_tokens": ("limit_exceeded", "input_tokens"),
    "repeated_call": ("repeated_call", None),
    "cancelled": ("cancelled", None),
    "cancelled_dispatch": ("cancelled", None),
    "malformed_response": ("malformed_response", None),
    "model_error": ("model_error", None),
}


def golden(name: str) -> list[ev.Event]:
    return bi.load_events(GOLDEN / f"{name}.msgpack")


def with_limits(events: list[ev.Event], **changes: Any) -> bl.Budget:
    return msgspec.structs.replace(bi.recorded_budget(events), **changes)


def seq_of(events: list[ev.Event], kind: type[ev.Event], nth: int = 0, **fields: Any) -> int:
    hits = [i for i, e in enumerate(events, 1) if isinstance(e, kind)
            and all(getattr(e, k) == v for k, v in fields.items())]
    return hits[nth]


# -- golden journals -------------------------------------------------------------------------
def test_golden_files_are_the_expected_set() -> None:
    assert {p.stem for p in GOLDEN.glob("*.msgpack")} == set(EXPECTED)
    assert {p.stem for p in GOLDEN.glob("*.jsonl")} == set(EXPECTED)
    statuses = {s for s, _ in EXPECTED.values()}
    assert statuses == {"final", "limit_exceeded", "repeated_call", "cancelled",
                        "malformed_response", "model_error"}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_golden_journal_replays_and_checks(name: str) -> None:
    events = golden(name)
    assert bi.load_events(GOLDEN / f"{name}.jsonl") == events  # both forms agree
    rebuilt = bi.rebuild(events)
    assert rebuilt.consistent, rebuilt.mismatches
    state = rebuilt.state
    assert (state.status, state.exhausted_limit) == EXPECTED[name]
    assert state.finished and rebuilt.finished_seq == len(events)
    assert bl.replay(events).transcript == state.transcript
    report = bi.check(events)
    assert report.ok, report.divergence
    assert report.note == "" and report.decisions >= 2
    assert report.budget == bi.recorded_budget(events)


def test_golden_final_covers_every_decision_and_redaction() -> None:
    events = golden("final")
    decisions = {e.decision for e in events if isinstance(e, ev.CallDecided)}
    assert decisions == {"allow", "denied", "unknown_tool", "invalid_arguments"}
    assert any(isinstance(e, ev.NoticeAdded) for e in events)
    text = (GOLDEN / "final.jsonl").read_text()
    assert "s3cret" not in text and "hmac-sha256:" in text
    kinds = {type(e) for e in golden("final_retry_timeout")}
    assert {ev.CallFailed, ev.CallTimedOut, ev.CallOutcomeUnknown} <= kinds
    assert any(isinstance(e, ev.CallSkipped) for e in golden("cancelled_dispatch"))


# -- the check catches changed policies ------------------------------------------------------
def test_check_catches_a_lower_call_limit() -> None:
    events = golden("final")  # five tool calls, four of them in the first batch
    report = bi.check(events, with_limits(events, max_tool_calls=3))
    assert not report.ok and report.divergence is not None
    div = report.divergence
    assert div.seq == seq_of(events, ev.CallDecided, call_id="c1")
    assert div.step == 1
    assert "c1" in div.recorded and "allow" in div.recorded
    assert "limit_exceeded (tool_calls)" in div.current
    # One more call: the first batch runs, then step 2 is told tools are not allowed.
    report = bi.check(events, with_limits(events, max_tool_calls=4))
    assert report.divergence is not None
    assert report.divergence.seq == seq_of(events, ev.ModelStepStarted, step=2)
    assert "tools not allowed" in report.divergence.current
    # A higher limit changes nothing the run did.
    assert bi.check(events, with_limits(events, max_tool_calls=50)).ok


@pytest.mark.parametrize(("name", "changes", "kind", "fields"), [
    ("final", {"max_model_steps": 3}, ev.ModelStepStarted, {"step": 3}),
    ("final", {"malformed_retries": 0}, ev.ModelStepStarted, {"step": 4}),
    ("limit_tool_calls", {"max_tool_calls": 3}, ev.RunFinished, {}),
    ("limit_model_steps", {"max_model_steps": 3}, ev.ModelStepStarted, {"step": 2}),
    ("limit_deadline", {"deadline_s": 60.0}, ev.RunFinished, {}),
    ("limit_deadline", {"deadline_s": 1e-9}, ev.ModelStepStarted, {"step": 1}),
    ("limit_total_tokens", {"max_total_tokens": 10_000}, ev.RunFinished, {}),
    ("limit_input_tokens", {"max_input_tokens": 10_000}, ev.RunFinished, {}),
    ("malformed_response", {"malformed_retries": 1}, ev.RunFinished, {}),
    ("repeated_call", {"max_tool_calls": 1}, ev.ModelStepStarted, {"step": 2}),
    ("final_retry_timeout", {"max_result_bytes": 1}, ev.CallSucceeded, {"attempt": 2}),
    ("final_retry_timeout", {"max_result_bytes": None}, ev.CallSucceeded,
     {"status": "too_large"}),
])
def test_check_reports_the_first_changed_decision(name: str, changes: dict[str, Any],
                                                  kind: type[ev.Event],
                                                  fields: dict[str, Any]) -> None:
    events = golden(name)
    report = bi.check(events, with_limits(events, **changes))
    assert not report.ok
    assert report.divergence is not None
    assert report.divergence.seq == seq_of(events, kind, **fields), report.divergence


@pytest.mark.parametrize("name", ["limit_input_tokens", "limit_deadline", "cancelled"])
def test_check_accepts_limits_that_change_nothing(name: str) -> None:
    events = golden(name)
    budget = bi.recorded_budget(events)
    changes: dict[str, Any] = {"max_tool_calls": 19, "max_model_steps": 7}
    if budget.max_input_tokens is not None:
        changes["max_input_tokens"] = budget.max_input_tokens - 10
    assert bi.check(events, with_limits(events, **changes)).ok


def test_check_stops_where_the_recording_stops() -> None:
    events = golden("final")
    cut = seq_of(events, ev.CallDecided, call_id="c5")  # a crash after this decision
    report = bi.check(events[:cut])
    assert report.ok and "recording ends" in report.note
    claimed = [*events[:cut], ev.OwnerClaimed(run_id=events[0].run_id, owner="other")]
    report = bi.check(claimed)
    assert report.ok and "OwnerClaimed" in report.note
    # A changed decision before the horizon is still caught.
    assert not bi.check(claimed, with_limits(events, max_tool_calls=3)).ok
    with pytest.raises(bl.JournalCorrupt):
        bi.check(events[1:])


def test_check_stops_where_the_journal_failed(tmp_path: Path) -> None:
    from boundloop.journal import LmdbJournal

    faulty = FaultyJournal(LmdbJournal(tmp_path / "j"), fail_at=2)
    with bl.Runner(faulty) as runner:
        model = bl.ScriptedModel([bl.CallTools([bl.ToolCall("c1", "t", {})])])
        result = runner.run(model=model, tools=[bl.Tool("t", lambda: 1)], prompt="x")
        events = list(runner.journal.events(result.run_id))
    faulty.inner.close()
    assert result.status == "journal_unavailable"
    report = bi.check(events)  # the decisions never reached the journal
    assert report.ok and "recording ends" in report.note
    # Had the journal come back for the RunFinished, the check stops there too.
    fin = ev.RunFinished(run_id=result.run_id, status="journal_unavailable",
                         exhausted_limit=None, explanation="", model_steps=1, tool_calls=1)
    report = bi.check([*events, fin])
    assert report.ok and "journal failed" in report.note


# -- schema evolution ------------------------------------------------------------------------
def test_old_and_newer_events_still_decode() -> None:
    line = next(x for x in (GOLDEN / "final.jsonl").read_text().splitlines()
                if '"call.decided"' in x)
    data = msgspec.json.decode(line)
    for field in ("reason", "parent_step", "read_only", "idempotent", "irreversible",
                  "redacted", "ts", "elapsed_s"):
        data.pop(field, None)  # an older writer, before these fields existed
    data["added_by_a_newer_version"] = {"x": 1}
    old = msgspec.convert(data, ev.AnyEvent)
    assert isinstance(old, ev.CallDecided)
    assert (old.reason, old.read_only, old.redacted, old.ts) == ("", False, False, 0.0)
    stored = codec.decode(msgspec.msgpack.encode(data), data["run_id"])
    assert stored == old


# -- a journal of real runs --------------------------------------------------------------------
def weather_tool() -> bl.Tool:
    @bl.tool(read_only=True)
    def weather(city: str, api_key: str = "") -> dict[str, Any]:
        return {"city": city, "sky": "sunny", "session_token": "tok-123"}

    return weather


@pytest.fixture
def journal(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "journal"
    call = bl.CallTools([bl.ToolCall("c1", "weather", {"city": "Paris", "api_key": "k-999"})])
    with bl.Runner(path) as runner:
        for run_id, script, budget in [
            ("r-final", [call, bl.Final("sunny")], bl.Budget()),
            ("r-limit", [call, call], bl.Budget(max_tool_calls=1)),
            ("r-error", [RuntimeError("503")], bl.Budget()),
        ]:
            runner.run(model=bl.ScriptedModel(script), tools=[weather_tool()],
                       prompt=f"weather for {run_id}", budget=budget, run_id=run_id)
    yield path


def add_open_run(path: Path, run_id: str, *, finish: str | None = None) -> None:
    """A run left as a crash leaves it: a decided call, no outcome, its owner gone."""
    from boundloop.journal import LmdbJournal

    t = time.time()
    events: list[ev.Event] = [
        ev.RunAdmitted(run_id=run_id, ts=t, budget=bl.Budget(),
                       history=[bl.UserMessage("go")], tools=["weather"], owner="gone:1:x"),
        ev.ModelStepStarted(run_id=run_id, ts=t, step=1, tools_allowed=True,
                            reservation=bl.Usage()),
        ev.ModelStepCompleted(run_id=run_id, ts=t, step=1, response=bl.CallTools(
            [bl.ToolCall("c1", "weather", {"city": "Oslo"})])),
        ev.CallDecided(run_id=run_id, ts=t, execution_id=f"{run_id}:1:0", idempotency_key="k",
                       step=1, round=1, index=0, call_id="c1", tool="weather",
                       arguments={"city": "Oslo"}, decision="allow"),
    ]
    if finish is not None:
        events.append(ev.RunFinished(run_id=run_id, ts=t, status=finish, exhausted_limit=None,
                                     explanation="a person must look", model_steps=1,
                                     tool_calls=1))
    with LmdbJournal(path) as j:
        j.append(run_id, 0, events)


def test_open_journal_errors(tmp_path: Path) -> None:
    with pytest.raises(bl.JournalUnavailable, match="no journal at"):
        bi.open_journal(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(bl.JournalUnavailable, match="holds no journal"):
        bi.open_journal(tmp_path / "empty")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "data.mdb").write_bytes(b"not lmdb" * 512)
    with pytest.raises(bl.JournalCorrupt, match="is not an LMDB file.*restore the journal"):
        bi.open_journal(tmp_path / "bad")  # damaged: its header page is gone
    assert not (tmp_path / "missing").exists()


@pytest.mark.parametrize(("text", "seconds"), [
    ("30d", 30 * 86400), ("12h", 43200), ("1h30m", 5400), ("90s", 90), ("2w", 1209600),
    ("0s", 0), ("1.5h", 5400), (" 15M ", 900),
])
def test_parse_duration(text: str, seconds: float) -> None:
    assert bi.parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "30", "30x", "d", "1h-", "-1d", "h30", "1 day"])
def test_parse_duration_rejects(text: str) -> None:
    with pytest.raises(bl.ConfigError, match="bad duration"):
        bi.parse_duration(text)


def test_list_runs_filters_newest_first(journal: Path) -> None:
    add_open_run(journal, "r-open")
    with bi.open_journal(journal) as j:
        runs = bi.list_runs(j)
        assert [r.run_id for r in runs] == ["r-open", "r-error", "r-limit", "r-final"]
        by_id = {r.run_id: r for r in runs}
        assert by_id["r-open"].status == "interrupted" and by_id["r-open"].unresolved == 1
        assert (by_id["r-limit"].status, by_id["r-limit"].exhausted_limit) == \
            ("limit_exceeded", "tool_calls")
        assert (by_id["r-final"].model_steps, by_id["r-final"].tool_calls) == (2, 1)
        assert [r.run_id for r in bi.list_runs(j, status=["final", "model_error"])] == \
            ["r-error", "r-final"]
        assert [r.run_id for r in bi.list_runs(j, limit_hit=["any"])] == ["r-limit"]
        assert bi.list_runs(j, limit_hit=["deadline"]) == []
        assert [r.run_id for r in bi.list_runs(j, last=2)] == ["r-open", "r-error"]
        assert len(bi.list_runs(j, since_s=3600)) == 4
        assert bi.list_runs(j, older_than_s=3600) == []
        later = time.time() + 7200
        assert len(bi.list_runs(j, older_than_s=3600, now=later)) == 4
        assert bi.list_runs(j, since_s=3600, now=later) == []


def test_timeline_shows_calls_outcomes_and_budget(journal: Path) -> None:
    with bi.open_journal(journal) as j:
        events = bi.read_events(j, "r-limit")
        with pytest.raises(bl.UnknownRun):
            bi.read_events(j, "nope")
    tl = bi.timeline(events)
    assert [r.seq for r in tl.rows] == list(range(1, len(events) + 1))
    assert (tl.status, tl.exhausted_limit, tl.finished) == ("limit_exceeded", "tool_calls", True)
    assert "max_tool_calls=1" in tl.explanation
    decided = [r for r in tl.rows if r.event == "CallDecided"]
    assert [(r.call_id, r.tool, r.decision, r.step, r.tool_calls) for r in decided] == \
        [("c1", "weather", "allow", 1, 1)]
    ok = next(r for r in tl.rows if r.event == "CallSucceeded")
    assert (ok.outcome, ok.call_id, ok.execution_id) == ("ok", "c1", "r-limit:1:0")
    assert ok.latency_s is not None
    assert [r.model_steps for r in tl.rows if r.event == "ModelStepStarted"] == [1, 2]
    assert tl.rows[-1].event == "RunFinished" and tl.rows[-1].outcome == \
        "limit_exceeded (tool_calls)"
    assert all(a.offset_s <= b.offset_s for a, b in zip(tl.rows, tl.rows[1:], strict=False))
    assert [(c.call_id, c.status) for c in tl.completed] == [("c1", "ok")]
    assert tl.unresolved == []


def test_rebuild_reports_a_run_finished_that_disagrees() -> None:
    events = golden("limit_tool_calls")
    fin = events[-1]
    assert isinstance(fin, ev.RunFinished)
    bad = [*events[:-1], msgspec.structs.replace(fin, tool_calls=fin.tool_calls + 1)]
    rebuilt = bi.rebuild(bad)
    assert not rebuilt.consistent
    assert rebuilt.mismatches == [f"tool_calls: the fold gives {fin.tool_calls}, RunFinished "
                                  f"(seq {len(events)}) says {fin.tool_calls + 1}"]
    assert bi.rebuild(events[:-1]).finished_seq is None


def test_prune_keeps_open_runs_and_what_recovery_needs(journal: Path) -> None:
    add_open_run(journal, "r-open")
    add_open_run(journal, "r-review", finish="needs_review")
    with bi.open_journal(journal) as j:
        assert bi.prune(j, 86400).pruned == []  # nothing is a day old
        later = time.time() + 3600
        dry = bi.prune(j, 60, dry_run=True, now=later)
        assert sorted(dry.pruned) == ["r-error", "r-final", "r-limit"]
        assert list(dry.kept) == ["r-review"]
        assert len(list(j.runs())) == 5
        done = bi.prune(j, 60, now=later)
        assert sorted(done.pruned) == sorted(dry.pruned)
        assert sorted(j.runs()) == ["r-open", "r-review"]
        assert list(j.open_runs()) == ["r-open"]
        with pytest.raises(bl.UnknownRun):
            bi.read_events(j, "r-final")
        with pytest.raises(bl.ConfigError):
            bi.prune(j, -1)
    with bl.Runner(journal) as runner:
        recovered = runner.recover()
        assert [r.run_id for r in recovered] == ["r-open"]
        assert [(u.call_id, u.tool) for u in recovered[0].unresolved] == [("c1", "weather")]
        assert runner.state("r-review").status == "needs_review"


def test_export_is_redacted_and_reads_back(journal: Path) -> None:
    with bi.open_journal(journal) as j:
        events = bi.read_events(j, "r-final")
        key = j.secret_key
    lines = list(bi.export_lines(events, key))
    text = "\n".join(lines)
    assert "k-999" not in text and "tok-123" not in text  # redacted by the journal
    assert [msgspec.json.decode(x)["seq"] for x in lines] == list(range(1, len(events) + 1))
    assert msgspec.json.decode(lines[0])["type"] == "RunAdmitted"
    path = Path(str(journal) + ".jsonl")
    path.write_text(text + "\n")
    assert bi.load_events(path) == events
    # Strip the content too: texts, arguments and results become digests.
    stripped = "\n".join(bi.export_lines(events, key, strip_content=True))
    assert "Paris" not in stripped and "sunny" not in stripped and "weather for" not in stripped
    path.write_text(stripped + "\n")
    assert bi.rebuild(bi.load_events(path)).state.status == "final"
    # A credential that reached the journal in clear (an older writer) is digested on export.
    leaky = msgspec.structs.replace(events[1], run_id=events[1].run_id)
    admitted = msgspec.structs.replace(events[0], history=[bl.UserMessage("hi")])
    one = list(bi.export_lines([admitted, leaky], key))
    assert "hmac" not in one[0]
    raw = {"type": "notice.added", "run_id": "x", "text": "t", "password": "hunter2"}
    scrubbed = _scrub(raw, key, False)
    assert scrubbed["password"].startswith("hmac-sha256:") and scrubbed["text"] == "t"
