"""LangGraph + SqliteSaver on the shared workload: durable tool rounds per second.

A ``StateGraph`` over ``MessagesState``-style state: a ``model`` node (a deterministic script
standing in for the LLM: one ``noop`` tool call per step for ``--rounds`` steps, then the
answer ``done``), the prebuilt ``ToolNode`` running the no-op tool, and ``tools_condition``
routing back to the model until it answers. Checkpointer: ``SqliteSaver`` (or
``AsyncSqliteSaver``) on a file with ``PRAGMA journal_mode=WAL`` and ``PRAGMA
synchronous=FULL``; every run is invoked with ``durability="sync"`` (each step's checkpoint
is committed before the next step starts) under its own ``thread_id``.

Concurrency (``--concurrency``): ``threads`` = worker threads sharing one compiled graph and
one saver on one connection (``check_same_thread=False``; the saver serialises on its lock);
``threads-conn`` = worker threads, each with its own connection and saver on the same file;
``async`` = ``AsyncSqliteSaver`` (aiosqlite) with ``graph.ainvoke`` in asyncio tasks; ``auto``
(default) = ``threads``: on the 2-core bench machine it was the fastest or tied at 4 to 256
in flight (SQLite takes one writer at a time and has no group commit, so extra connections
only add lock waits; the async saver adds a thread hop per query).
"""

from __future__ import annotations

import asyncio
import sqlite3
import sys
import threading
from argparse import ArgumentParser, Namespace
from importlib.metadata import version
from pathlib import Path
from typing import Annotated, Any, TypedDict

import _common as c
from langchain_core.messages import AIMessage, AnyMessage, ToolMessage
from langchain_core.tools import tool
from langgraph.checkpoint.sqlite import SqliteSaver
from langgraph.graph import START, StateGraph
from langgraph.graph.message import add_messages
from langgraph.prebuilt import ToolNode, tools_condition

CALLS = c.Counter()


class State(TypedDict):
    """The graph state: the conversation, appended to by each node."""

    messages: Annotated[list[AnyMessage], add_messages]


@tool
def noop() -> str:
    """Does nothing."""
    CALLS.hit()
    return ""


@tool("noop")
async def anoop() -> str:
    """Does nothing."""
    CALLS.hit()
    return ""


def make_model(rounds: int) -> Any:
    """The scripted model node: a tool call while fewer than ``rounds`` results came back."""

    def model(state: State) -> dict[str, list[AnyMessage]]:
        done = sum(isinstance(m, ToolMessage) for m in state["messages"])
        if done < rounds:
            call = {"name": "noop", "args": {}, "id": f"c{done}", "type": "tool_call"}
            return {"messages": [AIMessage(content="", tool_calls=[call])]}
        return {"messages": [AIMessage(content=c.FINAL)]}

    return model


def build(rounds: int, *, asynchronous: bool) -> StateGraph:
    """The agent graph: model -> tools -> model ... -> END."""
    g = StateGraph(State)
    model = make_model(rounds)
    if asynchronous:
        async def amodel(state: State) -> dict[str, list[AnyMessage]]:
            return model(state)  # type: ignore[no-any-return]
        g.add_node("model", amodel)
        g.add_node("tools", ToolNode([anoop]))
    else:
        g.add_node("model", model)
        g.add_node("tools", ToolNode([noop]))
    g.add_edge(START, "model")
    g.add_conditional_edges("model", tools_condition)
    g.add_edge("tools", "model")
    return g


def connect(path: Path) -> sqlite3.Connection:
    """A connection to the checkpoint file, WAL and synchronous=FULL."""
    conn = sqlite3.connect(path, check_same_thread=False, timeout=60)
    mode = conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
    conn.execute("PRAGMA synchronous=FULL")
    sync = conn.execute("PRAGMA synchronous").fetchone()[0]
    if (mode, sync) != ("wal", 2):
        c.fail(f"checkpoint db is journal_mode={mode} synchronous={sync}, not wal/2 (FULL)")
    return conn


def inputs() -> dict[str, Any]:
    return {"messages": [("user", "go")]}


def config(run_id: str) -> Any:
    return {"configurable": {"thread_id": run_id}, "recursion_limit": 1000}


def answer(out: dict[str, Any]) -> str:
    return str(out["messages"][-1].content)


def run_threads(args: Namespace, db: Path, per_conn: bool) -> tuple[c.Timing, c.Timing]:
    """Workers on threads; one shared saver, or (``per_conn``) one saver per thread."""
    graph_def = build(args.rounds, asynchronous=False)
    shared = graph_def.compile(checkpointer=SqliteSaver(connect(db)))
    local = threading.local()

    def graph() -> Any:
        if not per_conn:
            return shared
        if not hasattr(local, "graph"):
            local.graph = graph_def.compile(checkpointer=SqliteSaver(connect(db)))
        return local.graph

    def run_one(run_id: str) -> str:
        return answer(graph().invoke(inputs(), config(run_id), durability="sync"))

    warm = c.drive_sync(run_one, c.warmup_ids(args), args.inflight)
    return warm, c.drive_sync(run_one, c.timed_ids(args), args.inflight)


def run_async(args: Namespace, db: Path) -> tuple[c.Timing, c.Timing]:
    """Asyncio tasks over one ``AsyncSqliteSaver`` (aiosqlite: one connection, own thread)."""
    import aiosqlite
    from langgraph.checkpoint.sqlite.aio import AsyncSqliteSaver

    async def main() -> tuple[c.Timing, c.Timing]:
        async with aiosqlite.connect(db, timeout=60) as conn:
            await conn.execute("PRAGMA journal_mode=WAL")
            await conn.execute("PRAGMA synchronous=FULL")
            async with conn.execute("PRAGMA synchronous") as cur:
                row = await cur.fetchone()
            if row is None or row[0] != 2:
                c.fail(f"async checkpoint connection has synchronous={row}, not 2 (FULL)")
            graph = build(args.rounds, asynchronous=True).compile(
                checkpointer=AsyncSqliteSaver(conn))

            async def run_one(run_id: str) -> str:
                out = await graph.ainvoke(inputs(), config(run_id), durability="sync")
                return answer(out)

            warm = await c.drive_async(run_one, c.warmup_ids(args), args.inflight)
            return warm, await c.drive_async(run_one, c.timed_ids(args), args.inflight)

    return asyncio.run(main())


def verify_db(args: Namespace, db: Path) -> dict[str, int]:
    """Fail unless the checkpoint file holds every run's thread and its final checkpoint."""
    with sqlite3.connect(db) as conn:
        threads = conn.execute("SELECT COUNT(DISTINCT thread_id) FROM checkpoints").fetchone()[0]
        checkpoints = conn.execute("SELECT COUNT(*) FROM checkpoints").fetchone()[0]
        writes = conn.execute("SELECT COUNT(*) FROM writes").fetchone()[0]
    if threads != args.runs + args.warmup:
        c.fail(f"checkpoint db holds {threads} threads, expected {args.runs + args.warmup}")
    # input + one per model step (rounds + 1) and tool step (rounds) = 2 * rounds + 2 at least
    if checkpoints < threads * (2 * args.rounds + 2):
        c.fail(f"checkpoint db holds {checkpoints} checkpoints for {threads} threads, expected "
               f"at least {2 * args.rounds + 2} each")
    last = SqliteSaver(sqlite3.connect(db)).get_tuple(config("run-0"))
    if last is None or last.checkpoint["channel_values"]["messages"][-1].content != c.FINAL:
        c.fail("the checkpoint of run-0 does not end with the final answer")
    return {"checkpoints": checkpoints, "writes": writes}


def main() -> None:
    def extra(p: ArgumentParser) -> None:
        p.add_argument("--concurrency", choices=("auto", "threads", "threads-conn", "async"),
                       default="auto", help="how runs are kept in flight (see the docstring)")

    args = c.parse_args(__doc__.split("\n\n")[0], extra)
    conc = "threads" if args.concurrency == "auto" else args.concurrency
    db = args.dir / "checkpoints.sqlite"
    if conc == "async":
        warm, timing = run_async(args, db)
    else:
        warm, timing = run_threads(args, db, per_conn=conc == "threads-conn")
    c.check(args, timing, CALLS.value, warm)
    rows = verify_db(args, db)
    how = {"threads": "threads sharing one SqliteSaver connection",
           "threads-conn": "threads, one SqliteSaver connection each",
           "async": "asyncio tasks on AsyncSqliteSaver"}[conc]
    if args.inflight == 1:
        how = "sequential" + (" (AsyncSqliteSaver)" if conc == "async" else "")
    c.report(args, peer="langgraph", version=version("langgraph"),
             mode=f"SqliteSaver WAL synchronous=FULL, durability=sync; {how}",
             timing=timing, **rows)


if __name__ == "__main__":
    sys.exit(main())
