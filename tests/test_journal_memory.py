"""A third-party journal backend, written here against the documented interface
(``boundloop.journal.base.Journal``) and nothing else, passes the shipped contract suite
(``boundloop.testing.JournalContract``) and carries a Runner's runs."""

from __future__ import annotations

import secrets
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import msgspec
import pytest

import boundloop as bl
from boundloop import events as ev
from boundloop.journal.base import (
    Done,
    Fence,
    Journal,
    OwnerRecord,
    RunInfo,
    unforced_claim,
)
from boundloop.owners import owner_alive
from boundloop.testing import JournalContract


class _Store:
    """What a MemoryJournal keeps; it outlives a closed journal, so a reopen finds it."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.events: dict[str, list[ev.Event]] = {}
        self.infos: dict[str, RunInfo] = {}
        self.owners: dict[str, OwnerRecord] = {}
        self.order = 0
        self.key = secrets.token_bytes(32)


_STORES: dict[str, _Store] = {}


class MemoryJournal(Journal):
    """A journal in this process's memory, one store per name: the smallest backend that
    keeps the contract (sequence, fencing, claims, the run index, owners, prune, close)."""

    def __init__(self, name: str) -> None:
        self._store = _STORES.setdefault(name, _Store())
        self._closed = False

    def submit(self, run_id: str, expected_seq: int, events: Sequence[ev.Event], done: Done,
               fence: Fence | None = None) -> None:
        events = list(events)
        with self._store.lock:
            error = self._append(run_id, expected_seq, events, fence)
        done(error)

    def _append(self, run_id: str, expected_seq: int, events: list[ev.Event],
                fence: Fence | None) -> BaseException | None:
        if self._closed:
            return bl.JournalUnavailable("this memory journal is closed")
        s = self._store
        old = s.infos.get(run_id)
        last = old.last_seq if old is not None else 0
        if fence is not None and old is not None and (old.owner, old.epoch) != \
                (fence.owner, fence.epoch):
            return bl.LeaseLost(f"run {run_id!r} is owned by {old.owner!r} at epoch "
                                f"{old.epoch}")
        if last != expected_seq:
            return bl.SequenceConflict(f"run {run_id!r} is at {last}, not {expected_seq}")
        if not events:
            return None
        if old is not None and unforced_claim(fence, events, old.owner) \
                and owner_alive(s.owners.get(old.owner)):
            return bl.SequenceConflict(f"run {run_id!r} is owned by {old.owner!r}, which is "
                                       "alive; the claim is refused")
        now = time.time()
        info = msgspec.structs.replace(old) if old is not None else \
            RunInfo(run_id, s.order + 1, created_ts=now)
        for event in events:
            if isinstance(event, ev.RunAdmitted):
                info.parent_run_id, info.owner, info.epoch = event.parent_run_id, \
                    event.owner, 1
            elif isinstance(event, ev.OwnerClaimed):
                epoch = event.epoch or info.epoch + 1
                if epoch != info.epoch + 1:
                    return bl.SequenceConflict(f"run {run_id!r} is at epoch {info.epoch}")
                info.owner, info.epoch = event.owner, epoch
            elif isinstance(event, ev.RunFinished):
                info.status, info.finished_ts = event.status, event.ts or now
            elif isinstance(event, ev.RunResumed):
                info.status, info.finished_ts = None, None
        info.last_seq, info.updated_ts = last + len(events), now
        if old is None:
            s.order += 1
        s.infos[run_id] = info
        s.events.setdefault(run_id, []).extend(events)
        return None

    def read(self, run_id: str, after: int = 0) -> Iterator[tuple[int, ev.Event]]:
        with self._store.lock:
            got = list(self._store.events.get(run_id, []))
        return iter([(n, e) for n, e in enumerate(got, start=1) if n > after])

    def find(self, run_id: str) -> RunInfo | None:
        with self._store.lock:
            return self._store.infos.get(run_id)

    def runs(self) -> Iterator[str]:
        with self._store.lock:
            infos = sorted(self._store.infos.values(), key=lambda i: i.order)
        return iter([i.run_id for i in infos])

    def open_runs(self) -> Iterator[str]:
        with self._store.lock:
            infos = sorted(self._store.infos.values(), key=lambda i: i.order)
        return iter([i.run_id for i in infos if i.finished_ts is None])

    def put_owner(self, record: OwnerRecord) -> None:
        with self._store.lock:
            self._store.owners[record.owner] = record

    def owners(self) -> dict[str, OwnerRecord]:
        with self._store.lock:
            return dict(self._store.owners)

    def remove_owner(self, owner: str) -> None:
        with self._store.lock:
            self._store.owners.pop(owner, None)

    def prune(self, finished_before: float, dry_run: bool = False,
              keep: Callable[[RunInfo], bool] | None = None, *,
              progress: Callable[[int, int | None], None] | None = None) -> list[str]:
        with self._store.lock:
            victims = [i.run_id for i in sorted(self._store.infos.values(),
                                                key=lambda i: i.order)
                       if i.finished_ts is not None and i.finished_ts < finished_before
                       and not (keep is not None and keep(i))]
            if not dry_run:
                for run_id in victims:
                    del self._store.infos[run_id], self._store.events[run_id]
        return victims

    @property
    def secret_key(self) -> bytes:
        return self._store.key

    def close(self) -> None:
        self._closed = True

    @property
    def closed(self) -> bool:
        return self._closed


class TestMemoryJournal(JournalContract):
    """The shipped contract, whole, on a backend that is not boundloop's."""

    files = False

    def make_store(self, path: Path) -> MemoryJournal:
        return MemoryJournal(str(path))


def test_a_runner_runs_on_the_memory_journal(tmp_path: Path) -> None:
    @bl.tool(idempotent=True)
    def add(a: int, b: int) -> int:
        """Adds."""
        return a + b

    model = bl.ScriptedModel([bl.CallTools([bl.ToolCall("c1", "add", {"a": 2, "b": 3})]),
                              bl.Final("5")])
    journal = MemoryJournal(str(tmp_path / "runner"))
    with bl.Runner(journal) as runner:
        result = runner.run(model, [add], "add them", run_id="sum")
        assert result.status == "final" and result.tool_calls == 1
        assert list(runner.journal.runs()) == ["sum"]
        assert bl.replay(runner.journal.events("sum")).transcript == result.transcript
        assert runner.recover() == []


def test_the_contract_needs_no_pytest_to_import_boundloop_testing() -> None:
    """``boundloop.testing`` imports without pytest (the contract loads on first use)."""
    code = ("import sys; sys.modules['pytest'] = None\n"
            "import boundloop.testing as t\n"
            "assert t.FaultyJournal and 'boundloop.testing._journal_contract' not in sys.modules\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr


def test_the_contract_is_in_the_package() -> None:
    import boundloop.testing

    assert boundloop.testing.JournalContract is JournalContract
    assert Path(sys.modules[JournalContract.__module__].__file__ or "").is_relative_to(
        Path(bl.__file__).parent)
    with pytest.raises(AttributeError):
        boundloop.testing.NoSuchThing  # noqa: B018
