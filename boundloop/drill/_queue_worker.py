"""A worker process of ``boundloop drill --queue``: a ``bl.Worker`` serving the drill's
agent (``python -m boundloop.drill queue-worker ...``)."""

from __future__ import annotations

import argparse
import json
import os
import random
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from types import FrameType
from typing import Any

from boundloop.core import kinds
from boundloop.drill._worker import as_pid
from boundloop.drill._workload import _append_line, drill_model, drill_tools, plan
from boundloop.results import RunResult
from boundloop.worker import Worker

#: One run in this many calls ``refund``, which waits for a person's approval.
APPROVAL_SHARE = 5

#: A SIGTERMed worker lets its running attempts end within this long (``grace_s``).
GRACE_S = 3.0

AGENT = "drill"

def queue_plan(run_id: str, seed: int) -> list[str]:
    """The drill's plan, with ``refund`` at a seeded step for one run in APPROVAL_SHARE."""
    order = plan(run_id, seed)
    rng = random.Random(f"{seed}:{run_id}:approval")
    if rng.randrange(APPROVAL_SHARE) == 0:
        order.insert(rng.randrange(len(order) + 1), "refund")
    return order


def drill_agent(ledger_path: Path, seed: int, worker: str = "w") -> Any:
    """The agent the queue drill's workers serve: the drill's model and tools (``worker``
    names whoever acts, in the ledger)."""
    import boundloop as bl

    return bl.Agent(AGENT, model=drill_model(seed, queue_plan, step_ids=True),
                    tools=drill_tools(ledger_path, worker, approvals=True),
                    budget=bl.Budget(max_model_steps=30, max_tool_calls=30), version="1")


def serve(journal: str, ledger_path: str, seed: int, concurrency: int, *, lease_s: float,
          name: str, notes: str, compress: bool = False) -> None:
    """A worker process: ``bl.Worker`` serving the drill agent until SIGTERM. It prints
    ``ready OWNER TIME`` once it serves (its signal handlers in place), ``leaving TIME`` when
    told to stop, and ``bye TIME`` once it has let its runs go."""
    worker = _NotingWorker(journal, [drill_agent(Path(ledger_path), seed, name)],
                           concurrency=concurrency, grace_s=GRACE_S, poll_s=0.05,
                           lease_s=lease_s, compress=compress,
                           max_in_flight=concurrency * 4)
    worker.name, worker.notes = name, notes

    def ready() -> None:
        runner = worker.runner if worker.wait_ready(120) else None
        if runner is not None:
            print(f"ready {runner.owner} {time.time():.6f}", flush=True)

    threading.Thread(target=ready, name="drill-ready", daemon=True).start()
    worker.serve()
    print(f"bye {time.time():.6f}", flush=True)


class _NotingWorker(Worker):
    """A Worker that notes each result it was given (for the acks check) and when it was
    told to leave (a takeover of its runs counts from then)."""

    name = "w"
    notes = ""

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if not self._stopping.is_set():
            # os.write, not print: a print in a signal handler may reenter another.
            os.write(1, f"leaving {time.time():.6f}\n".encode())
        super()._on_signal(signum, frame)

    def _reap(self) -> None:
        runner = self.runner
        for future in list(self._running.values()):
            if future.done() and runner is not None:
                _note_result(self.notes, self.name, runner.owner, future,
                             self._stopping.is_set())
        super()._reap()


def _note_result(notes: str, name: str, owner: str, future: Future[RunResult],
                 stopping: bool) -> None:
    """One line of ``notes`` per result a worker was given (as ``boundloop.drill`` notes);
    a run a stopping worker let go (it drained) is noted ``drained``, not as a lease that
    ran out (which its explanation says)."""
    if future.cancelled():
        return
    exc = future.exception()
    if exc is not None:
        record: dict[str, Any] = {"kind": "error", "where": "result", "error": repr(exc)}
    else:
        r = future.result()
        drained = stopping and kinds.is_journal_unavailable(r.status)
        record = {"kind": "drained" if drained else "result", "run_id": r.run_id,
                  "status": r.status, "tool_calls": r.tool_calls,
                  "model_steps": r.model_steps, "owner": owner,
                  "explanation": r.explanation if kinds.is_journal_unavailable(r.status) else ""}
    _append_line(notes, json.dumps({"worker": name, **record}))


def _serve_main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(prog="python -m boundloop.drill queue-worker")
    for name in ("journal", "ledger", "seed", "concurrency", "notes"):
        ap.add_argument(name)
    ap.add_argument("--lease", type=float, default=30.0)
    ap.add_argument("--compress", action="store_true")
    ap.add_argument("--name", default="w")
    ap.add_argument("--pid", type=int, default=0,
                    help="as pid 1 of a new pid namespace: run the worker as this pid")
    a = ap.parse_args(argv)
    as_pid(a.pid)
    serve(a.journal, a.ledger, int(a.seed), int(a.concurrency), lease_s=a.lease,
          name=a.name, notes=a.notes, compress=a.compress)
