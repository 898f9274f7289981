"""The journal contract's events: small factories of the events its tests append (shipped,
so a backend's own tests can make the same ones), and ``run_ids``."""

from __future__ import annotations

import time

import boundloop as bl
from boundloop import events as ev
from boundloop.journal.base import Journal


def admitted(run_id: str, *, owner: str = "", parent: str | None = None,
             ts: float = 0.0) -> ev.RunAdmitted:
    """A run's first event, owned by ``owner``."""
    return ev.RunAdmitted(run_id=run_id, ts=ts, budget=bl.Budget(max_model_steps=3),
                          history=[bl.UserMessage("hello")], tools=["search"], owner=owner,
                          parent_run_id=parent)


def step(run_id: str, n: int) -> ev.ModelStepStarted:
    """A small event to append: model step ``n`` started."""
    return ev.ModelStepStarted(run_id=run_id, step=n, tools_allowed=True,
                               reservation=bl.Usage(input_tokens=10 * n))


def finished(run_id: str, *, ts: float = 0.0, status: str = "final") -> ev.RunFinished:
    """The event that ends a run, at ``ts`` (epoch seconds), with ``status``."""
    return ev.RunFinished(run_id=run_id, ts=ts, status=status, exhausted_limit=None,
                          explanation="The model gave a final answer.", model_steps=1,
                          tool_calls=0)


def several(run_id: str) -> list[ev.Event]:
    """One event of many different types, in a plausible order."""
    eid = f"{run_id}:1:0"
    return [
        admitted(run_id, owner="host:1:abc"),
        ev.ModelStepStarted(run_id=run_id, ts=1.5, elapsed_s=0.25, step=1, tools_allowed=True,
                            reservation=bl.Usage(input_tokens=12, output_tokens=100)),
        ev.ModelStepCompleted(run_id=run_id, step=1, latency_s=0.01, response=bl.CallTools(
            [bl.ToolCall("c1", "search", {"query": "Paris", "limit": 3})],
            usage=bl.Usage(input_tokens=11, output_tokens=7))),
        ev.UsageCharged(run_id=run_id, step=1, usage=bl.Usage(input_tokens=11, output_tokens=7,
                                                              cache_read_tokens=2, cost=0.5)),
        ev.CallDecided(run_id=run_id, execution_id=eid, idempotency_key="k" * 32, step=1,
                       round=1, index=0, call_id="c1", tool="search",
                       arguments={"query": "Paris", "limit": 3, "nested": {"x": [1, 2.5]}},
                       decision="allow", read_only=True, idempotent=True),
        ev.CallDispatched(run_id=run_id, execution_id=eid, attempt=1),
        ev.CallSucceeded(run_id=run_id, execution_id=eid, attempt=1,
                         content=["sunny", {"temp": 21}], size=22, digest="ab" * 32),
        ev.RoundCompleted(run_id=run_id, step=1),
        ev.NoticeAdded(run_id=run_id, text="a notice"),
        ev.ModelStepFailed(run_id=run_id, step=2, reason="malformed", detail="no kind"),
        ev.ModelStepCompleted(run_id=run_id, step=3, response=bl.Final("done")),
        ev.ApprovalRequested(run_id=run_id, execution_id=eid, tool="search"),
        ev.ApprovalDecided(run_id=run_id, execution_id=eid, approved=True, by="alice",
                           note="fine"),
        ev.RunRequeued(run_id=run_id, ts=time.time()),
        finished(run_id, ts=time.time()),
    ]


def run_ids(journal: Journal) -> list[str]:
    """``journal.runs()`` as a list."""
    return list(journal.runs())
