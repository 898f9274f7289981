"""The drill's verdict: the journal checked against the ledger of real side effects and
the workers' own logs (see ``boundloop.drill``)."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from boundloop import events as ev
from boundloop.core import kinds
from boundloop.drill._processes import _Life
from boundloop.drill._report import DrillReport
from boundloop.drill._workload import Downstream, Effect, _append_line, effects

#: An attempt dispatched before its worker froze, whose handler started at most this long
#: after the worker woke from that pause (which began before the claim), passed the
#: runner's gate before the freeze (see _check): ``attempts_frozen_at_start``, not a zombie
#: execution.
FROZEN_START_S = 0.1
#: Explanations of a run that stopped because of its ownership (SPEC 6).
REFUSED = "this runner stopped driving it"  # the journal refused a fenced append
SELF_FENCED = "fenced itself"  # the runner's own lease ran out: it started nothing more

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
    from boundloop.core.replay import ReplayError, replay

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
        report.sent_to_review += sum(1 for e in finishes if kinds.needs_review(e.status))
        report.reconciled_automatically += sum(isinstance(e, ev.CallReconciled) for e in events)
        report.retried_idempotent += sum(isinstance(e, ev.CallDispatched) and e.attempt > 1
                                         for e in events)
        if not finishes or (finishes[-1].status, finishes[-1].model_steps,
                            finishes[-1].tool_calls) != (state.status, state.model_steps,
                                                         state.tool_calls):
            report.replay_mismatches += 1
        if not kinds.is_final(state.status):
            report.runs_not_final += 1
        for rec in state.calls.values():
            intents[rec.idempotency_key] = rec.tool
            ran = executions[rec.idempotency_key] > 0
            if ran and rec.status in kinds.NOT_RUN_STATUSES:
                report.unresolved_missed += 1  # the journal says it did not happen; it did
            if not ran and kinds.is_ok(rec.status):
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
            if kinds.is_journal_unavailable(n["status"]):
                report.zombie_appends_refused += REFUSED in n["explanation"]
                report.self_fenced += SELF_FENCED in n["explanation"]
                report.runs_unavailable += not (REFUSED in n["explanation"]
                                                or SELF_FENCED in n["explanation"])
            elif not kinds.is_rejected(n["status"]):
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
