"""The journal's narrow interface, written once for every backend (DESIGN rule 5)."""

from __future__ import annotations

import abc
import threading
from collections.abc import Callable, Iterator, Sequence

import msgspec

from boundloop.errors import ConfigError, UnknownRun
from boundloop.events import Event

#: Called by the journal's writer once an append is durable (None) or has failed.
Done = Callable[[BaseException | None], None]


class RunInfo(msgspec.Struct):
    """The index entry of one run: kept in the same transaction as its events."""

    run_id: str
    order: int
    last_seq: int = 0
    created_ts: float = 0.0
    updated_ts: float = 0.0
    status: str | None = None
    finished_ts: float | None = None
    parent_run_id: str | None = None
    owner: str = ""


class OwnerRecord(msgspec.Struct, frozen=True):
    """A runner process that drives runs: how to tell whether it is still there."""

    owner: str
    pid: int
    host: str
    started: float
    lease_until: float


def valid_run_id(run_id: object) -> bool:
    """True when ``run_id`` can name a run (see ``check_run_id``)."""
    return isinstance(run_id, str) and bool(run_id) and "\x00" not in run_id \
        and len(run_id.encode()) <= 256


def check_run_id(run_id: object) -> str:
    """``run_id`` if it can name a run, else ConfigError saying why."""
    if not isinstance(run_id, str) or not run_id:
        raise ConfigError(f"a run id must be a non-empty string, got {run_id!r}")
    if not valid_run_id(run_id):
        raise ConfigError("a run id must have no NUL character and at most 256 bytes")
    return run_id


class Journal(abc.ABC):
    """An append-only log of events per run, with an index of runs and their owners."""

    @abc.abstractmethod
    def submit(self, run_id: str, expected_seq: int, events: Sequence[Event], done: Done) -> None:
        """Queue ``events`` for appending after ``expected_seq``; ``done`` is called once they
        are durable (with None) or were refused (with the error). A sequence conflict stores
        nothing of this append. Concurrent submissions share one durable commit."""

    def append(self, run_id: str, expected_seq: int, events: Sequence[Event]) -> int:
        """Append ``events`` durably after ``expected_seq`` and return the new last sequence.

        Raises:
            SequenceConflict: the run's last sequence is not ``expected_seq``; nothing stored.
            JournalUnavailable: the journal cannot record anything.
        """
        box: list[BaseException | None] = []
        flag = threading.Event()

        def done(err: BaseException | None) -> None:
            box.append(err)
            flag.set()

        self.submit(run_id, expected_seq, events, done)
        flag.wait()
        if box[0] is not None:
            raise box[0]
        return expected_seq + len(events)

    @abc.abstractmethod
    def read(self, run_id: str, after: int = 0) -> Iterator[tuple[int, Event]]:
        """``(seq, event)`` pairs of the run after sequence ``after``, in order."""

    def events(self, run_id: str) -> Iterator[Event]:
        """The run's events, in order.

        Raises:
            UnknownRun: no run has that id.
        """
        self.info(run_id)
        return (event for _, event in self.read(run_id))

    @abc.abstractmethod
    def find(self, run_id: str) -> RunInfo | None:
        """The run's index entry, or None when there is no such run."""

    def info(self, run_id: str) -> RunInfo:
        """The run's index entry.

        Raises:
            UnknownRun: no run has that id.
        """
        found = self.find(run_id)
        if found is None:
            raise UnknownRun(f"no run {run_id!r} in this journal; `boundloop runs` lists them")
        return found

    @abc.abstractmethod
    def runs(self) -> Iterator[str]:
        """Every run id in the journal, oldest first."""

    @abc.abstractmethod
    def open_runs(self) -> Iterator[str]:
        """Ids of runs that have no RunFinished event (or were resumed since)."""

    @abc.abstractmethod
    def put_owner(self, record: OwnerRecord) -> None:
        """Register or renew a runner (durably)."""

    @abc.abstractmethod
    def owners(self) -> dict[str, OwnerRecord]:
        """Every registered runner, by owner id."""

    @abc.abstractmethod
    def remove_owner(self, owner: str) -> None:
        """Forget a runner that closed cleanly."""

    @abc.abstractmethod
    def prune(self, finished_before: float, dry_run: bool = False,
              keep: Callable[[RunInfo], bool] | None = None) -> list[str]:
        """Remove runs that finished before ``finished_before`` (epoch seconds), except those
        ``keep`` says to keep; return the removed (or, with ``dry_run``, removable) ids."""

    @property
    @abc.abstractmethod
    def secret_key(self) -> bytes:
        """The per-journal key under which redacted values are digested."""

    @abc.abstractmethod
    def close(self) -> None:
        """Make the journal unavailable; pending and later appends fail closed."""

    @property
    @abc.abstractmethod
    def closed(self) -> bool:
        """True once closed."""

    def __enter__(self) -> Journal:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
