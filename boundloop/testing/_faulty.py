"""A fault-injecting journal wrapper (``boundloop.testing.FaultyJournal``)."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable, Iterator, Sequence

from boundloop.errors import ConfigError, JournalUnavailable
from boundloop.events import Event
from boundloop.journal.base import Done, Fence, Journal, OwnerRecord, RunInfo

MODES = ("raise", "kill_before", "kill_after")


class FaultyJournal(Journal):
    """A journal that fails at its ``fail_at``-th append (1-based) and works otherwise.

    Modes: ``raise`` refuses that append with JournalUnavailable (nothing stored);
    ``kill_before`` SIGKILLs this process before the append is written; ``kill_after``
    SIGKILLs it right after the append became durable, before anyone learns of it.
    ``writes`` counts the appends seen so far (to size a sweep).
    """

    def __init__(self, inner: Journal, fail_at: int | None = None, mode: str = "raise") -> None:
        if mode not in MODES:
            raise ConfigError(f"FaultyJournal mode must be one of {MODES}, not {mode!r}")
        self.inner = inner
        self.fail_at = fail_at
        self.mode = mode
        self.writes = 0
        self._lock = threading.Lock()

    def submit(self, run_id: str, expected_seq: int, events: Sequence[Event], done: Done,
               fence: Fence | None = None) -> None:
        with self._lock:
            self.writes += 1
            hit = self.writes == self.fail_at
        if not hit:
            self.inner.submit(run_id, expected_seq, events, done, fence)
        elif self.mode == "raise":
            done(JournalUnavailable(f"injected failure at append {self.writes}"))
        elif self.mode == "kill_before":
            os.kill(os.getpid(), signal.SIGKILL)
        else:
            def then_die(err: BaseException | None) -> None:
                os.kill(os.getpid(), signal.SIGKILL)

            self.inner.submit(run_id, expected_seq, events, then_die, fence)

    def read(self, run_id: str, after: int = 0) -> Iterator[tuple[int, Event]]:
        return self.inner.read(run_id, after)

    def find(self, run_id: str) -> RunInfo | None:
        return self.inner.find(run_id)

    def runs(self) -> Iterator[str]:
        return self.inner.runs()

    def open_runs(self) -> Iterator[str]:
        return self.inner.open_runs()

    def put_owner(self, record: OwnerRecord) -> None:
        self.inner.put_owner(record)

    def owners(self) -> dict[str, OwnerRecord]:
        return self.inner.owners()

    def remove_owner(self, owner: str) -> None:
        self.inner.remove_owner(owner)

    def prune(self, finished_before: float, dry_run: bool = False,
              keep: Callable[[RunInfo], bool] | None = None, *,
              progress: Callable[[int, int | None], None] | None = None) -> list[str]:
        return self.inner.prune(finished_before, dry_run, keep, progress=progress)

    @property
    def secret_key(self) -> bytes:
        return self.inner.secret_key

    def close(self) -> None:
        self.inner.close()

    @property
    def closed(self) -> bool:
        return self.inner.closed
