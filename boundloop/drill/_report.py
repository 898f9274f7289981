"""What a drill found (``DrillReport``, ``QueueDrillReport``), as lines, and the command
that reproduces it."""

from __future__ import annotations

import msgspec


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

class QueueDrillReport(DrillReport):
    """The drill's report (see DrillReport) with the queue's figures.

    ``terms_injected`` counts SIGTERMs (part of ``faults_injected``); ``exits_graceful`` the
    workers that exited 0 after a SIGTERM (the faults, and the stop of every worker at the
    end), ``exits_not_graceful`` those that did not (an invariant); ``runs_drained`` the
    runs a SIGTERMed worker let go open, for others to take over. ``claims_from_queue``
    counts the claims of queued runs (enqueued, or queued again after a decision), which are
    no takeovers. ``approvals_asked`` counts calls that waited for a person, ``approvals``
    and ``denials`` the decisions the journal records (by the person thread, or at the end).
    ``denied_executed`` counts side effects of denied calls, ``executed_without_approval``
    side effects of calls needing approval that no approval preceded (both invariants).
    """

    queue: bool = True
    terms_injected: int = 0
    exits_graceful: int = 0
    exits_not_graceful: int = 0
    runs_drained: int = 0
    claims_from_queue: int = 0
    approvals_asked: int = 0
    approvals: int = 0
    denials: int = 0
    denied_executed: int = 0
    executed_without_approval: int = 0

    @property
    def ok(self) -> bool:
        """True when every invariant held."""
        return super().ok and not (self.denied_executed or self.executed_without_approval
                                   or self.exits_not_graceful)

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
