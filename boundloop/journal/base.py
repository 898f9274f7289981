"""The journal's narrow interface, written once for every backend (DESIGN rule 5)."""

from __future__ import annotations

import abc
import hmac
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import msgspec

from boundloop import keys
from boundloop.errors import ConfigError, JournalCorrupt, UnknownRun
from boundloop.events import CallResolved, Event, OwnerClaimed

# Defined with the liveness rules that read it; re-exported here, as part of the interface
# (boundloop.owners imports nothing of the journal: no owners -> journal -> owners cycle).
from boundloop.owners import OwnerRecord as OwnerRecord

__all__ = [
    "Chained", "Done", "Fence", "Journal", "OwnerRecord", "RunInfo", "StoredIndex",
    "Submission", "about_to_sync", "answer", "batches", "check_run_id", "drain", "is_claim",
    "unforced_claim", "valid_run_id",
]

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
    #: The ownership epoch: 1 at admission, one more at each claim (SPEC 6).
    epoch: int = 0


class Fence(msgspec.Struct, frozen=True):
    """Who may append to a run: the owner at its epoch. An append fenced by another owner
    or an older epoch stores nothing and fails with LeaseLost."""

    owner: str
    epoch: int


def valid_run_id(run_id: object) -> bool:
    """True when ``run_id`` can name a run (see ``check_run_id``)."""
    if not isinstance(run_id, str) or not run_id or "\x00" in run_id:
        return False
    try:
        return len(run_id.encode()) <= 256
    except UnicodeEncodeError:
        return False


def check_run_id(run_id: object) -> str:
    """``run_id`` if it can name a run (a non-empty string of valid Unicode without NUL, at
    most 256 bytes of UTF-8), else ConfigError saying why and what to do."""
    if not isinstance(run_id, str):
        raise ConfigError(f"a run id must be a string, got {type(run_id).__name__}; pass "
                          "run_id=None to have one generated")
    if not run_id:
        raise ConfigError("a run id must not be empty; pass run_id=None to have one "
                          "generated")
    try:
        size = len(run_id.encode())
    except UnicodeEncodeError as exc:
        raise ConfigError(f"a run id must be valid Unicode text, but this one holds a lone "
                          f"surrogate at position {exc.start} (often from a file name or "
                          "bytes decoded with errors='surrogateescape'); decode it with "
                          "errors='replace', or use another id") from None
    if "\x00" in run_id:
        raise ConfigError("a run id must not contain a NUL character; use another id")
    if size > 256:
        raise ConfigError(f"a run id may be at most 256 bytes of UTF-8, and this one has "
                          f"{size}; use a shorter id (a hash of a long one, for example)")
    return run_id


T = TypeVar("T")


#: One append for ``Journal.submit_many``: (run id, expected seq, events, done, fence).
Submission = tuple[str, int, Sequence[Event], Done, "Fence | None"]


def answer(requests: Sequence[Any], outcomes: Sequence[BaseException | None],
           started: float, on_commit: Callable[[float, int], None] | None) -> None:
    """A backend's commit of ``requests`` (each with a ``done``) ended with ``outcomes``:
    report its latency (from ``started``, a perf_counter) and size to ``on_commit`` when
    anything was stored, then answer each request. Neither a hook nor a callback that
    raises may stop the thread that committed."""
    if on_commit is not None and outcomes and not all(outcomes):
        try:
            on_commit(time.perf_counter() - started, len(requests))
        except Exception:  # noqa: BLE001 - telemetry must not stop the writer
            pass
    for req, outcome in zip(requests, outcomes, strict=True):
        try:
            req.done(outcome)
        except Exception:  # noqa: BLE001 - a callback must not stop the writer
            pass


def about_to_sync(hook: Callable[[], None] | None) -> None:
    """A backend is about to wait for its disk or server inside a commit: tell ``hook``
    (telemetry projects meanwhile, see ``Telemetry.before_sync``); it may not stop the commit."""
    if hook is not None:
        try:
            hook()
        except Exception:  # noqa: BLE001 - telemetry must not stop the writer
            pass


def unforced_claim(fence: Fence | None, events: Sequence[Event], holder: str) -> bool:
    """True when an append of ``events`` claims a run that ``holder`` owns, and is not a
    forced resolve: then the backend judges ``holder`` once more in the claim's own
    transaction, on its owner record as it is then (``boundloop.owners.owner_alive``), and
    refuses the claim (``SequenceConflict``) if it is alive. A claimer that judged the owner
    gone on a record read earlier (the owner renewed its lease since: it woke up) must not
    land a claim while that owner starts attempts. A forced resolve claims from a live owner
    on purpose (SPEC 6)."""
    return fence is None and bool(holder) and is_claim(events, other_than=holder)


def is_claim(events: Sequence[Event], other_than: str | None = None) -> bool:
    """True when ``events`` claim their run (an ``OwnerClaimed``, for an owner other than
    ``other_than`` when given) and are not a forced resolve, which claims on purpose."""
    return any(isinstance(e, OwnerClaimed) and e.owner != other_than for e in events) \
        and not any(isinstance(e, CallResolved) and e.forced for e in events)


def drain(requests: queue.SimpleQueue[T | None], into: list[T], limit: int) -> bool:
    """Move what is queued in ``requests`` to ``into``, without waiting, until ``into``
    holds ``limit``; True when it took a None (the queue's end)."""
    while len(into) < limit:
        try:
            nxt = requests.get_nowait()
        except queue.Empty:
            return False
        if nxt is None:
            return True
        into.append(nxt)
    return False


def batches(requests: queue.SimpleQueue[T | None], limit: int) -> Iterator[list[T]]:
    """Group commit's batching, for a backend's writer thread: each batch is the request it
    waited for plus every one queued meanwhile (at most ``limit``); ends at a None."""
    while True:
        first = requests.get()
        if first is None:
            return
        batch = [first]
        stop = drain(requests, batch, limit)
        yield batch
        if stop:
            return


class Journal(abc.ABC):
    """An append-only log of events per run, with an index of runs and their owners: the
    store protocol, the one place that lists what a backend is (DESIGN rule 5).

    A backend must implement: ``submit`` (append after an expected sequence, fenced by
    owner and epoch), ``read``, ``find``, ``runs``, ``open_runs``, ``put_owner``,
    ``owners``, ``remove_owner``, ``prune``, ``secret_key``, ``close`` and ``closed``.
    Everything else has a default written on those: ``submit_many``, ``append``,
    ``events``, ``info``, ``infos``, ``open_infos``, ``bind_key``, and the hooks a runner
    sets or reads (``on_commit``, ``before_sync``, ``wait_limits``), which a backend
    without commits to time or lock waits to bound leaves as they are. Nothing else in
    the package asks a journal for more (``Chained`` adds what ``boundloop verify``
    needs). ``boundloop.testing.JournalContract`` is the behaviour every backend must
    have; ``boundloop.journal.memory.MemoryJournal`` is the smallest backend that has it.
    """

    #: Called by the backend after each durable commit with ``(latency_s, appends)``
    #: (telemetry; a Runner sets it). None: nobody listens.
    on_commit: Callable[[float, int], None] | None = None
    #: Called by the backend as a commit is about to wait for its disk or server (see
    #: ``about_to_sync``; a Runner sets it). None: nobody listens.
    before_sync: Callable[[], None] | None = None

    def bind_key(self, source: keys.KeySource | None) -> bytes | None:
        """Take the redaction key a Runner is given (``bl.Runner(redaction_key=...)``).

        A backend that resolves keys itself (``keys.KeyedJournal``: LMDB, PostgreSQL)
        finds, checks and records it. This default has a key of its own (``secret_key``):
        a key given must be that one. Returns the key when one was given, else None.

        Raises:
            ConfigError: the key given is not this journal's.
        """
        given = keys.given_key(source, env=False)
        if given is None:
            return None
        key = self.secret_key
        if not hmac.compare_digest(keys.fingerprint(given[0]), keys.fingerprint(key)):
            raise ConfigError(f"the redaction key from {given[1]} is not the key of the "
                              f"journal {self!r}; give the journal itself that key, or give "
                              "the runner the journal's key")
        return key

    @property
    def wait_limits(self) -> dict[str, float]:
        """Run id -> the ``time.monotonic()`` by which that run's appends must be written or
        fail, for a backend whose appends may wait for a lock another process holds (LMDB);
        the runner sets an entry for a run with a deadline. This default keeps nothing: a
        backend without such waits has nothing to bound."""
        return {}

    @abc.abstractmethod
    def submit(self, run_id: str, expected_seq: int, events: Sequence[Event], done: Done,
               fence: Fence | None = None) -> None:
        """Queue ``events`` for appending after ``expected_seq``; ``done`` is called once they
        are durable (with None) or were refused (with the error). Concurrent submissions
        share one durable commit.

        In the same write transaction as the events, the backend checks, in order: the
        ``fence`` (when given, the run's owner and epoch must be the fence's, else
        ``LeaseLost``), then the sequence (else ``SequenceConflict``). A refused append
        stores nothing. Events that change ownership move it as they are written:
        ``RunAdmitted`` makes its owner the owner at epoch 1; ``OwnerClaimed`` (whose
        epoch must be the run's epoch + 1, or 0 for "the next one") makes its owner the
        owner at that epoch."""

    def submit_many(self, requests: Sequence[Submission]) -> None:
        """``submit`` each of ``requests``, as one group commit where the backend can.

        A backend may commit them in the calling thread, with whatever else is waiting, and
        call their ``done`` callbacks before this returns (LMDB does: an actor that hands
        over its batch saves the hand-offs to a writer thread and back). One request that
        raises does not keep the others from going; the first such error is raised after."""
        first: Exception | None = None
        for run_id, expected_seq, events, done, fence in requests:
            try:
                self.submit(run_id, expected_seq, events, done, fence)
            except Exception as exc:  # noqa: BLE001 - the others still go; raised after
                first = first or exc
        if first is not None:
            raise first

    def append(self, run_id: str, expected_seq: int, events: Sequence[Event],
               fence: Fence | None = None) -> int:
        """Append ``events`` durably after ``expected_seq`` and return the new last sequence.

        Raises:
            LeaseLost: ``fence`` no longer owns the run; nothing stored.
            SequenceConflict: the run's last sequence is not ``expected_seq``; nothing stored.
            JournalUnavailable: the journal cannot record anything.
        """
        box: list[BaseException | None] = []
        flag = threading.Event()

        def done(err: BaseException | None) -> None:
            box.append(err)
            flag.set()

        self.submit(run_id, expected_seq, events, done, fence)
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

    def infos(self) -> list[RunInfo]:
        """Every run's index entry, oldest first (a backend may read them in one go; this
        default asks ``find`` for each of ``runs``)."""
        return [i for i in (self.find(r) for r in self.runs()) if i is not None]

    def open_infos(self) -> list[RunInfo]:
        """The index entries of the open runs, oldest first (a backend may read them in one
        go; this default asks ``find`` for each of ``open_runs``)."""
        out = []
        for run_id in self.open_runs():
            info = self.find(run_id)
            if info is not None:
                out.append(info)
        return out

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
              keep: Callable[[RunInfo], bool] | None = None, *,
              progress: Callable[[int, int | None], None] | None = None) -> list[str]:
        """Remove runs that finished before ``finished_before`` (epoch seconds), except those
        ``keep`` says to keep; return the removed (or, with ``dry_run``, removable) ids.
        ``progress``, if given, is told ``(runs removed, runs to remove)`` as it goes."""

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


class StoredIndex(RunInfo):
    """A run's index entry as a chained backend stores it: its RunInfo and the head of its
    hash chain."""

    #: The link of the run's last record (``chain.seed(run_id)`` before the first).
    head: bytes = b""


class Chained(Journal):
    """A journal that keeps a hash chain per run (``boundloop.journal.chain``), which
    ``boundloop verify`` checks: LMDB's and PostgreSQL's. ``find`` returns ``StoredIndex``
    entries."""

    def chain_head(self, run_id: str) -> bytes:
        """Check the whole of run ``run_id`` (as ``read`` does) and return its chain head,
        the link of its last record: an auditor who keeps it can later show the run's
        records unchanged (``boundloop verify`` prints it in hex).

        Raises:
            UnknownRun: no run has that id.
            JournalCorrupt: (a ``chain.ChainError``) naming the run and sequence number.
        """
        if not valid_run_id(run_id):
            raise UnknownRun(f"{run_id!r} cannot name a run")
        head = self._checked_head(run_id)
        if head is None:
            raise UnknownRun(f"no run {run_id!r} in this journal; `boundloop runs` lists them")
        return head

    @abc.abstractmethod
    def _checked_head(self, run_id: str) -> bytes | None:
        """Read the whole run, checked as ``read`` checks it, and return the head its index
        entry keeps; None when there is no such run."""

    def stored_head(self, run_id: str) -> bytes | None:
        """The chain head the run's index entry keeps (unchecked), None when unreadable."""
        try:
            info = self.find(run_id)
        except JournalCorrupt:
            return None
        return info.head if isinstance(info, StoredIndex) else None

    @abc.abstractmethod
    def indexed_run_ids(self) -> list[str]:
        """Every run id in the run index, oldest first, whatever state the runs are in."""

    @abc.abstractmethod
    def recorded_run_ids(self) -> list[str]:
        """Every run id that records are stored under, sorted."""
