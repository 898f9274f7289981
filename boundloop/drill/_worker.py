"""A worker process of ``boundloop drill``: drives its runs and keeps taking orphans over
(``python -m boundloop.drill worker ...``)."""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import wait as wait_all
from pathlib import Path
from typing import Any

from boundloop.core import kinds
from boundloop.drill._workload import _append_line, drill_model, drill_tools
from boundloop.results import RunResult


def worker(journal: str, ledger_path: str, runs_file: str, seed: int, concurrency: int,
           log: str, *, lease_s: float = 30.0, name: str = "w", notes: str | None = None,
           linger: str | None = None, compress: bool = False) -> None:
    """A worker: take over orphans it can, start its runs not yet in the journal, and
    keep taking over orphans (every ``lease_s / 2``) until its runs are done.

    ``log`` gets a line per recovered run; ``notes`` (a jsonl file) a line per RunResult
    this worker was given and per unexpected error. When the file ``linger`` exists once
    its runs are done, the worker stays, taking over, until no run is open.

    On a PostgreSQL journal (a URL) the server may be down for a while (the drill restarts
    it): what the worker itself asks the journal is asked again until it answers
    (``unavailable`` notes, not errors), a run whose admission failed without being
    recorded is submitted again, and the runs in flight end as the Runner ends them
    (``journal_unavailable``) and are resumed by the sweeps.
    """
    from boundloop.errors import BoundloopError, JournalUnavailable
    from boundloop.journal.postgres import is_url
    from boundloop.runner import Runner

    tools = drill_tools(Path(ledger_path), name)
    model = drill_model(seed)
    shared = is_url(journal)  # a server that may restart under the worker

    def note(record: dict[str, Any]) -> None:
        if notes is not None:
            _append_line(notes, json.dumps({"worker": name, **record}))

    def asking(fn: Callable[[], Any], where: str) -> Any:
        """``fn()``, asked again while a shared journal's server is down (up to a minute)."""
        give_up = time.monotonic() + 60
        while True:
            try:
                return fn()
            except JournalUnavailable as exc:
                if not shared or time.monotonic() > give_up:
                    raise
                note({"kind": "unavailable", "where": where, "error": repr(exc)})
                time.sleep(0.1)

    runner = asking(lambda: Runner(journal, max_in_flight=concurrency * 4, lease_s=lease_s,
                                   compress=compress), "open")
    with runner:
        print(f"ready {runner.owner} {time.time():.6f}", flush=True)
        resumed: list[Future[RunResult]] = []
        lock = threading.Lock()

        def acked(future: Future[RunResult]) -> RunResult | None:
            try:
                r = future.result()
            except Exception as exc:  # noqa: BLE001 - noted, and counted as a failure
                note({"kind": "error", "where": "result", "error": repr(exc)})
                return None
            note({"kind": "result", "run_id": r.run_id, "status": r.status,
                  "tool_calls": r.tool_calls, "model_steps": r.model_steps,
                  "owner": runner.owner,
                  "explanation": r.explanation if kinds.is_journal_unavailable(r.status) else ""})
            return r

        def sweep() -> None:
            try:
                recovered = runner.recover()
            except JournalUnavailable as exc:
                if not shared:
                    raise
                note({"kind": "unavailable", "where": "recover", "error": repr(exc)})
                return  # the next sweep asks again
            except BoundloopError as exc:
                note({"kind": "error", "where": "recover", "error": repr(exc)})
                return
            for r in recovered:
                _append_line(log, json.dumps({"run_id": r.run_id, "by": name, "unresolved": [
                    [u.idempotency_key, u.tool, u.phase] for u in r.unresolved]}))
                try:
                    future = runner.submit_resume(r.run_id, model, tools)
                except BoundloopError:
                    continue  # claimed by another runner meanwhile, or in flight here
                with lock:
                    resumed.append(future)

        stop = threading.Event()

        def settled() -> None:
            with lock:
                done = [f for f in resumed if f.done()]
                resumed[:] = [f for f in resumed if not f.done()]
            for f in done:
                acked(f)

        def sweeping() -> None:
            while not stop.wait(lease_s / 2):
                try:
                    settled()
                    sweep()
                except Exception as exc:  # noqa: BLE001 - noted, and the sweeps go on
                    note({"kind": "error", "where": "sweep", "error": repr(exc)})

        sweep()
        sweeper = threading.Thread(target=sweeping, name="drill-sweeper", daemon=True)
        sweeper.start()
        todo = [r for r in Path(runs_file).read_text().split()
                if asking(functools.partial(runner.journal.find, r), "find") is None]
        while todo:
            batch = [(r, runner.submit(model, tools, "run the plan", run_id=r))
                     for r in todo[:concurrency]]
            todo = todo[concurrency:]
            wait_all([f for _, f in batch])
            for run_id, future in batch:
                result = acked(future)
                if shared and result is not None and kinds.is_journal_unavailable(result.status) \
                        and asking(functools.partial(runner.journal.find, run_id),
                                   "find") is None:
                    todo.append(run_id)  # its admission was not recorded: submit it again
        print("idle", flush=True)  # its own runs are done
        if linger is not None and Path(linger).exists():
            # The last workers: stay until every run is done, taking over what is left.
            give_up = time.monotonic() + 60 + 20 * lease_s
            while time.monotonic() < give_up:
                with lock:
                    busy = any(not f.done() for f in resumed)
                if not busy and next(iter(asking(runner.journal.open_runs, "open_runs")),
                                     None) is None:
                    break
                time.sleep(lease_s / 4)
        stop.set()
        sweeper.join()
        with lock:
            wait_all(list(resumed))
        settled()
        # Closing gives up the runs still open here (the owner record goes): another
        # worker's claim from now on is of a runner that left, not of a frozen one.
        print(f"leaving {time.time():.6f}", flush=True)
    print(f"bye {time.time():.6f}", flush=True)


def _worker_main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(prog="python -m boundloop.drill worker")
    for name in ("journal", "ledger", "runs_file", "seed", "concurrency", "log"):
        ap.add_argument(name)
    ap.add_argument("--lease", type=float, default=30.0)
    ap.add_argument("--compress", action="store_true")
    ap.add_argument("--name", default="w")
    ap.add_argument("--notes", default=None)
    ap.add_argument("--linger", default=None)
    ap.add_argument("--pid", type=int, default=0,
                    help="as pid 1 of a new pid namespace: run the worker as this pid")
    a = ap.parse_args(argv)
    as_pid(a.pid)
    worker(a.journal, a.ledger, a.runs_file, int(a.seed), int(a.concurrency), a.log,
           lease_s=a.lease, name=a.name, notes=a.notes, linger=a.linger, compress=a.compress)


def as_pid(pid: int) -> None:
    """As pid 1 of a new pid namespace, go on as a child of pid ``pid`` (see _TidBlocks);
    pid 1 waits for it and exits as it does."""
    if pid > 1 and os.getpid() == 1:
        with open("/proc/sys/kernel/ns_last_pid", "w") as f:
            f.write(str(pid - 1))
        child = os.fork()
        if child:
            _, status = os.waitpid(child, 0)
            sys.stdout.flush()
            os._exit(os.waitstatus_to_exitcode(status) & 0xFF)
