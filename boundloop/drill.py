"""``boundloop drill``: a crash-recovery drill anyone can run.

Worker processes drive many runs whose tools append one ledger line per real side effect,
keyed by idempotency key (``charge`` is idempotent, ``ship`` irreversible, ``book`` has
``reconcile``). The drill SIGKILLs workers at random moments and restarts them; restarted
workers recover and resume the orphaned runs; at the end a "person" resolves what needs
review from the ledger (the ground truth). Then the journal is checked against the ledger.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

from boundloop import events as ev
from boundloop.messages import CallTools, Final, Message, ToolCall
from boundloop.tools import Tool, ToolContext, tool

TOOLS = ("charge", "ship", "book")
ARGS: dict[str, dict[str, Any]] = {"charge": {"amount": 7}, "ship": {"item": "parcel"},
                                   "book": {"room": "r1"}}


class DrillReport(msgspec.Struct):
    """What the drill found; ``ok`` is False when any invariant failed."""

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

    @property
    def ok(self) -> bool:
        """True when every invariant held."""
        return not (self.unresolved_missed or self.unresolved_spurious
                    or self.executed_without_intent or self.duplicate_executions
                    or self.events_lost or self.replay_mismatches or self.runs_not_final)


# -- what runs inside a worker ------------------------------------------------------------
def plan(run_id: str, seed: int) -> list[str]:
    """The tools a run calls, one per step, in a seeded order."""
    order = list(TOOLS)
    random.Random(f"{seed}:{run_id}").shuffle(order)
    return order


def drill_model(seed: int) -> Callable[[list[Message], Any], Any]:
    """A model that reads its next step off the history, so a resumed run continues."""

    def model(history: list[Message], ctx: Any) -> Any:
        names = plan(ctx.run_id, seed)
        done = sum(1 for m in history if m.kind == "tool_result")
        if done >= len(names):
            return Final("all done")
        name = names[done]
        return CallTools([ToolCall(f"c{done + 1}", name, ARGS[name])])

    return model


def ledger(path: Path) -> list[tuple[str, str]]:
    """Every real side effect so far: (idempotency key, tool)."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        key, _, name = line.partition(" ")
        if name:
            out.append((key, name))
    return out


def ledger_size(path: Path) -> int:
    """How many side effects the ledger holds (lines), cheaply."""
    try:
        with open(path, "rb") as f:
            return f.read().count(b"\n")
    except FileNotFoundError:
        return 0


def drill_tools(ledger_path: Path) -> list[Tool]:
    """The drill's tools: each appends one ledger line per real side effect."""
    rng = random.Random()

    def act(name: str, ctx: ToolContext) -> str:
        time.sleep(rng.random() * 0.004)
        fd = os.open(ledger_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, f"{ctx.idempotency_key} {name}\n".encode())
        finally:
            os.close(fd)
        time.sleep(rng.random() * 0.004)
        return f"{name} done"

    @tool(idempotent=True, timeout_s=10)
    def charge(amount: int, ctx: ToolContext) -> str:
        return act("charge", ctx)

    @tool(irreversible=True, timeout_s=10)
    def ship(item: str, ctx: ToolContext) -> str:
        return act("ship", ctx)

    def booked(key: str) -> str | None:
        return "book done" if any(k == key for k, _ in ledger(ledger_path)) else None

    @tool(reconcile=booked, timeout_s=10)
    def book(room: str, ctx: ToolContext) -> str:
        return act("book", ctx)

    return [charge, ship, book]


def worker(journal: str, ledger_path: str, runs_file: str, seed: int, concurrency: int,
           log: str) -> None:
    """A worker: resume orphans it can take, then start its runs not yet in the journal."""
    from boundloop.runner import Runner

    tools = drill_tools(Path(ledger_path))
    model = drill_model(seed)
    with Runner(journal, max_in_flight=concurrency * 4) as runner:
        print("ready", flush=True)
        recovered = runner.recover()
        with open(log, "a") as out:
            for r in recovered:
                out.write(json.dumps({"run_id": r.run_id, "unresolved": [
                    [u.idempotency_key, u.tool, u.phase] for u in r.unresolved]}) + "\n")
        futures = [runner.submit_resume(r.run_id, model, tools) for r in recovered]
        for future in futures:
            future.result()
        todo = [r for r in Path(runs_file).read_text().split() if runner.journal.find(r) is None]
        for i in range(0, len(todo), concurrency):
            batch = [runner.submit(model, tools, "run the plan", run_id=r)
                     for r in todo[i:i + concurrency]]
            for future in batch:
                future.result()


# -- the drill ----------------------------------------------------------------------------
def _spawn(base: Path, n: int, runs: list[str], seed: int, concurrency: int) -> Any:
    runs_file = base / f"runs-{n}.txt"
    runs_file.write_text("\n".join(runs))
    return subprocess.Popen(
        [sys.executable, "-m", "boundloop.drill", "worker", str(base / "journal"),
         str(base / "ledger"), str(runs_file), str(seed), str(concurrency),
         str(base / "recovered.jsonl")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def run_drill(base: Path, runs: int, kills: int, seed: int, workers: int = 2,
              concurrency: int = 4, out: Callable[[str], None] = print) -> DrillReport:
    """Run the drill in directory ``base`` and return its report.

    Work is handed out in small slices, one per worker life, so the kills spread over the
    whole workload; a killed worker's slice goes back to the queue (the next worker skips
    runs already started, and whoever recovers takes the orphans).
    """
    from boundloop.runner import Runner

    started = time.monotonic()
    rng = random.Random(seed)
    base.mkdir(parents=True, exist_ok=True)
    run_ids = [f"drill-{seed}-{i:05d}" for i in range(runs)]
    size = max(1, runs // (kills + workers))
    queue = [run_ids[i:i + size] for i in range(0, runs, size)]
    report = DrillReport(runs)
    procs: dict[int, tuple[Any, list[str]]] = {}
    lives = 0
    while queue or procs:
        for w in range(workers):
            if w not in procs and queue:
                lives += 1
                piece = queue.pop(0)
                procs[w] = (_spawn(base, lives, piece, seed, concurrency), piece)
        w = rng.choice(sorted(procs))
        p, piece = procs[w]
        if p.stdout is not None:
            p.stdout.readline()  # wait until it is up
        if report.crashes_injected < kills:
            # Let it do a random part of its slice, then kill it a few milliseconds later:
            # inside a handler, between handlers, or in a commit.
            target = ledger_size(base / "ledger") + rng.randint(1, 4 * len(piece))
            while p.poll() is None and ledger_size(base / "ledger") < target:
                time.sleep(0.002)
            time.sleep(rng.uniform(0.0, 0.005))
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
                report.crashes_injected += 1
                out(f"  kill {report.crashes_injected}/{kills}: pid {p.pid}")
                queue.insert(0, piece)
        p.wait()
        if p.returncode not in (0, -signal.SIGKILL):
            err = p.stderr.read()[-2000:] if p.stderr else ""
            raise RuntimeError(f"drill worker failed ({p.returncode}): {err}")
        del procs[w]
    # The person: resolve what needs review from the ledger, then resume, until done.
    tools = drill_tools(base / "ledger")
    with Runner(base / "journal") as runner:
        recovered = runner.recover()  # anything a last kill left behind
        for r in recovered:
            runner.resume(r.run_id, drill_model(seed), tools)
        for _ in range(4):
            keys = {k for k, _ in ledger(base / "ledger")}
            waiting = [i for i in run_ids if runner.state(i).status == "needs_review"]
            if not waiting:
                break
            for run_id in waiting:
                for action in runner.state(run_id).open_actions:
                    outcome = "succeeded" if action.idempotency_key in keys else "failed"
                    runner.resolve(run_id, action.execution_id, outcome, note="ledger checked",
                                   by="drill")
                runner.resume(run_id, drill_model(seed), tools)
        _check(runner, base, run_ids, report)
    report.elapsed_s = round(time.monotonic() - started, 2)
    return report


def _check(runner: Any, base: Path, run_ids: list[str], report: DrillReport) -> None:
    from boundloop.policy.replay import ReplayError, replay

    lines = ledger(base / "ledger")
    executions = Counter(k for k, _ in lines)
    tool_of = dict(lines)
    recovered = [json.loads(x) for x in (base / "recovered.jsonl").read_text().splitlines()] \
        if (base / "recovered.jsonl").exists() else []
    report.runs_recovered = len(recovered)
    report.unresolved_found = sum(len(r["unresolved"]) for r in recovered)
    intents: dict[str, str] = {}
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
    report.executed_without_intent = sum(1 for k in executions if k not in intents)
    report.duplicate_executions = sum(n - 1 for k, n in executions.items()
                                      if n > 1 and tool_of.get(k) != "charge")


def format_report(report: DrillReport, command: str) -> str:
    """The report as aligned lines, ending with the command that reproduces it."""
    rows = [(f.replace("_", " "), getattr(report, f)) for f in report.__struct_fields__]
    width = max(len(k) for k, _ in rows)
    body = "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)
    verdict = "PASS" if report.ok else "FAIL"
    return f"crash-recovery drill: {verdict}\n{body}\nreproduce: {command}"


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "worker":
        j, lg, rf, sd, cc, log = sys.argv[2:8]
        worker(j, lg, rf, int(sd), int(cc), log)
    else:
        ap = argparse.ArgumentParser(prog="python -m boundloop.drill")
        ap.add_argument("--runs", type=int, default=200)
        ap.add_argument("--kills", type=int, default=50)
        ap.add_argument("--seed", type=int, default=1)
        ap.add_argument("--dir", default=None)
        a = ap.parse_args()
        import tempfile

        d = Path(a.dir) if a.dir else Path(tempfile.mkdtemp(prefix="boundloop-drill-"))
        rep = run_drill(d, a.runs, a.kills, a.seed)
        print(format_report(rep, f"boundloop drill --runs {a.runs} --kills {a.kills} "
                                 f"--seed {a.seed}"))
        sys.exit(0 if rep.ok else 1)
