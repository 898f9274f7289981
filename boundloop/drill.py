"""``boundloop drill``: a crash-recovery and ownership drill anyone can run.

Worker processes drive many runs on one journal; their tools append one ledger line per
real side effect, keyed by idempotency key and stamped with the run, the fencing epoch
(``ctx.epoch``), the worker and the moment the handler started (``charge`` is idempotent,
``ship`` irreversible, ``book`` has ``reconcile``). The drill injects faults at random
moments: SIGKILL (the worker is restarted), and with ``--pause`` SIGSTOP past the lease
(the other workers take its runs over; then SIGCONT, and it wakes as a zombie). Every
worker keeps taking over orphaned runs while it works (``recover`` + ``resume`` every half
lease). At the end a "person" resolves what needs review from the ledger (the ground
truth). Then the journal is checked against the ledger and the workers' own logs:

* nothing irreversible ran twice, nothing ran without a recorded intent, the journal never
  says an action did (not) happen when the ledger says otherwise;
* every run is whole (sequences 1..n, the strict fold replays it, its RunFinished matches
  the fold), its claims raise the epoch by exactly one each time;
* every result a worker was given (``final``, ``needs_review``...) is in the journal, in
  the stretch that worker owned (no acknowledged append lost);
* every ``CallSucceeded`` recorded at epoch *k* is backed by a side effect executed at
  epoch *k* (a zombie's late append was never accepted); the refusals the zombies saw
  (``LeaseLost``) are counted;
* no attempt started after its run was claimed by a later epoch (a zombie execution; a
  handler already running when its worker froze may finish: review, reconcile and the
  downstream's fencing, see Downstream, settle that);
* every takeover came within lease + claim interval (+ slack) of its owner's death or
  freeze.

For a paused worker to be taken over it must be judged by its lease: with ``--pause`` each
worker runs in its own pid namespace (``unshare --pid --fork --mount-proc``, as a container
would) when this process is root and unshare(1) works. On one pid namespace a paused worker
is alive by SPEC 6 (its process exists), so it is never taken over; the pauses are injected
all the same and the report says so.

On LMDB the journal is ``<dir>/journal``; a probe process tells when a frozen worker holds
LMDB's writer lock (the pause is then let go at once), and each worker's pid namespace gets
its own range of thread ids (_TidBlocks). On PostgreSQL (``--journal postgresql://...``)
the drill creates a fresh database for the run, every worker's journal is its URL, and
neither is needed (the server ends a frozen worker's open transaction, see
``boundloop.journal.postgres``); with ``--pgdata`` (or ``--pg-restart-cmd``) some faults
are crash-restarts of the server (``pg_ctl restart -m immediate``), and the time the server
was down is left out of the takeover bound and reported apart. A worker asks the journal
again while the server is down; its runs in flight end ``journal_unavailable`` (fail
closed) and the sweeps resume them.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import functools
import json
import os
import random
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from concurrent.futures import wait as wait_all
from pathlib import Path
from typing import Any, NamedTuple

import msgspec

from boundloop import events as ev
from boundloop.messages import CallTools, Final, Message, ToolCall
from boundloop.tools import Tool, ToolContext, tool

TOOLS = ("charge", "ship", "book")
ARGS: dict[str, dict[str, Any]] = {"charge": {"amount": 7}, "ship": {"item": "parcel"},
                                   "book": {"room": "r1"}, "refund": {"amount": 3}}
#: A takeover may come this much later than lease + claim interval on a loaded machine: a
#: sweep reads every open run, and a worker that just said it is ready needs ~0.5 s to sweep.
SLACK_S = 1.0
#: Pauses last this many leases (some end before a takeover, most after one).
PAUSE_LEASES = (1.2, 2.5)
#: How long a probe may wait for the locks the workers share before the drill concludes the
#: frozen worker holds one (and lets it go at once: a pause inside an LMDB commit or
#: reader-slot registration stalls every process of the journal, which is not the fault
#: under test).
WRITE_LOCK_PROBE_S = 0.25
#: An attempt dispatched before its worker froze, whose handler started at most this long
#: after the worker woke from that pause (which began before the claim), passed the
#: runner's gate before the freeze (see _check): ``attempts_frozen_at_start``, not a zombie
#: execution.
FROZEN_START_S = 0.1
#: Explanations of a run that stopped because of its ownership (SPEC 6).
REFUSED = "this runner stopped driving it"  # the journal refused a fenced append
SELF_FENCED = "fenced itself"  # the runner's own lease ran out: it started nothing more


class DrillReport(msgspec.Struct):
    """What the drill found; ``ok`` is False when any invariant failed.

    The ownership fields (SPEC 6): ``faults_injected`` is ``crashes_injected`` (SIGKILLs)
    plus ``pauses_injected`` (SIGSTOPs past the lease; ``pauses_backed_off`` were let go at
    once because the frozen worker held a lock every worker needs, see _WriteLockProbe).
    ``takeovers`` counts claims by workers (by cause: after a kill, a pause, or of an owner
    alive and not frozen whose lease ran out; a worker that left a run it had fenced itself
    off is the rest); ``takeovers_at_end`` the person's claims, for review.
    ``zombie_appends_refused`` counts runs a woken worker found fenced by the journal
    (LeaseLost), ``self_fenced`` runs it stopped itself (its lease ran out);
    ``zombie_appends_accepted`` CallSucceeded events recorded at an epoch that did not
    execute them. ``zombie_executions`` counts attempts (done or refused downstream,
    ``late_attempts_refused``) that started after a later epoch claimed their run, but for
    ``attempts_frozen_at_start``: attempts dispatched before their worker froze, whose
    handlers started just after it woke from that pause, which began before the claim
    (frozen between the runner's gate and the handler's first line, see FROZEN_START_S).
    ``epoch_mismatches`` counts side effects run under an epoch their worker never held,
    ``epoch_gaps`` claims that did not raise the epoch by one. ``acks_lost`` counts results
    a worker was given whose RunFinished is not in the journal. ``max_unowned_s`` is the
    longest time from a worker's death or freeze (or exit) to the claim of a run it left,
    counting only the time in which another worker was able to claim it (ready, neither
    frozen nor dead), checked against ``unowned_bound_s``: lease + claim interval
    (lease / 2) + SLACK_S; ``max_unowned_wall_s`` is the same on the wall clock, including
    the moments when every worker was frozen, killed or starting.

    On PostgreSQL (``journal``; ``database`` is the one made for the drill),
    ``restarts_injected`` counts server crash-restarts (``pg_ctl -m immediate``), part of
    ``faults_injected``; ``server_down_s`` is the time the server was down in all, from each
    restart to the first connection it accepted again. That time is not counted in
    ``max_unowned_s`` (nobody can claim anything then) but apart:
    ``max_unowned_server_down_s`` is the most of it within one takeover's wait.
    ``journal_unavailable_retries`` counts the questions a worker asked the journal again
    because the server was down, ``runs_unavailable`` the runs a worker saw end
    ``journal_unavailable`` for another reason than their ownership (they fail closed; a
    sweep resumes them).
    """

    runs: int
    crashes_injected: int = 0
    runs_recovered: int = 0
    unresolved_found: int = 0
    unresolved_missed: int = 0
    unresolved_spurious: int = 0
    reconciled_automatically: int = 0
    sent_to_review: int = 0
    retried_idempotent: int = 0
    executed_without_intent: int = 0
    duplicate_executions: int = 0
    events_lost: int = 0
    replay_mismatches: int = 0
    runs_not_final: int = 0
    elapsed_s: float = 0.0
    # -- ownership (SPEC 6) ---------------------------------------------------------------
    workers: int = 2
    lease_s: float = 1.0
    pid_namespaces: bool = False
    #: The workers stored the journal's records compressed (``--compress``).
    compress: bool = False
    faults_injected: int = 0
    pauses_injected: int = 0
    pauses_backed_off: int = 0
    worker_lives: int = 0
    takeovers: int = 0
    takeovers_after_kill: int = 0
    takeovers_after_pause: int = 0
    takeovers_of_live_owners: int = 0
    takeovers_at_end: int = 0
    zombie_appends_refused: int = 0
    zombie_appends_accepted: int = 0
    self_fenced: int = 0
    zombie_executions: int = 0
    attempts_frozen_at_start: int = 0
    late_attempts_refused: int = 0
    epoch_mismatches: int = 0
    epoch_gaps: int = 0
    acks_checked: int = 0
    acks_lost: int = 0
    worker_errors: int = 0
    max_unowned_s: float = 0.0
    max_unowned_wall_s: float = 0.0
    unowned_bound_s: float = 0.0
    takeovers_over_bound: int = 0
    # -- a PostgreSQL journal (SPEC 12) -------------------------------------------------------
    journal: str = "lmdb"
    database: str = ""
    restarts_planned: int = 0
    restarts_injected: int = 0
    server_down_s: float = 0.0
    max_unowned_server_down_s: float = 0.0
    journal_unavailable_retries: int = 0
    runs_unavailable: int = 0
    notes: list[str] = msgspec.field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when every invariant held."""
        return not (self.unresolved_missed or self.unresolved_spurious
                    or self.executed_without_intent or self.duplicate_executions
                    or self.events_lost or self.replay_mismatches or self.runs_not_final
                    or self.zombie_appends_accepted or self.zombie_executions
                    or self.epoch_mismatches or self.epoch_gaps or self.acks_lost
                    or self.worker_errors or self.max_unowned_s > self.unowned_bound_s)


# -- what runs inside a worker ------------------------------------------------------------
def plan(run_id: str, seed: int) -> list[str]:
    """The tools a run calls, one per step, in a seeded order."""
    order = list(TOOLS)
    random.Random(f"{seed}:{run_id}").shuffle(order)
    return order


def drill_model(seed: int, plan_of: Callable[[str, int], list[str]] = plan,
                step_ids: bool = False) -> Callable[[list[Message], Any], Any]:
    """A model that reads its next step (of ``plan_of(run_id, seed)``) off the history, so
    a resumed run continues. With ``step_ids`` its call ids name the model step too: a
    round that a draining worker skipped is left out of the history, but its call ids stay
    reserved, so the same step asked again needs new ones (as a real model's would be)."""

    def model(history: list[Message], ctx: Any) -> Any:
        names = plan_of(ctx.run_id, seed)
        done = sum(1 for m in history if m.kind == "tool_result")
        if done >= len(names):
            return Final("all done")
        name = names[done]
        call_id = f"c{done + 1}-{ctx.step}" if step_ids else f"c{done + 1}"
        return CallTools([ToolCall(call_id, name, ARGS[name])])

    return model


class Effect(NamedTuple):
    """One real side effect, as its ledger line says."""

    key: str
    tool: str
    run_id: str = ""
    epoch: int = 0
    worker: str = ""
    started: float = 0.0  # wall-clock time the handler started


def effects(path: Path) -> list[Effect]:
    """Every real side effect so far, in ledger order."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        f = line.split()
        if len(f) >= 6:
            out.append(Effect(f[0], f[1], f[2], int(f[3]), f[4], float(f[5])))
        elif len(f) >= 2:
            out.append(Effect(f[0], f[1]))
    return out


def ledger(path: Path) -> list[tuple[str, str]]:
    """Every real side effect so far: (idempotency key, tool)."""
    return [(e.key, e.tool) for e in effects(path)]


def ledger_size(path: Path) -> int:
    """How many side effects the ledger holds (lines), cheaply."""
    try:
        with open(path, "rb") as f:
            return f.read().count(b"\n")
    except FileNotFoundError:
        return 0


def _append_line(path: Path | str, text: str) -> None:
    """One line in one write(2) on an O_APPEND file: whole, even if the process dies."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, (text + "\n").encode())
    finally:
        os.close(fd)


class StaleAttempt(Exception):
    """The downstream refused an attempt: its key was seen at a later epoch, or it was
    reconciled (and so fenced) as not done."""


class Downstream:
    """What the drill's tools act on: a ledger of real side effects that honours the
    fencing token (SPEC 6), as a careful downstream system would.

    Per idempotency key it keeps the highest epoch seen, and refuses an attempt of a lower
    epoch (a zombie's late attempt, after a takeover retried the key). Its reconcile says
    whether the key took effect and, if not, fences the key: ``reconcile`` is given the key
    alone, so this is the only way a late attempt of the old owner (frozen inside its
    handler, still running) cannot land after the new owner was told "not done". Refused
    attempts go to ``<ledger>.refused``. One lock file serialises it across processes.
    """

    def __init__(self, ledger_path: Path) -> None:
        self.ledger = ledger_path
        self.refused = ledger_path.with_name(ledger_path.name + ".refused")
        self.keys = ledger_path.with_name(ledger_path.name + ".keys")
        self.lock = ledger_path.with_name(ledger_path.name + ".lock")

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        fd = os.open(self.lock, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # and the lock with it (a killed holder releases it too)

    def _seen(self, key: str) -> str:
        try:
            return (self.keys / key).read_text()
        except FileNotFoundError:
            return ""

    def _mark(self, key: str, value: str) -> None:
        self.keys.mkdir(exist_ok=True)
        tmp = self.keys / f".{key}.{os.getpid()}"
        tmp.write_text(value)
        os.replace(tmp, self.keys / key)

    def act(self, key: str, epoch: int, line: str) -> None:
        """Perform the side effect ``line`` describes, unless its epoch is stale."""
        with self._locked():
            seen = self._seen(key)
            if seen == "fenced" or (seen and int(seen) > epoch):
                _append_line(self.refused, line)
                raise StaleAttempt(f"key {key} is at epoch {seen}; attempt of epoch {epoch} "
                                   "refused")
            if not seen or int(seen) < epoch:
                self._mark(key, str(epoch))  # first: a kill after it leaves no effect
            _append_line(self.ledger, line)

    def reconcile(self, key: str) -> bool:
        """Whether ``key`` took effect; when not, no attempt of it ever will."""
        with self._locked():
            if any(k == key for k, _ in ledger(self.ledger)):
                return True
            self._mark(key, "fenced")
            return False


def drill_tools(ledger_path: Path, worker: str = "w", approvals: bool = False) -> list[Tool]:
    """The drill's tools: each appends one ledger line per real side effect. With
    ``approvals`` also ``refund``, irreversible, which waits for a person's approval."""
    rng = random.Random()
    downstream = Downstream(ledger_path)

    def act(name: str, ctx: ToolContext) -> str:
        started = time.time()  # first thing: a zombie execution is one that started late
        time.sleep(rng.random() * 0.004)
        downstream.act(ctx.idempotency_key, ctx.epoch,
                       f"{ctx.idempotency_key} {name} {ctx.run_id} {ctx.epoch} {worker} "
                       f"{started:.6f}")
        time.sleep(rng.random() * 0.004)
        return f"{name} done"

    @tool(idempotent=True, timeout_s=10)
    def charge(amount: int, ctx: ToolContext) -> str:
        return act("charge", ctx)

    @tool(irreversible=True, timeout_s=10)
    def ship(item: str, ctx: ToolContext) -> str:
        return act("ship", ctx)

    def booked(key: str) -> str | None:
        return "book done" if downstream.reconcile(key) else None

    @tool(reconcile=booked, timeout_s=10)
    def book(room: str, ctx: ToolContext) -> str:
        return act("book", ctx)

    @tool(irreversible=True, needs_approval=True, timeout_s=10)
    def refund(amount: int, ctx: ToolContext) -> str:
        return act("refund", ctx)

    return [charge, ship, book, refund] if approvals else [charge, ship, book]


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
    from boundloop.results import RunResult
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
                  "explanation": r.explanation if r.status == "journal_unavailable" else ""})
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
                if shared and result is not None and result.status == "journal_unavailable" \
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


# -- the drill ----------------------------------------------------------------------------
def can_unshare() -> bool:
    """True when workers can get pid namespaces of their own (root and unshare(1))."""
    if shutil.which("unshare") is None or os.geteuid() != 0:
        return False
    try:
        return subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"],
                              capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


class _Life(msgspec.Struct):
    """One worker process, from spawn to exit."""

    name: str
    slot: int
    piece: list[str]
    proc: Any
    out: Path
    err: Path
    owner: str = ""
    ready_at: float = 0.0  # when it said it was ready (its Runner open, sweeping)
    killed_at: float = 0.0
    exited_at: float = 0.0
    pauses: list[list[float]] = msgspec.field(default_factory=list)  # [stopped, resumed]
    resume_at: float = 0.0
    idle: bool = False  # its own runs are done (it may linger, taking over)

    @property
    def paused(self) -> bool:
        return bool(self.pauses) and self.pauses[-1][1] == 0.0

    def ready(self) -> bool:
        if not self.owner:
            try:
                words = self.out.read_text().split()
            except OSError:
                return False
            if len(words) >= 3 and words[0] == "ready":
                self.owner, self.ready_at = words[1], float(words[2])
        return bool(self.owner)

    def left_at(self) -> float:
        """When the worker began to leave (it printed ``leaving``, else ``bye``), 0.0 when it
        never did (killed, or still running)."""
        try:
            words = self.out.read_text().split()
        except OSError:
            return 0.0
        for word in ("leaving", "bye"):
            if word in words[:-1]:
                return float(words[words.index(word) + 1])
        return 0.0

    def able(self) -> list[tuple[float, float]]:
        """The stretches of time in which this worker could take runs over: ready, not
        frozen, not yet killed or gone."""
        if not self.ready_at:
            return []
        end = self.killed_at or self.exited_at or float("inf")
        stretches, t = [], self.ready_at
        for stopped, resumed in sorted(self.pauses):
            if stopped > t:
                stretches.append((t, min(stopped, end)))
            t = max(t, resumed or float("inf"))
        if t < end:
            stretches.append((t, end))
        return [(a, b) for a, b in stretches if a < b]

    def working(self) -> bool:
        """True until the worker says its own runs are done."""
        if not self.idle and self.ready():
            self.idle = "idle" in self.out.read_text().split()
        return not self.idle

    def signal(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass


class _Lines:
    """Counts the lines of a growing file, reading only what was added."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset, self.count = path, 0, 0

    def __call__(self) -> int:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return self.count
        self.offset += len(data)
        self.count += data.count(b"\n")
        return self.count


_PROBE = r"""
import fcntl, os, struct, sys, lmdb
env = lmdb.open(sys.argv[1], map_size=1 << 30, max_dbs=8, subdir=True, create=False)
# Opened once: closing a descriptor of lock.mdb would drop this process's LMDB locks on it.
lock = os.open(os.path.join(sys.argv[1], "lock.mdb"), os.O_RDWR)
def ofd(kind):
    fcntl.fcntl(lock, fcntl.F_OFD_SETLKW, struct.pack("hhqqi4x", kind, 0, 1 << 40, 1, 0))
for _ in sys.stdin:
    ofd(fcntl.F_WRLCK)  # boundloop's own write lock (journal.lmdb._WriteLock), taken first
    ofd(fcntl.F_UNLCK)
    for _ in range(3):
        try:
            env.begin(write=True).abort()  # the writer's mutex
            # Two readers at once: the second takes a new reader slot, under the reader
            # table's mutex (the first reuses the spare one).
            a = env.begin()
            env.begin().abort()
            a.abort()
            break
        except lmdb.MapResizedError:
            env.set_mapsize(0)
    fd = os.open(sys.argv[2], os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)  # the drill's downstream
    os.close(fd)
    sys.stdout.write("ok\n")
    sys.stdout.flush()
"""


class _WriteLockProbe:
    """Tells whether the locks every worker shares can be taken: boundloop's write lock, the
    journal's writer and reader-table mutexes (LMDB) and the downstream's lock. A process of
    its own: LMDB allows one environment per process, and the drill's own Runner comes
    later."""

    def __init__(self, journal: Path, downstream: Path) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", _PROBE, str(journal),
                                      str(downstream)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def free(self, timeout: float, on_wait: Callable[[], None],
             on_stuck: Callable[[], None] | None = None) -> bool:
        """True when the lock was taken within ``timeout``; else calls ``on_wait`` (which
        must let the holder go) and waits for the probe's answer, calling ``on_stuck``
        every 2 s it still waits (a worker frozen by an earlier pause may hold the lock:
        that pause must end, or the drill would wait for it forever)."""
        stdin, stdout = self.proc.stdin, self.proc.stdout
        assert stdin is not None and stdout is not None
        stdin.write("probe\n")
        stdin.flush()
        ready, _, _ = select.select([stdout], [], [], timeout)
        if not ready:
            on_wait()
            while on_stuck is not None and not select.select([stdout], [], [], 2.0)[0]:
                on_stuck()
        if not stdout.readline():
            raise RuntimeError("the drill's write-lock probe died")
        return bool(ready)

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(timeout=10)


class _TidBlocks:
    """Ranges of thread ids for the workers' pid namespaces, never two alike at once.

    LMDB tells processes apart by pid (reader slots: two pid-1 processes cannot even open
    one journal) and its robust mutexes name their holder by thread id, which is unique
    only within a pid namespace: when a thread is killed while it waits for a mutex that a
    thread of another namespace with the same id holds, the kernel declares the holder dead,
    a third process takes the mutex too, and LMDB's exclusion is gone (seen here as
    segfaults in glibc's robust-list code). So each worker's namespace starts its thread ids
    at its own block of ``SIZE`` (``ns_last_pid``), away from the blocks of the workers
    alive, of those that died lately, and of the drill's probe (of this pid namespace).
    """

    SIZE = 1000
    GRACE_S = 2.0  # a block is reused this long after its worker was reaped, at the soonest

    def __init__(self) -> None:
        self.count = max(2, _pid_max() // self.SIZE)
        self.busy: dict[int, str] = {}  # block -> worker
        self.freed: dict[int, float] = {}  # block -> when its worker was reaped
        self.avoid: set[int] = set()
        self.next = 1

    def take(self, name: str) -> int:
        """The first pid of a block for worker ``name``."""
        for _ in range(2):
            for i in range(self.count - 1):
                b = 1 + (self.next - 1 + i) % (self.count - 1)
                if b in self.busy or b in self.avoid or (
                        b in self.freed and time.monotonic() - self.freed[b] < self.GRACE_S):
                    continue
                self.next = b + 1
                self.busy[b] = name
                return b * self.SIZE
            time.sleep(0.5)
        raise RuntimeError("no block of thread ids is free for another worker")

    def give_back(self, name: str) -> None:
        for b, who in list(self.busy.items()):
            if who == name:
                del self.busy[b]
                self.freed[b] = time.monotonic()


def _pid_max() -> int:
    try:
        return int(Path("/proc/sys/kernel/pid_max").read_text())
    except (OSError, ValueError):
        return 32768


def _spawn(base: Path, n: int, slot: int, runs: list[str], seed: int, concurrency: int,
           lease_s: float = 30.0, pidns: bool = False,
           tids: _TidBlocks | None = None, journal: str | None = None,
           compress: bool = False) -> _Life:
    name = f"w{n}"
    runs_file = base / "pieces" / f"runs-{n}.txt"
    runs_file.parent.mkdir(exist_ok=True)
    runs_file.write_text("\n".join(runs))
    logs = base / "logs"
    logs.mkdir(exist_ok=True)
    argv = [sys.executable, "-m", "boundloop.drill", "worker",
            journal or str(base / "journal"), str(base / "ledger"), str(runs_file), str(seed),
            str(concurrency), str(base / "recovered.jsonl"), "--lease", str(lease_s),
            "--name", name, "--notes", str(logs / f"{name}.jsonl"),
            "--linger", str(base / "linger")] + (["--compress"] if compress else [])
    return _popen(logs, name, slot, runs, argv, pidns, tids)


def _popen(logs: Path, name: str, slot: int, runs: list[str], argv: list[str], pidns: bool,
           tids: _TidBlocks | None) -> _Life:
    """Start worker ``name`` (``argv``, which takes ``--pid``), in a pid namespace of its
    own when ``pidns``, its output in ``logs``."""
    if pidns:
        # Thread-id blocks matter to LMDB's robust mutexes only (see _TidBlocks).
        first = [] if tids is None else ["--pid", str(tids.take(name))]
        argv = ["unshare", "--pid", "--fork", "--mount-proc", *argv, *first]
    out, err = logs / f"{name}.out", logs / f"{name}.err"
    with open(out, "wb") as o, open(err, "wb") as e:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=o, stderr=e,
                                start_new_session=True)
    return _Life(name, slot, runs, proc, out, err)


class _FlockProbe:
    """On a PostgreSQL journal, the one lock every worker shares is the downstream's (the row
    locks of a frozen worker's open transaction are the server's to free: it ends an idle
    transaction after half the lease, see ``boundloop.journal.postgres``)."""

    def __init__(self, lock: Path) -> None:
        self.lock = lock

    def free(self, timeout: float, on_wait: Callable[[], None]) -> bool:
        """True when the lock was taken within ``timeout``; else calls ``on_wait``."""
        fd = os.open(self.lock, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            deadline = time.monotonic() + timeout
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    return True
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        on_wait()
                        return False
                    time.sleep(0.002)
        finally:
            os.close(fd)  # and the lock with it

    def close(self) -> None:
        pass


def fresh_database(url: str) -> tuple[str, str]:
    """``CREATE DATABASE drill_<random>`` on the server of ``url`` (a ``postgresql://`` URL
    whose role may create databases); returns its name and its URL."""
    import secrets
    from urllib.parse import urlsplit, urlunsplit

    import psycopg

    name = "drill_" + secrets.token_hex(6)
    with psycopg.connect(url, autocommit=True, connect_timeout=10) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    return name, urlunsplit(urlsplit(url)._replace(path="/" + name))


def pg_restart_argv(pgdata: str | os.PathLike[str]) -> list[str]:
    """The command that crash-restarts the server of data directory ``pgdata``:
    ``pg_ctl restart -m immediate -w`` (no checkpoint: WAL replay at the start; the server's
    own options from its ``postmaster.opts``), as the directory's owner (``runuser``) when
    this process is root, logging to ``<pgdata>/boundloop-drill.log``."""
    import pwd
    import shlex

    data = Path(pgdata).resolve()
    pg_ctl = None
    with contextlib.suppress(OSError, ValueError, IndexError):
        postgres = shlex.split((data / "postmaster.opts").read_text())[0]
        pg_ctl = str(Path(postgres).with_name("pg_ctl"))
    if pg_ctl is None or not os.access(pg_ctl, os.X_OK):
        with contextlib.suppress(OSError):
            version = (data / "PG_VERSION").read_text().strip()
            pg_ctl = f"/usr/lib/postgresql/{version}/bin/pg_ctl"
    if pg_ctl is None or not os.access(pg_ctl, os.X_OK):
        pg_ctl = shutil.which("pg_ctl")
    if pg_ctl is None:
        raise RuntimeError(f"no pg_ctl found for the server of {data} (not next to the "
                           "postgres of its postmaster.opts, nor on $PATH)")
    owner = data.stat().st_uid
    prefix: list[str] = []
    if os.geteuid() == 0 and owner != 0:
        prefix = ["runuser", "-u", pwd.getpwuid(owner).pw_name, "--"]
    elif os.geteuid() != owner:
        raise RuntimeError(f"{data} belongs to uid {owner}: run the drill as that user (or "
                           "as root) to restart its server")
    return [*prefix, pg_ctl, "-D", str(data), "-m", "immediate", "-w", "-t", "60",
            "-l", str(data / "boundloop-drill.log"), "restart"]


class _Server:
    """The PostgreSQL server under the drill, crash-restarted in a thread of its own (the
    drill goes on killing and freezing workers meanwhile); ``down`` holds, per restart, when
    the restart began and when the server accepted a connection again."""

    def __init__(self, url: str, restart: list[str] | str, log: Path) -> None:
        self.url, self.restart_cmd, self.log = url, restart, log
        self.down: list[list[float]] = []
        self.error = ""
        self._thread: threading.Thread | None = None

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def restart(self) -> None:
        self.down.append([time.time(), 0.0])
        self._thread = threading.Thread(target=self._restart, name="drill-pg-restart",
                                        daemon=True)
        self._thread.start()

    def _restart(self) -> None:
        import psycopg

        cmd = self.restart_cmd
        try:
            with open(self.log, "ab") as log:
                code = subprocess.run(cmd, shell=isinstance(cmd, str), stdin=subprocess.DEVNULL,
                                      stdout=log, stderr=log, timeout=180).returncode
        except (OSError, subprocess.SubprocessError) as exc:
            self.error = f"the server's restart command failed: {exc}"
            return
        if code != 0:
            self.error = f"the server's restart command exited {code} (see {self.log})"
        give_up = time.monotonic() + 60
        while True:  # back up: the first connection it accepts
            try:
                psycopg.connect(self.url, connect_timeout=2).close()
                break
            except psycopg.Error as exc:
                if time.monotonic() > give_up:
                    self.error = self.error or f"the server is not back after its restart: {exc}"
                    return
                time.sleep(0.01)
        self.down[-1][1] = time.time()

    def join(self) -> None:
        if self._thread is not None:
            self._thread.join()


def run_drill(base: Path, runs: int, kills: int, seed: int, workers: int = 2,
              concurrency: int = 4, out: Callable[[str], None] = print, *,
              pause: bool = False, lease_s: float = 1.0,
              pidns: bool | None = None, journal: str | None = None,
              pgdata: str | os.PathLike[str] | None = None,
              restart_cmd: str | None = None, restarts: int | None = None,
              progress: Callable[[int, int | None], None] | None = None,
              compress: bool = False) -> DrillReport:
    """Run the drill in directory ``base`` and return its report.

    ``kills`` is the number of faults to inject: SIGKILLs, and with ``pause`` also SIGSTOPs
    past the lease (about half, at most ``workers - 1`` workers frozen at once). ``pidns``
    (default: ``pause`` and available) runs each worker in its own pid namespace.

    ``journal`` (a ``postgresql://`` URL) runs the drill on PostgreSQL, in a database of its
    own created for it (``fresh_database``) on that server; else on an LMDB journal in
    ``base/journal``. With ``pgdata`` (the server's data directory, see
    ``pg_restart_argv``) or ``restart_cmd`` (a shell command that crash-restarts the server
    and returns), ``restarts`` of the faults (default: one in 50, at least one) are server
    restarts; the time the server was down does not count against the takeover bound.

    Work is handed out in small slices, one per worker life, so the kills spread over the
    whole workload; a killed worker's slice goes back to the queue (the next worker skips
    runs already started; whoever sweeps first takes the orphans over).

    ``out`` gets a line per fault injected (and the phases); ``progress``, if given,
    ``(faults injected, kills)`` with each.
    """
    from boundloop.runner import Runner

    started = time.monotonic()
    rng = random.Random(seed)
    rig = _prepare(base, DrillReport(runs, workers=workers, lease_s=lease_s,
                                     compress=compress), kills, pause, pidns, journal,
                   pgdata, restart_cmd, restarts)
    report, where, server, probe, tids = rig
    run_ids = [f"drill-{seed}-{i:05d}" for i in range(runs)]
    expected_kills = kills // 2 if pause else kills
    size = max(1, runs // (expected_kills + workers))
    queue = [run_ids[i:i + size] for i in range(0, runs, size)]
    out = _counting(out, progress, report, kills)
    lines = _Lines(base / "ledger")

    def next_fault(previous: int) -> int:
        return _next_fault(rng, report, kills, lines, 3 * runs, previous)

    trigger = next_fault(0)
    procs: dict[int, _Life] = {}
    lives: list[_Life] = []
    lingering: set[int] = set()  # slots given a last, lingering worker
    try:
        while queue or procs:
            now = time.time()
            if server is not None and server.error:
                raise RuntimeError(server.error)
            for slot, life in list(procs.items()):
                if life.proc.poll() is None:
                    continue
                life.exited_at = life.exited_at or now
                if tids is not None:
                    tids.give_back(life.name)
                if life.proc.returncode not in (0, -signal.SIGKILL):
                    # A worker that crashed (a traceback): a failure of the drill, counted;
                    # its slice goes back to the queue, as a killed worker's.
                    report.worker_errors += 1
                    err = life.err.read_text(errors="replace").strip().splitlines()
                    report.notes.append(f"worker {life.name} exited {life.proc.returncode}: "
                                        f"{err[-1] if err else '(nothing on stderr)'}")
                    if report.worker_errors > 3 * workers:
                        raise RuntimeError(f"drill workers keep failing; the last, "
                                           f"{life.name}: {' '.join(err[-20:])}")
                    if life.piece:
                        queue.insert(0, life.piece)
                    lingering.discard(life.slot)
                del procs[slot]
            if not queue and not (base / "linger").exists():
                (base / "linger").touch()  # from now on workers stay until all is done
            for slot in range(workers):
                if slot in procs or (not queue and slot in lingering):
                    continue
                piece = queue.pop(0) if queue else []
                if not queue:
                    lingering.add(slot)
                life = _spawn(base, len(lives) + 1, slot, piece, seed, concurrency,
                              lease_s, report.pid_namespaces, tids,
                              None if journal is None else where, compress)
                lives.append(life)
                procs[slot] = life
            for life in procs.values():
                if life.paused and now >= life.resume_at:
                    _resume(life)
            if report.faults_injected < kills and lines() >= trigger \
                    and (queue or any(life.working() for life in procs.values())):
                # The restarts are spread evenly over the faults: the k-th of R comes as
                # fault number about k * kills / (R + 1) (later while one is under way).
                planned = report.restarts_planned
                k = report.restarts_injected + 1
                if server is not None and k <= planned and not server.busy \
                        and report.faults_injected + 1 >= round(k * kills / (planned + 1)):
                    server.restart()
                    _append_line(base / "faults.jsonl", json.dumps(
                        {"kind": "restart", "worker": "", "owner": "",
                         "at": server.down[-1][0]}))
                    report.restarts_injected += 1
                    report.faults_injected += 1
                    out(f"  restart {report.faults_injected}/{kills}: the PostgreSQL server "
                        "(pg_ctl -m immediate)")
                    trigger = next_fault(trigger)
                    continue
                live = [life for life in procs.values()
                        if not life.paused and life.proc.poll() is None and life.ready()]
                frozen = sum(life.paused for life in procs.values())
                if live:
                    life = rng.choice(live)
                    want_pause = pause and frozen < workers - 1 and rng.random() < 0.5
                    time.sleep(rng.uniform(0.0, 0.005))
                    if want_pause and probe is not None:
                        if _pause(life, probe, rng, lease_s, report, kills, out,
                                  list(procs.values())):
                            trigger = next_fault(trigger)
                    elif life.proc.poll() is None:
                        _kill(base, life, report, kills, out)
                        if life.piece:
                            queue.insert(0, life.piece)
                        lingering.discard(life.slot)
                        trigger = next_fault(trigger)
            time.sleep(0.003)
    finally:
        for life in procs.values():
            life.signal(signal.SIGCONT)
            life.signal(signal.SIGKILL)
            life.proc.wait()
        if probe is not None:
            probe.close()
        if server is not None:
            server.join()
    if server is not None:
        if server.error:
            raise RuntimeError(server.error)
        report.server_down_s = round(sum(b - a for a, b in server.down), 3)
    report.worker_lives = len(lives)
    with Runner(where, lease_s=lease_s, compress=compress) as runner:
        settle(runner, base, run_ids, drill_model(seed), drill_tools(base / "ledger", "person"))
        _check(runner, base, run_ids, report, lives, [] if server is None else server.down)
    report.elapsed_s = round(time.monotonic() - started, 2)
    return report


def settle(runner: Any, base: Path, run_ids: list[str], model: Any, tools: list[Tool],
           decide: Callable[[str], None] | None = None) -> None:
    """The person at the end: take over what is left (leases must run out first), resolve
    what needs review from the ledger (and with ``decide``, decide the calls of runs that
    wait for approval), then resume, until done. Again and again: a resume can end
    needs_review (or awaiting_approval) once more, and the person's own runner can fence
    itself (a lease renewal late on a loaded machine) and leave a run open, to be recovered
    like any other."""
    stops = ("needs_review", "awaiting_approval") if decide else ("needs_review",)
    give_up = time.monotonic() + 10 + 4 * runner.lease_s
    while True:
        for r in runner.recover():
            _append_line(base / "recovered.jsonl", json.dumps({
                "run_id": r.run_id, "by": "person", "unresolved": [
                    [u.idempotency_key, u.tool, u.phase] for u in r.unresolved]}))
            runner.resume(r.run_id, model, tools)
        keys = {k for k, _ in ledger(base / "ledger")}
        waiting = [i for i in run_ids if runner.state(i).status in stops]
        for run_id in waiting:
            if decide is not None and runner.state(run_id).status == "awaiting_approval":
                decide(run_id)
            for action in runner.state(run_id).open_actions:
                outcome = "succeeded" if action.idempotency_key in keys else "failed"
                runner.resolve(run_id, action.execution_id, outcome, note="ledger checked",
                               by="drill")
            runner.resume(run_id, model, tools)
        settled = not waiting and next(iter(runner.journal.open_runs()), None) is None
        if settled or time.monotonic() > give_up:
            break
        if not waiting:
            time.sleep(runner.lease_s / 4)


def _kill(base: Path, life: _Life, report: DrillReport, kills: int,
          out: Callable[[str], None]) -> None:
    """SIGKILL ``life``, and count it."""
    life.killed_at = time.time()
    life.signal(signal.SIGKILL)
    _fault(base, "kill", life, life.killed_at)
    report.crashes_injected += 1
    report.faults_injected += 1
    out(f"  kill {report.faults_injected}/{kills}: {life.name} (pid {life.proc.pid})")


class _Rig(NamedTuple):
    """What a drill runs on: its report, the journal every worker opens (a directory or a
    URL), the PostgreSQL server it restarts, its lock probe and its thread-id blocks."""

    report: DrillReport
    where: str
    server: _Server | None
    probe: _WriteLockProbe | _FlockProbe | None
    tids: _TidBlocks | None


def _prepare(base: Path, report: DrillReport, kills: int, pause: bool, pidns: bool | None,
             journal: str | None, pgdata: str | os.PathLike[str] | None = None,
             restart_cmd: str | None = None, restarts: int | None = None) -> _Rig:
    """Check the settings and set a drill up in ``base``: its journal (a fresh database on
    PostgreSQL), and the lock probe the pauses need; ``report`` gets the settings."""
    from boundloop.journal.postgres import is_url
    from boundloop.runner import Runner

    base.mkdir(parents=True, exist_ok=True)
    if journal is not None and not is_url(journal):
        raise ValueError(f"journal must be a postgresql:// URL, got {journal!r} (the LMDB "
                         "drill keeps its journal in its directory)")
    if journal is None and (pgdata is not None or restart_cmd is not None):
        raise ValueError("a server restart needs a PostgreSQL journal (a postgresql:// URL)")
    report.pid_namespaces = pause and can_unshare() if pidns is None else pidns
    report.unowned_bound_s = round(report.lease_s * 1.5 + SLACK_S, 3)
    if pause and not report.pid_namespaces:
        report.notes.append("the workers share one pid namespace: a paused worker is alive "
                            "by SPEC 6 (its process exists), so its runs are never taken "
                            "over; pauses test self-fencing only")
    where = str(base / "journal")
    server: _Server | None = None
    if journal is not None:
        report.journal = "postgresql"
        report.database, where = fresh_database(journal)
        (base / "journal.url").write_text(where + "\n")
        report.notes.append(f"PostgreSQL: database {report.database} was created for this "
                            "drill on the server of --journal, and kept (DROP DATABASE "
                            f"{report.database} when done with it)")
        restart: list[str] | str | None = restart_cmd
        if restart is None and pgdata is not None:
            restart = pg_restart_argv(pgdata)
        if restart is None:
            report.notes.append("no --pgdata or --pg-restart-cmd: the server was not "
                                "restarted")
        else:
            server = _Server(where, restart, base / "pg-restarts.log")
            report.restarts_planned = min(kills, max(1, kills // 50)
                                          if restarts is None else restarts)
    tids = _TidBlocks() if journal is None else None
    probe: _WriteLockProbe | _FlockProbe | None = None
    if journal is not None:
        with Runner(where, lease_s=report.lease_s, compress=report.compress):
            pass  # the schema and the redaction key, before any worker
        probe = _FlockProbe(Downstream(base / "ledger").lock)
    elif pause:
        # The probe first (on a journal made for it), so no worker's block holds its pid.
        with Runner(base / "journal", lease_s=report.lease_s, compress=report.compress):
            pass
        lmdb_probe = _WriteLockProbe(base / "journal", Downstream(base / "ledger").lock)
        probe = lmdb_probe
        assert tids is not None
        tids.avoid.add(lmdb_probe.proc.pid // _TidBlocks.SIZE)
    return _Rig(report, where, server, probe, tids)


def _counting(out: Callable[[str], None], progress: Callable[[int, int | None], None] | None,
              report: DrillReport, kills: int) -> Callable[[str], None]:
    """``out``, also telling ``progress`` how many faults are injected with each line."""
    if progress is None:
        return out

    def told(text: str) -> None:  # every fault is told as a line: count them there
        out(text)
        progress(report.faults_injected, kills)

    return told


def _next_fault(rng: random.Random, report: DrillReport, kills: int, lines: _Lines,
                expected_lines: int, previous: int) -> int:
    """The ledger line at which the next fault is due: the faults left spread over the side
    effects left, counted from the previous fault's mark, so faults delayed (no worker up
    to take one) catch up."""
    left = max(kills - report.faults_injected, 1)
    gap = max(1, int(0.8 * (expected_lines - lines()) / left))
    return previous + rng.randint(1, 2 * gap - 1 if gap > 1 else 1)


def _fault(base: Path, kind: str, life: _Life, at: float) -> None:
    """The drill's own record of what it did to whom, and when (``faults.jsonl``)."""
    life.ready()
    _append_line(base / "faults.jsonl", json.dumps({"kind": kind, "worker": life.name,
                                                    "owner": life.owner, "at": at}))


def _resume(life: _Life) -> None:
    """End ``life``'s pause (SIGCONT), and say when (the moment before the signal: the
    worker may run before this process does again)."""
    life.pauses[-1][1] = time.time()
    life.signal(signal.SIGCONT)
    _fault(life.out.parent.parent, "resume", life, life.pauses[-1][1])


def _pause(life: _Life, probe: _WriteLockProbe | _FlockProbe, rng: random.Random,
           lease_s: float,
           report: DrillReport, kills: int, out: Callable[[str], None],
           frozen: Iterable[_Life] = ()) -> bool:
    """Freeze ``life`` past its lease; False when it was caught holding a lock the others
    need (a journal commit...): then it is let go at once and a fault is tried again.
    ``frozen`` are the workers paused before: woken early if one of them holds the lock."""
    if life.proc.poll() is not None:
        return False
    life.signal(signal.SIGSTOP)
    stopped = time.time()

    def wake_frozen() -> None:
        for other in frozen:
            if other is not life and other.paused:
                _resume(other)

    free = probe.free(WRITE_LOCK_PROBE_S, lambda: life.signal(signal.SIGCONT), wake_frozen) \
        if isinstance(probe, _WriteLockProbe) else \
        probe.free(WRITE_LOCK_PROBE_S, lambda: life.signal(signal.SIGCONT))
    if not free:
        report.pauses_backed_off += 1
        _fault(life.out.parent.parent, "backoff", life, stopped)
        return False
    life.pauses.append([stopped, 0.0])
    _fault(life.out.parent.parent, "pause", life, stopped)
    life.resume_at = stopped + rng.uniform(*PAUSE_LEASES) * lease_s
    report.pauses_injected += 1
    report.faults_injected += 1
    out(f"  pause {report.faults_injected}/{kills}: {life.name} (pid {life.proc.pid}) for "
        f"{life.resume_at - stopped:.2f} s")
    return True


def _jsonl(paths: Iterable[Path]) -> list[dict[str, Any]]:
    out = []
    for path in paths:
        if path.exists():
            for line in path.read_text().splitlines():
                try:
                    out.append(json.loads(line))
                except ValueError:
                    continue  # a line cut by a kill
    return out


def _segments(events: list[ev.Event]) -> list[tuple[int, str, ev.Event]]:
    """Each event with the epoch and the owner in force where it was appended."""
    epoch, owner = 0, ""
    out = []
    for e in events:
        if isinstance(e, ev.RunAdmitted):
            epoch, owner = 1, e.owner
        elif isinstance(e, ev.OwnerClaimed):
            epoch, owner = (e.epoch or epoch + 1), e.owner
        out.append((epoch, owner, e))
    return out


def _check(runner: Any, base: Path, run_ids: list[str], report: DrillReport,
           lives: list[_Life] | None = None, down: list[list[float]] | None = None) -> None:
    from boundloop.policy.replay import ReplayError, replay

    lives = lives or []
    down = down or []
    done = effects(base / "ledger")
    executions = Counter(x.key for x in done)
    tool_of = {x.key: x.tool for x in done}
    recovered = _jsonl([base / "recovered.jsonl"])
    report.runs_recovered = len(recovered)
    report.unresolved_found = sum(len(r["unresolved"]) for r in recovered)
    notes = _jsonl(sorted((base / "logs").glob("*.jsonl"))) if (base / "logs").exists() \
        else []
    for life in lives:
        life.ready()  # read the owner id every worker printed, and when it left
        left = 0.0 if life.killed_at else life.left_at()
        if left:
            life.exited_at = left
    life_of = {life.owner: life for life in lives if life.owner}
    life_by_name = {life.name: life for life in lives}
    owner_of = {life.name: life.owner for life in lives}
    owner_of["person"] = runner.owner
    by_run: dict[str, list[Effect]] = {}
    for x in done:
        by_run.setdefault(x.run_id, []).append(x)
    refused = effects(Downstream(base / "ledger").refused)
    report.late_attempts_refused = len(refused)
    refused_by_run: dict[str, list[Effect]] = {}
    for x in refused:
        refused_by_run.setdefault(x.run_id, []).append(x)
    finished_by: dict[str, list[tuple[str, str, int, int]]] = {}
    intents: dict[str, str] = {}
    unowned: list[float] = []
    takeovers: list[dict[str, Any]] = []
    for run_id in run_ids:
        pairs = list(runner.journal.read(run_id))
        if [s for s, _ in pairs] != list(range(1, len(pairs) + 1)) or not pairs:
            report.events_lost += 1
            continue
        events = [e for _, e in pairs]
        try:
            state = replay(events)
        except ReplayError:
            report.events_lost += 1
            continue
        finishes = [e for e in events if isinstance(e, ev.RunFinished)]
        report.sent_to_review += sum(1 for e in finishes if e.status == "needs_review")
        report.reconciled_automatically += sum(isinstance(e, ev.CallReconciled) for e in events)
        report.retried_idempotent += sum(isinstance(e, ev.CallDispatched) and e.attempt > 1
                                         for e in events)
        if not finishes or (finishes[-1].status, finishes[-1].model_steps,
                            finishes[-1].tool_calls) != (state.status, state.model_steps,
                                                         state.tool_calls):
            report.replay_mismatches += 1
        if state.status != "final":
            report.runs_not_final += 1
        for rec in state.calls.values():
            intents[rec.idempotency_key] = rec.tool
            ran = executions[rec.idempotency_key] > 0
            if ran and rec.status in ("skipped", "error"):
                report.unresolved_missed += 1  # the journal says it did not happen; it did
            if not ran and rec.status == "ok":
                report.unresolved_spurious += 1  # the journal says it happened; it did not
        # -- ownership ---------------------------------------------------------------------
        segments = _segments(events)
        epoch_owner: dict[int, str] = {}
        claims: list[tuple[int, float]] = []
        dispatched: dict[tuple[str, int], float] = {}  # (key, epoch): its last dispatch
        previous = 0
        # A queued run (enqueued, or queued again once its approvals were decided) waits
        # for any worker: its claim is no takeover (the owner before it is "").
        queued = False
        for epoch, owner, e in segments:
            epoch_owner.setdefault(epoch, owner)
            if isinstance(e, ev.CallDispatched) and e.execution_id in state.calls:
                dispatched[state.calls[e.execution_id].idempotency_key, epoch] = e.ts
            if isinstance(e, ev.OwnerClaimed):
                if epoch != previous + 1:
                    report.epoch_gaps += 1
                claims.append((epoch, e.ts))
                takeovers.append(_takeover(report, unowned, life_of, runner.owner,
                                           "" if queued else epoch_owner.get(epoch - 1, ""),
                                           e, down))
            if isinstance(e, ev.RunAdmitted | ev.OwnerClaimed):
                previous = epoch
            queued = isinstance(e, ev.RunRequeued) or queued and not isinstance(
                e, ev.OwnerClaimed) or isinstance(e, ev.RunAdmitted) and e.queued
            if isinstance(e, ev.RunFinished):
                finished_by.setdefault(run_id, []).append(
                    (owner, e.status, e.tool_calls, e.model_steps))
            if isinstance(e, ev.CallSucceeded):
                # Recorded at epoch k: the side effect must have run at epoch k, else an
                # old owner's late append was accepted.
                call = state.calls.get(e.execution_id)
                key = call.idempotency_key if call is not None else ""
                if not any(x.key == key and x.epoch == epoch for x in by_run.get(run_id, [])):
                    report.zombie_appends_accepted += 1
        for x in by_run.get(run_id, []) + refused_by_run.get(run_id, []):
            if owner_of.get(x.worker) != epoch_owner.get(x.epoch):
                report.epoch_mismatches += 1  # ran under a fencing token it did not hold
            # An attempt that started after its run was claimed at a later epoch (whether
            # or not the downstream then refused it).
            late = [ts for epoch, ts in claims if epoch > x.epoch and ts < x.started]
            if late:
                # The ledger's start is the handler's first line, a moment after the
                # runner's gate let the attempt start: a worker frozen in between (its
                # attempt dispatched and its gate passed before the freeze, so before the
                # claim) starts its handler just after it wakes. That is no zombie
                # execution (the downstream's fencing settles it), and is counted apart.
                actor = life_by_name.get(x.worker)
                sent = dispatched.get((x.key, x.epoch), float("inf"))
                frozen = actor is not None and any(
                    sent <= stopped <= min(late)
                    and resumed <= x.started <= resumed + FROZEN_START_S
                    for stopped, resumed in actor.pauses if resumed)
                if frozen:
                    report.attempts_frozen_at_start += 1
                else:
                    report.zombie_executions += 1
                _append_line(base / "zombies.jsonl", json.dumps({
                    **x._asdict(), "claimed_at": min(late),
                    "late_by_s": round(x.started - min(late), 6),
                    "cause": "frozen between its gate and its handler" if frozen
                    else "zombie execution"}))
    report.executed_without_intent = sum(1 for k in executions if k not in intents)
    report.duplicate_executions = sum(n - 1 for k, n in executions.items()
                                      if n > 1 and tool_of.get(k) != "charge")
    for n in notes:
        if n.get("kind") == "error":
            report.worker_errors += 1
        elif n.get("kind") == "unavailable":
            report.journal_unavailable_retries += 1
        elif n.get("kind") == "result":
            if n["status"] == "journal_unavailable":
                report.zombie_appends_refused += REFUSED in n["explanation"]
                report.self_fenced += SELF_FENCED in n["explanation"]
                report.runs_unavailable += not (REFUSED in n["explanation"]
                                                or SELF_FENCED in n["explanation"])
            elif n["status"] != "rejected":
                # A result given to a worker: its RunFinished is in the journal, in the
                # stretch that worker owned.
                report.acks_checked += 1
                if (n["owner"], n["status"], n["tool_calls"], n["model_steps"]) \
                        not in finished_by.get(n["run_id"], []):
                    report.acks_lost += 1
    report.max_unowned_s = round(max(unowned, default=0.0), 3)
    report.takeovers_over_bound = sum(u > report.unowned_bound_s for u in unowned)
    (base / "takeovers.jsonl").write_text("".join(json.dumps(t) + "\n" for t in takeovers))
    (base / "lives.jsonl").write_text("".join(json.dumps(
        {"worker": life.name, "owner": life.owner, "killed_at": life.killed_at,
         "exited_at": life.exited_at, "pauses": life.pauses}) + "\n" for life in lives))


def _takeover(report: DrillReport, unowned: list[float], life_of: dict[str, _Life],
              person: str, previous: str, claim: ev.OwnerClaimed,
              down: list[list[float]] | None = None) -> dict[str, Any]:
    """Count a takeover, and how long the run had nobody to drive it before it."""
    record: dict[str, Any] = {"run_id": claim.run_id, "epoch": claim.epoch, "at": claim.ts,
                              "by": claim.owner, "from": previous}
    if not claim.owner:
        return {**record, "cause": "release"}  # its turn ended awaiting approval: nobody's
    if not previous:
        return {**record, "cause": "queue"}  # a queued run, taken by a worker (or the person)
    if claim.owner == person:
        report.takeovers_at_end += 1
        return {**record, "cause": "review"}
    report.takeovers += 1
    life = life_of.get(previous)
    since, cause = 0.0, "unknown"
    # A pause explains a claim made while the worker was frozen or just after it woke
    # (before it renewed its lease).
    stops = [] if life is None else [
        stopped for stopped, resumed in life.pauses
        if stopped <= claim.ts <= (resumed or claim.ts) + report.lease_s]
    if life is None:
        pass
    elif life.killed_at and life.killed_at <= claim.ts:
        report.takeovers_after_kill += 1
        since, cause = life.killed_at, "kill"
    elif life.exited_at and life.exited_at <= claim.ts:
        since, cause = life.exited_at, "exit"  # it left a run it had fenced itself off
    elif stops:
        report.takeovers_after_pause += 1
        since, cause = max(stops), "pause"
    else:
        report.takeovers_of_live_owners += 1  # its lease ran out while it ran
        cause = "live"
    if since:
        # The bound is on boundloop's takeover, so it counts only the time in which another
        # worker could take the run: at a few faults per second there are moments when
        # every worker is frozen, killed or still starting, and nothing can claim anything;
        # nor while the server is down (that time is counted apart).
        able = _able_time(life_of.values(), previous, since, claim.ts, down)
        unowned.append(able)
        report.max_unowned_wall_s = max(report.max_unowned_wall_s,
                                        round(claim.ts - since, 3))
        server_down = _overlap(since, claim.ts, down or [])
        report.max_unowned_server_down_s = max(report.max_unowned_server_down_s,
                                               round(server_down, 3))
        record["unowned_s"] = round(able, 3)
        record["unowned_wall_s"] = round(claim.ts - since, 3)
        if server_down:
            record["server_down_s"] = round(server_down, 3)
    return {**record, "cause": cause}


def _able_time(lives: Iterable[_Life], previous: str, since: float, until: float,
               down: list[list[float]] | None = None) -> float:
    """Seconds of [since, until] in which some worker other than ``previous`` was able to
    take runs over (ready, not frozen, alive) and the server was up (``down``: the
    [went down, back up] stretches of a PostgreSQL server's restarts)."""
    spans = sorted((max(a, since), min(b, until)) for life in lives if life.owner != previous
                   for a, b in life.able() if a < until and b > since)
    total, end = 0.0, since
    for a, b in spans:
        if b > end:
            start = max(a, end)
            total += b - start - _overlap(start, b, down or [])
            end = b
    return total


def _overlap(since: float, until: float, stretches: Iterable[list[float]]) -> float:
    """Seconds of [since, until] inside the (disjoint) ``stretches`` [a, b] (b = 0: not
    over yet)."""
    return sum(max(0.0, min(until, b or until) - max(since, a)) for a, b in stretches)


def format_report(report: DrillReport, command: str) -> str:
    """The report as aligned lines, ending with the command that reproduces it."""
    rows = [(f.replace("_", " "), getattr(report, f)) for f in report.__struct_fields__
            if f != "notes"]
    width = max(len(k) for k, _ in rows)
    body = "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)
    verdict = "PASS" if report.ok else "FAIL"
    notes = "".join(f"\nnote: {n}" for n in report.notes)
    return f"crash-recovery drill: {verdict}\n{body}{notes}\nreproduce: {command}"


def _masked(url: str) -> str:
    """``url`` with its password, if any, as ``***``."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(url)
    if not parts.password:
        return url
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{parts.username or ''}:***@{host}"))


def command(runs: int, kills: int, seed: int, workers: int = 2, pause: bool = False,
            lease_s: float = 1.0, pidns: bool | None = None, journal: str | None = None,
            pgdata: str | None = None, restart_cmd: str | None = None,
            restarts: int | None = None, compress: bool = False, queue: bool = False) -> str:
    """The ``boundloop drill`` command line of these settings."""
    import shlex

    extra = (f" --workers {workers}" if workers != 2 else "") + (" --pause" if pause else "") \
        + (f" --lease {lease_s:g}" if lease_s != 1.0 else "") \
        + ("" if pidns is None else " --pidns" if pidns else " --no-pidns") \
        + (f" --journal {shlex.quote(_masked(journal))}" if journal else "") \
        + (f" --pgdata {shlex.quote(str(pgdata))}" if pgdata else "") \
        + (f" --pg-restart-cmd {shlex.quote(restart_cmd)}" if restart_cmd else "") \
        + (f" --pg-restarts {restarts}" if restarts is not None else "") \
        + (" --compress" if compress else "") + (" --queue" if queue else "")
    return f"boundloop drill --runs {runs} --kills {kills} --seed {seed}{extra}"


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "worker":
        _worker_main(sys.argv[2:])
    else:
        ap = argparse.ArgumentParser(prog="python -m boundloop.drill")
        ap.add_argument("--runs", type=int, default=200)
        ap.add_argument("--kills", type=int, default=50)
        ap.add_argument("--seed", type=int, default=1)
        ap.add_argument("--workers", type=int, default=2)
        ap.add_argument("--pause", action="store_true")
        ap.add_argument("--lease", type=float, default=1.0)
        ap.add_argument("--dir", default=None)
        a = ap.parse_args()
        import tempfile

        d = Path(a.dir) if a.dir else Path(tempfile.mkdtemp(prefix="boundloop-drill-"))
        rep = run_drill(d, a.runs, a.kills, a.seed, a.workers, pause=a.pause,
                        lease_s=a.lease)
        print(format_report(rep, command(a.runs, a.kills, a.seed, a.workers, a.pause,
                                         a.lease)))
        sys.exit(0 if rep.ok else 1)
