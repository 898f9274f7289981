"""DBOS Transact on the shared workload: durable tool rounds per second.

A ``@DBOS.workflow()`` runs the loop: a ``model`` step (a deterministic script standing in
for the LLM: one ``noop`` tool call per step for ``--rounds`` steps, then the answer
``done``) and, for each call, a ``tool`` step running the no-op tool; every step's output is
checkpointed in the system database before the workflow goes on, and the workflow's status
row is written at its start and end. Workflow id = run id.

System database: a SQLite file (``system_database_url="sqlite:///..."``). DBOS 3.4 opens
SQLite with ``isolation_level=IMMEDIATE`` and ``busy_timeout=30000`` but leaves the journal
mode at SQLite's default (rollback journal, ``DELETE``), so the file is switched to WAL here
before DBOS opens it (journal_mode=WAL is persistent in the file); the synchronous level is
SQLite's compiled default, FULL here (checked), and DBOS does not change it.

Concurrency (``--concurrency``): ``threads`` = worker threads calling the workflow function
(each runs in its caller's thread, as DBOS does for a direct call); ``start`` = runs started
with ``DBOS.start_workflow`` on DBOS's own executor, ``--inflight`` handles outstanding;
``async`` = ``async def`` workflow and steps, asyncio tasks on one loop; ``auto`` (default) =
``threads``: on the 2-core bench machine it was the fastest, or within noise, at 4 to 256 in
flight, with the least CPU per round. Writers wait on SQLite's lock through its busy handler
(sleeps of 1 to 100 ms), which is why p99 latency is high once several runs are in flight.
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import sys
from argparse import ArgumentParser, Namespace
from collections.abc import Callable
from importlib.metadata import version
from pathlib import Path
from typing import Any

import _common as c
from dbos import DBOS, DBOSConfig, SetWorkflowID

CALLS = c.Counter()


def script(done: int, rounds: int) -> dict[str, Any]:
    """The fake LLM's answer after ``done`` tool results: another call, or the final text."""
    if done < rounds:
        return {"tool_call": {"id": f"c{done}", "name": "noop", "args": {}}}
    return {"final": c.FINAL}


@DBOS.step()
def model(done: int, rounds: int) -> dict[str, Any]:
    """The model step."""
    return script(done, rounds)


@DBOS.step()
def tool(name: str, args: dict[str, Any]) -> str:
    """The tool step: the no-op tool."""
    CALLS.hit()
    return ""


@DBOS.workflow()
def agent_run(rounds: int) -> str:
    """One agent loop: model, tool, model, ... until the model answers."""
    done = 0
    while "final" not in (decision := model(done, rounds)):
        tool(decision["tool_call"]["name"], decision["tool_call"]["args"])
        done += 1
    return str(decision["final"])


@DBOS.step()
async def amodel(done: int, rounds: int) -> dict[str, Any]:
    """The model step (async)."""
    return script(done, rounds)


@DBOS.step()
async def atool(name: str, args: dict[str, Any]) -> str:
    """The tool step (async): the no-op tool."""
    CALLS.hit()
    return ""


@DBOS.workflow()
async def aagent_run(rounds: int) -> str:
    """One agent loop (async)."""
    done = 0
    while "final" not in (decision := await amodel(done, rounds)):
        await atool(decision["tool_call"]["name"], decision["tool_call"]["args"])
        done += 1
    return str(decision["final"])


def prepare(db: Path) -> None:
    """Create the system database file in WAL mode (DBOS would leave it in DELETE mode)."""
    with sqlite3.connect(db) as conn:
        mode = conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
    if mode != "wal":
        c.fail(f"could not put {db} in WAL mode: {mode}")


def run_sync(args: Namespace, start: bool) -> tuple[c.Timing, c.Timing]:
    def direct(run_id: str) -> str:
        with SetWorkflowID(run_id):
            return agent_run(args.rounds)

    def started(run_id: str) -> str:
        with SetWorkflowID(run_id):
            handle = DBOS.start_workflow(agent_run, args.rounds)
        return handle.get_result()

    run_one: Callable[[str], str] = started if start else direct
    warm = c.drive_sync(run_one, c.warmup_ids(args), args.inflight)
    return warm, c.drive_sync(run_one, c.timed_ids(args), args.inflight)


def run_async(args: Namespace) -> tuple[c.Timing, c.Timing]:
    async def main() -> tuple[c.Timing, c.Timing]:
        async def run_one(run_id: str) -> str:
            with SetWorkflowID(run_id):
                return await aagent_run(args.rounds)

        warm = await c.drive_async(run_one, c.warmup_ids(args), args.inflight)
        return warm, await c.drive_async(run_one, c.timed_ids(args), args.inflight)

    return asyncio.run(main())


def verify_db(args: Namespace, db: Path) -> dict[str, int]:
    """Fail unless the system database (WAL) holds every workflow, succeeded, and its steps."""
    runs = args.runs + args.warmup
    with sqlite3.connect(db) as conn:
        mode = conn.execute("PRAGMA journal_mode").fetchone()[0]
        sync = conn.execute("PRAGMA synchronous").fetchone()[0]
        ok = conn.execute("SELECT COUNT(*) FROM workflow_status "
                          "WHERE status = 'SUCCESS'").fetchone()[0]
        steps = conn.execute("SELECT COUNT(*) FROM operation_outputs").fetchone()[0]
    if mode != "wal" or sync != 2:
        c.fail(f"system db is journal_mode={mode} synchronous={sync}, not wal/2 (FULL)")
    if ok != runs:
        c.fail(f"system db holds {ok} successful workflows, expected {runs}")
    if steps != runs * (2 * args.rounds + 1):
        c.fail(f"system db holds {steps} step outputs, expected {runs * (2 * args.rounds + 1)}")
    return {"step_rows": steps}


def main() -> None:
    def extra(p: ArgumentParser) -> None:
        p.add_argument("--concurrency", choices=("auto", "threads", "start", "async"),
                       default="auto", help="how runs are kept in flight (see the docstring)")

    args = c.parse_args(__doc__.split("\n\n")[0], extra)
    conc = "threads" if args.concurrency == "auto" else args.concurrency
    db = (args.dir / "dbos_system.sqlite").resolve()
    prepare(db)
    config: DBOSConfig = {
        "name": "boundloop-bench",
        "system_database_url": f"sqlite:///{db}",
        "log_level": "WARNING",
        "enable_otlp": False,
    }
    logging.getLogger("dbos").setLevel(logging.WARNING)
    DBOS(config=config)
    DBOS.launch()
    try:
        warm, timing = run_async(args) if conc == "async" else run_sync(args, conc == "start")
    finally:
        DBOS.destroy(destroy_registry=True)
    c.check(args, timing, CALLS.value, warm)
    rows = verify_db(args, db)
    how = {"threads": "threads calling the workflow",
           "start": "DBOS.start_workflow on DBOS's executor",
           "async": "async workflow, asyncio tasks"}[conc]
    if args.inflight == 1:
        how = "sequential" + (" (async workflow)" if conc == "async" else "")
    c.report(args, peer="dbos", version=version("dbos"),
             mode=f"SQLite system db WAL synchronous=FULL, step checkpoints; {how}",
             timing=timing, **rows)


if __name__ == "__main__":
    sys.exit(main())
