"""Journal commits that hang past a run's deadline: how a supervisor's runs are watched.

A journal commit may hang in the kernel (a frozen or hung file system): no deadline can
interrupt it. A run with a deadline is looked at from ``HUNG_AFTER_S`` past the deadline on
(``watch``, on the timer thread); what a supervisor shares with that watcher is its
``Shard``. The supervisor (actors/supervisor.py) acts on what the watch finds.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from boundloop.actors.workers import Timer
from boundloop.errors import JournalUnavailable
from boundloop.results import RunResult

#: How long a model call may run on past the run's deadline before it is abandoned.
GRACE_S = 0.5
#: From ``HUNG_AFTER_S`` past its deadline on, a run waiting for a commit that has taken this
#: long ends journal_unavailable without waiting for it (a commit begun later, the run's
#: RunFinished say, may take this long to record how the run ended).
COMMIT_PATIENCE_S = 0.25
#: When, past a run's deadline, its commits are first looked at: after the journal's own
#: wait for a busy write lock gave up (half the grace, see ``wait_limits``), so that a lock
#: held by another process is reported as such; early enough to end within the grace.
HUNG_AFTER_S = GRACE_S * 0.7
#: How often a run past that point is looked at again, until it ends.
WATCH_EVERY_S = 0.05


class Shard:
    """What a supervisor shares with the threads that watch it: whether its thread is inside
    a journal commit and since when, its runs, and runs given up on before it took them up.
    ``lock`` keeps a watcher and the supervisor's thread from touching a run at once: the
    supervisor holds it only to enter and leave a commit."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        #: time.monotonic() when the supervisor's thread entered a commit; 0.0 outside one.
        self.committing = 0.0
        #: The supervisor's runs (its ``_Run``s: this module does not import it, no cycle).
        self.runs: dict[str, Any] = {}
        #: Runs told to the supervisor that a watcher ended before it took them up.
        self.dropped: set[str] = set()
        #: Set by the supervisor: ends a run while its thread hangs in a commit (under
        #: ``lock``), and tells it to give up on a commit that hangs (``_CommitWall``).
        self.evict: Callable[[str, Any, float], None] | None = None
        self.wall: Callable[[str], None] | None = None

    def stuck_for(self) -> float:
        """Under ``lock``: how long the supervisor's thread has been inside a commit, if
        that is ``COMMIT_PATIENCE_S`` or more (it hangs); else 0.0."""
        since = self.committing
        took = time.monotonic() - since if since else 0.0
        return took if took >= COMMIT_PATIENCE_S else 0.0


def watch(shard: Shard, timer: Timer, run_id: str, deadline: float,
          future: weakref.ref[Future[RunResult]], drop: Callable[[float], bool]) -> None:
    """Watch a run with a deadline that was told to the supervisor of ``shard``, from
    ``HUNG_AFTER_S`` past ``deadline`` on (every ``WATCH_EVERY_S``, on the timer thread) until
    its Future is settled: a run waiting for a commit that hangs is given up on. The Future
    is held weakly (a watch far in the future keeps no result alive), and so should
    ``drop`` hold what it needs; while the run is in flight, its supervisor holds both. The
    supervisor does that itself (``_CommitWall``) while its thread is free; while its thread
    is the one stuck inside the commit, the watch ends the run (``SupervisorActor._evict``),
    or ``drop(took)`` ends a run it has not taken up yet (True: then it skips it later)."""

    def look() -> None:
        settled = future()
        if settled is None or settled.done():
            return  # ended (or the caller cancelled the Future: nobody waits for it)
        del settled
        with shard.lock:
            run = shard.runs.get(run_id)
            took = shard.stuck_for()
            if took and run is None:
                if drop(took):
                    shard.dropped.add(run_id)
                return
            if took and run is not None and shard.evict is not None:
                # Its supervisor's thread is stuck inside the journal (a frozen file
                # system): it cannot read its inbox, so the run ends from here.
                shard.evict(run_id, run, took)
                return
        if run is not None and shard.wall is not None:
            shard.wall(run_id)
        timer.after(WATCH_EVERY_S, look)

    timer.at(deadline + HUNG_AFTER_S, look)


def hung(took: float) -> JournalUnavailable:
    """The error of a run given up on while a journal commit hangs."""
    return JournalUnavailable(
        f"a journal commit had not returned after {took:.1f} s (a frozen or hung file "
        "system?) and the run's deadline had passed; the run ended without waiting for "
        "it, and nothing that commit was for was started")
