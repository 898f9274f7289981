"""``boundloop stats`` (SPEC 11): the metrics' figures computed from the journal alone, and in
agreement with the metrics on the same runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest

pytest.importorskip("opentelemetry.sdk")

from test_telemetry import Otel, observed_runner, read_journal, run_scenarios  # noqa: E402

from boundloop import events as ev  # noqa: E402
from boundloop import stats  # noqa: E402
from boundloop.errors import JournalCorrupt  # noqa: E402
from boundloop.telemetry import names  # noqa: E402


@pytest.fixture(scope="module")
def scripted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Otel, dict[str, Any], Path]:
    otel = Otel()
    path = tmp_path_factory.mktemp("stats") / "journal"
    with observed_runner(path, otel.telemetry) as runner:
        results = run_scenarios(runner)
    return otel, results, path


def figures(path: Path, **options: Any) -> stats.Stats:
    with read_journal(path) as journal:
        return stats.from_journal(journal, **options)


def by_attr(otel: Otel, metric: str, attr: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for (name, series), v in otel.metrics().items():
        if name == metric:
            key = dict(series)[attr]
            out[key] = out.get(key, 0) + (v[0] if isinstance(v, tuple) else v)
    return out


def test_stats_agree_with_the_metrics(scripted: tuple[Otel, dict[str, Any], Path]) -> None:
    otel, results, path = scripted
    got = figures(path)
    assert got.runs == otel.total("boundloop.runs") == len(results) + 1
    assert got.runs_by_status == by_attr(otel, "boundloop.runs", names.RUN_STATUS)
    assert got.limit_hits == by_attr(otel, "boundloop.limit_hits", names.LIMIT)
    assert set(got.limit_hits) == {"model_steps", "tool_calls", "deadline", "input_tokens",
                                   "output_tokens", "total_tokens", "cost"}
    assert got.outcome_unknown == otel.total("boundloop.actions.outcome_unknown") == 2
    assert got.retries == otel.total("boundloop.retries") == 1
    assert got.reconciliations == otel.total("boundloop.reconciliations") == 1
    assert got.reconciled_took_effect == 1
    assert got.reviews == otel.total("boundloop.reviews") == 1
    assert got.tokens == {k: by_attr(otel, "boundloop.tokens", names.TOKEN_KIND).get(k, 0)
                          for k in names.TOKEN_KINDS}
    assert got.cost_runs == otel.total("boundloop.run.cost")
    assert got.cost_total == pytest.approx(otel.hist_sum("boundloop.run.cost"))
    assert got.cost_per_run == pytest.approx(got.cost_total / got.cost_runs)
    assert got.duration_s.count == otel.total("boundloop.run.duration")
    assert got.duration_s.sum == pytest.approx(otel.hist_sum("boundloop.run.duration"))
    assert got.model_calls == otel.total("boundloop.model.latency")
    assert got.model_latency_s.sum == pytest.approx(otel.hist_sum("boundloop.model.latency"))
    assert got.tool_attempts == otel.total("boundloop.tool.latency")
    assert got.tool_latency_s.sum == pytest.approx(otel.hist_sum("boundloop.tool.latency"))
    assert got.open_runs == 0 and got.runs_seen == len(results) + 1 and not got.damaged
    d = got.duration_s
    assert d.p50 is not None and d.p95 is not None and d.p50 <= d.p95


def test_stats_json_from_the_command_line_is_the_same(
        scripted: tuple[Otel, dict[str, Any], Path]) -> None:
    _, _, path = scripted
    done = boundloop("stats", "--journal", str(path), "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == msgspec.to_builtins(figures(path))
    assert json.loads(done.stdout)["limit_hits"]["cost"] == 1


@pytest.mark.parametrize("by", ["tool", "status", "limit"])
def test_stats_by(scripted: tuple[Otel, dict[str, Any], Path], by: str) -> None:
    otel, _, path = scripted
    got = figures(path, by=by)
    assert got.by == by and got.groups is not None
    if by == "tool":
        assert got.groups["flaky"].retries == 1 and got.groups["flaky"].attempts == 2
        assert got.groups["slow"].outcome_unknown == 1
        assert got.groups["book"].reconciliations == 1
        assert got.groups["deploy"].reviews == 1
        assert {t: g.attempts for t, g in got.groups.items()} == by_attr(
            otel, "boundloop.tool.latency", names.TOOL_NAME)
    elif by == "status":
        assert {s: g.runs for s, g in got.groups.items()} == got.runs_by_status
        assert sum(g.cost_total or 0 for g in got.groups.values()) == pytest.approx(
            got.cost_total)
    else:
        assert {k: g.runs for k, g in got.groups.items()} == got.limit_hits
    text = boundloop("stats", "--journal", str(path), "--by", by)
    assert text.returncode == 0, text.stderr
    assert by in text.stdout and "\x1b" not in text.stdout
    assert not set("┏┃━│─┡") & set(text.stdout)


def test_stats_text(scripted: tuple[Otel, dict[str, Any], Path]) -> None:
    _, _, path = scripted
    done = boundloop("stats", "--journal", str(path), "--since", "24h")
    assert done.returncode == 0, done.stderr
    out = done.stdout
    for words in ("limit hits:", "cost 1", "unknown outcomes: 2", "retries: 1",
                  "reconciliations: 1", "sent to review: 1", "tokens:", "cost per finished run",
                  "run duration: p50"):
        assert words in out, out
    assert "\x1b" not in out


def test_since_counts_only_recent_events(scripted: tuple[Otel, dict[str, Any], Path]) -> None:
    _, results, path = scripted
    everything = figures(path)
    now = time.time()
    recent = figures(path, since_s=3600, now=now)
    assert recent.since == now - 3600
    assert recent == msgspec.structs.replace(everything, since=now - 3600)
    later = figures(path, since_s=3600, now=time.time() + 7200)
    assert later.runs == 0 and later.runs_seen == 0 and later.tokens == dict.fromkeys(
        names.TOKEN_KINDS, 0)


def test_since_cuts_inside_a_run() -> None:
    admitted = ev.RunAdmitted(run_id="r", ts=100.0, budget=_budget(), history=[], tools=[])
    decided = ev.CallDecided(run_id="r", ts=100.0, execution_id="r:1:0", idempotency_key="k",
                             step=1, round=1, index=0, call_id="c", tool="t", arguments={},
                             decision="allow")
    retry = ev.CallDispatched(run_id="r", ts=200.0, execution_id="r:1:0", attempt=2)
    old = ev.CallDispatched(run_id="r", ts=100.0, execution_id="r:1:0", attempt=1)
    got = stats.compute([("r", [admitted, decided, old, retry])], since=150.0, by="tool")
    assert got.retries == 1 and got.groups is not None and got.groups["t"].retries == 1
    assert got.open_runs == 1 and got.runs == 0


def _budget() -> Any:
    import boundloop as bl

    return bl.Budget()


def test_a_damaged_run_is_left_out_and_named() -> None:
    class Journal:
        def runs(self) -> list[str]:
            return ["bad", "good"]

        def find(self, run_id: str) -> None:
            return None

        def events(self, run_id: str) -> list[ev.Event]:
            if run_id == "bad":
                raise JournalCorrupt("run 'bad' is damaged at sequence 3")
            return [ev.RunAdmitted(run_id="good", budget=_budget(), history=[], tools=[])]

    got = stats.from_journal(Journal())  # type: ignore[arg-type]
    assert got.damaged == ["bad"] and got.open_runs == 1
    assert "damaged" in stats.render(got)


def test_percentiles_interpolate() -> None:
    assert stats.percentile([], 0.5) is None
    assert stats.percentile([1.0], 0.95) == 1.0
    assert stats.percentile([1.0, 2.0, 3.0, 4.0], 0.5) == 2.5
    assert stats.percentile([float(i) for i in range(1, 101)], 0.95) == pytest.approx(95.05)
    d = stats.distribution([3.0, 1.0, 2.0])
    assert (d.count, d.sum, d.mean, d.p50) == (3, 6.0, 2.0, 2.0)


def test_bad_by_is_bad_input(scripted: tuple[Otel, dict[str, Any], Path]) -> None:
    done = boundloop("stats", "--journal", str(scripted[2]), "--by", "weather")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    with pytest.raises(ValueError):
        stats.compute([], by="weather")  # type: ignore[arg-type]


def test_no_journal_is_a_one_line_error(tmp_path: Path) -> None:
    done = boundloop("stats", "--journal", str(tmp_path / "nothing"))
    assert done.returncode == 4 and len(done.stderr.strip().splitlines()) == 1


def boundloop(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env.pop("BOUNDLOOP_JOURNAL", None)
    return subprocess.run([sys.executable, "-m", "boundloop", *args], capture_output=True,
                          text=True, timeout=60, env=env)


def test_golden_histories_project_and_count() -> None:
    """Recorded journals of older versions: the projection reads them (spans and stats)."""
    from boundloop import ops as bi

    golden = Path(__file__).with_name("golden")
    runs = [(p.stem, bi.load_events(p)) for p in sorted(golden.glob("*.msgpack"))]
    got = stats.compute(runs)
    finished = [next(e for e in reversed(events) if isinstance(e, ev.RunFinished))
                for _, events in runs]
    assert got.runs == len(runs) and got.open_runs == 0
    expected: dict[str, int] = {}
    for f in finished:
        expected[f.status] = expected.get(f.status, 0) + 1
    assert got.runs_by_status == dict(sorted(expected.items()))
    assert sum(got.limit_hits.values()) == expected["limit_exceeded"]
    otel = Otel()
    for _, events in runs:
        otel.telemetry.observe(events[0].run_id, events)
    statuses = sorted(dict(s.attributes or {})[names.RUN_STATUS] for s in otel.spans()
                      if s.name == names.SPAN_RUN)
    assert statuses == sorted(f.status for f in finished)
    assert otel.total("boundloop.runs") == len(runs)
