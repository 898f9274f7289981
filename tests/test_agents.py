"""SPEC 14: agents, labels, idempotent run ids and the durable queue (in one process)."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest
from click.testing import CliRunner

import boundloop as bl
from boundloop.cli import cli


def two_step(tool: str = "act") -> Any:
    """A model that calls ``tool`` once with the run's id, then answers."""

    def model(history: list[Any], ctx: bl.ModelContext) -> Any:
        if ctx.step == 1:
            return bl.CallTools([bl.ToolCall("c1", tool, {"x": ctx.run_id})])
        return bl.Final(f"done {ctx.run_id}")

    return model


@pytest.fixture
def acted() -> tuple[bl.Tool, list[str]]:
    ran: list[str] = []

    @bl.tool
    def act(x: str) -> str:
        """Act once."""
        ran.append(x)
        return f"acted {x}"

    return act, ran


def test_an_agent_run_records_its_name_version_and_labels(
        runner: bl.Runner, acted: tuple[bl.Tool, list[str]]) -> None:
    act, ran = acted
    agent = bl.Agent("refunds", model=two_step(), tools=[act], version="3",
                     budget=bl.Budget(max_model_steps=4))
    result = runner.run(agent, prompt="go", labels={"tenant": "acme", "password": "hunter2"})
    assert (result.status, result.model_steps, result.tool_calls) == ("final", 2, 1)
    assert ran == [result.run_id]
    first = next(iter(runner.journal.events(result.run_id)))
    assert isinstance(first, bl.RunAdmitted)
    assert (first.agent, first.agent_version, first.queued) == ("refunds", "3", False)
    assert first.budget.max_model_steps == 4  # the agent's budget
    assert first.labels["tenant"] == "acme"
    # Labels are scrubbed as any text is: a credential key never holds its value in clear.
    assert "hunter2" not in first.labels["password"]
    state = bl.replay(runner.journal.events(result.run_id))
    assert (state.agent, state.agent_version, state.labels) == ("refunds", "3", first.labels)


@pytest.mark.parametrize("bad", [
    {"name": ""}, {"name": 5}, {"name": "a\nb"}, {"model": "not callable"}, {"version": 1.5},
    {"budget": {"max_model_steps": 3}}, {"max_running": 0}, {"max_queued": -1},
    {"permit": "yes"},
])
def test_a_bad_agent_is_refused_with_a_config_error(bad: dict[str, Any]) -> None:
    args: dict[str, Any] = {"name": "a", "model": bl.ScriptedModel([bl.Final("x")])}
    args.update(bad)
    name = args.pop("name")
    with pytest.raises(bl.ConfigError):
        bl.Agent(name, **args)


@pytest.mark.parametrize("labels", [
    {"k": 1}, {1: "v"}, {"": "v"}, {"a=b": "v"}, "tenant=acme", {"k": "v" * 300},
    {"k": "a\nFAKE-RUN final"}, {"k\x00": "v"}, {"k": "\u202eevil"},
    {f"k{i}": "v" for i in range(40)},
])
def test_bad_labels_are_refused_before_anything_is_journaled(runner: bl.Runner,
                                                             labels: Any) -> None:
    with pytest.raises(bl.ConfigError):
        runner.run(bl.ScriptedModel([bl.Final("x")]), prompt="go", labels=labels)
    assert list(runner.journal.runs()) == []


def test_an_existing_run_id_returns_that_run_and_never_runs_twice(
        runner: bl.Runner, acted: tuple[bl.Tool, list[str]]) -> None:
    act, ran = acted
    agent = bl.Agent("a", model=two_step(), tools=[act])
    first = runner.run(agent, prompt="go", run_id="order-42")
    events = [msgspec.to_builtins(e) for e in runner.journal.events("order-42")]
    again = runner.run(agent, prompt="go again", run_id="order-42")
    assert again.status == first.status == "final"
    assert again.transcript == first.transcript
    assert (again.model_steps, again.tool_calls) == (2, 1)
    assert ran == ["order-42"]
    assert [msgspec.to_builtins(e) for e in runner.journal.events("order-42")] == events
    # enqueue of the same id returns it and writes nothing
    assert runner.enqueue(agent, prompt="x", run_id="order-42") == "order-42"
    assert [msgspec.to_builtins(e) for e in runner.journal.events("order-42")] == events


def test_submit_of_an_id_in_flight_returns_the_same_run(runner: bl.Runner) -> None:
    release = threading.Event()
    calls: list[int] = []

    def slow(history: Any, ctx: bl.ModelContext) -> Any:
        calls.append(ctx.step)
        release.wait(5)
        return bl.Final("slow")

    f1 = runner.submit(slow, prompt="a", run_id="same")
    time.sleep(0.05)
    f2 = runner.submit(slow, prompt="b", run_id="same")
    release.set()
    assert f1.result(10).status == f2.result(10).status == "final"
    assert calls == [1]
    assert [type(e) for e in runner.journal.events("same")].count(bl.RunAdmitted) == 1


def test_enqueue_is_durable_at_once_and_a_queued_run_shows_as_queued(
        journal_dir: Path, acted: tuple[bl.Tool, list[str]]) -> None:
    act, ran = acted
    agent = bl.Agent("refunds", model=two_step(), tools=[act], version="2")
    with bl.Runner(journal_dir) as runner:
        run_id = runner.enqueue(agent, prompt="refund 42", labels={"tenant": "acme"})
        assert ran == []
        events = list(runner.journal.events(run_id))
        assert len(events) == 1 and isinstance(events[0], bl.RunAdmitted)
        assert events[0].queued and events[0].owner == ""
        state = runner.state(run_id)
        assert state.status == "queued" and not state.finished
        # recover() leaves queued runs to workers: they are not crashed runs
        assert runner.recover() == []
    out = CliRunner().invoke(cli, ["runs", "--journal", str(journal_dir), "--json"])
    assert out.exit_code == 0, out.output
    row = json.loads(out.output)[0]
    assert (row["run_id"], row["status"], row["agent"], row["labels"]) == (
        run_id, "queued", "refunds", {"tenant": "acme"})
    assert "refunds" in row["explanation"]
    text = CliRunner().invoke(cli, ["runs", "--journal", str(journal_dir)]).output
    assert "queued" in text and "waits for a worker serving" in " ".join(text.split()) \
        or "wait for a worker serving" in " ".join(text.split())
    # run() with the same agent and id takes the queued run and drives it here, once.
    with bl.Runner(journal_dir) as runner:
        result = runner.run(agent, run_id=run_id)
        assert result.status == "final" and ran == [run_id]
        assert runner.run(agent, run_id=run_id).status == "final" and ran == [run_id]


def test_a_queued_run_of_another_agent_is_not_taken_by_run(runner: bl.Runner,
                                                           acted: tuple[bl.Tool, list[str]]
                                                           ) -> None:
    act, ran = acted
    agent = bl.Agent("refunds", model=two_step(), tools=[act])
    other = bl.Agent("other", model=two_step(), tools=[act])
    run_id = runner.enqueue(agent, prompt="x", run_id="q1")
    future = runner.submit(other, prompt="x", run_id=run_id)
    time.sleep(0.3)
    assert not future.done() and ran == []  # it waits for that run to end
    assert runner.state("q1").status == "queued"
    assert runner.run(agent, run_id="q1").status == "final"
    assert future.result(5).status == "final" and ran == ["q1"]


def test_a_full_queue_refuses_with_a_clear_error(runner: bl.Runner) -> None:
    agent = bl.Agent("small", model=two_step(), max_queued=2)
    runner.enqueue(agent, prompt="1")
    runner.enqueue(agent, prompt="2")
    with pytest.raises(bl.AdmissionError, match="max_queued"):
        runner.enqueue(agent, prompt="3")
    assert len(list(runner.journal.runs())) == 2
    # another agent's queue is its own
    runner.enqueue(bl.Agent("big", model=two_step()), prompt="x")


def test_enqueue_takes_an_agent_only(runner: bl.Runner) -> None:
    with pytest.raises(bl.ConfigError, match="Agent"):
        runner.enqueue(two_step(), prompt="x")  # type: ignore[arg-type]


def test_runs_filters_by_label(journal_dir: Path) -> None:
    agent = bl.Agent("a", model=bl.ScriptedModel([bl.Final("x")] * 3))
    with bl.Runner(journal_dir) as runner:
        ids = [runner.run(agent, prompt="p", labels={"tenant": t}).run_id
               for t in ("acme", "initech", "acme")]
    out = CliRunner().invoke(cli, ["runs", "--journal", str(journal_dir), "--json",
                                   "--label", "tenant=acme"])
    assert out.exit_code == 0, out.output
    assert sorted(r["run_id"] for r in json.loads(out.output)) == sorted([ids[0], ids[2]])
    bad = CliRunner().invoke(cli, ["runs", "--journal", str(journal_dir), "--label", "acme"])
    assert bad.exit_code == 2


def test_stats_groups_finished_runs_by_label_and_by_agent(journal_dir: Path) -> None:
    a = bl.Agent("a", model=bl.ScriptedModel([bl.Final("x")] * 3))
    b = bl.Agent("b", model=bl.ScriptedModel([bl.Final("x")]))
    with bl.Runner(journal_dir) as runner:
        runner.run(a, prompt="p", labels={"tenant": "acme", "tier": "gold"})
        runner.run(a, prompt="p", labels={"tenant": "acme"})
        runner.run(a, prompt="p")
        runner.run(b, prompt="p", labels={"tenant": "initech"})
    by_label = CliRunner().invoke(cli, ["stats", "--journal", str(journal_dir), "--json",
                                        "--by", "label"])
    assert by_label.exit_code == 0, by_label.output
    groups = json.loads(by_label.output)["groups"]
    assert {k: g["runs"] for k, g in groups.items()} == {
        "tenant=acme": 2, "tier=gold": 1, "tenant=initech": 1, "(no labels)": 1}
    by_agent = CliRunner().invoke(cli, ["stats", "--journal", str(journal_dir), "--json",
                                        "--by", "agent"])
    assert {k: g["runs"] for k, g in json.loads(by_agent.output)["groups"].items()} == {
        "a": 3, "b": 1}
    text = CliRunner().invoke(cli, ["stats", "--journal", str(journal_dir), "--by", "label"])
    assert "tenant=acme" in text.output


def test_the_run_span_names_the_agent_and_carries_the_labels(journal_dir: Path) -> None:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    agent = bl.Agent("refunds", model=bl.ScriptedModel([bl.Final("x")]), version="7")
    with bl.Runner(journal_dir, telemetry=bl.Telemetry(tracer_provider=provider)) as runner:
        result = runner.run(agent, prompt="p", labels={"tenant": "acme"})
    [span] = [s for s in exporter.get_finished_spans()
              if s.attributes and s.attributes.get("gen_ai.operation.name") == "invoke_agent"]
    assert span.attributes is not None
    assert span.attributes["boundloop.run.id"] == result.run_id
    assert span.attributes["gen_ai.agent.name"] == "refunds"
    assert span.attributes["gen_ai.agent.version"] == "7"
    assert span.attributes["boundloop.run.label.tenant"] == "acme"


def test_following_an_existing_run_is_bounded_by_the_callers_deadline(
        runner: bl.Runner) -> None:
    nobody = bl.Agent("nobody", model=two_step())
    runner.enqueue(nobody, prompt="x", run_id="wait")
    caller = bl.Agent("other", model=two_step(), budget=bl.Budget(deadline_s=0.5))
    t0 = time.monotonic()
    with pytest.raises(bl.AdmissionError, match="deadline_s=0.5"):
        runner.run(caller, run_id="wait")
    assert time.monotonic() - t0 < 3
    assert runner.state("wait").status == "queued"  # it goes on as it is
    future = runner.submit(bl.Agent("other", model=two_step()), run_id="wait")
    time.sleep(0.2)
    assert future.cancel() or future.done()
