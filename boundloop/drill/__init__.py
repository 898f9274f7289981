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

Each job has a private module: ``_workload`` (plans, model, tools, the downstream ledger),
``_worker`` (a worker process), ``_processes`` (spawning and watching workers, lock probes),
``_postgres`` (a fresh database, server restarts), ``_chaos`` (the fault loop, the person at
the end), ``_invariants`` (the checks), ``_report`` (reports and the command line that
reproduces them); ``_queue_worker`` and ``_queue_drill`` are ``boundloop drill --queue``.
``python -m boundloop.drill`` runs a drill (see ``__main__``).
"""

from __future__ import annotations

from boundloop.drill._chaos import run_drill, settle
from boundloop.drill._postgres import fresh_database, pg_restart_argv
from boundloop.drill._processes import can_unshare
from boundloop.drill._queue_drill import decision, run_queue_drill
from boundloop.drill._queue_worker import drill_agent, queue_plan, serve
from boundloop.drill._report import DrillReport, QueueDrillReport, command, format_report
from boundloop.drill._worker import worker
from boundloop.drill._workload import (
    Downstream,
    Effect,
    StaleAttempt,
    drill_model,
    drill_tools,
    effects,
    ledger,
    ledger_size,
    plan,
)

__all__ = [
    # running a drill, and its report
    "run_drill", "run_queue_drill", "DrillReport", "QueueDrillReport", "format_report",
    "command", "can_unshare", "settle", "decision",
    # what the workers run
    "worker", "serve", "plan", "queue_plan", "drill_model", "drill_tools", "drill_agent",
    "Downstream", "StaleAttempt", "Effect", "effects", "ledger", "ledger_size",
    # PostgreSQL
    "fresh_database", "pg_restart_argv",
]
