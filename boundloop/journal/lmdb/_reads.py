"""Reads, each checked against the run's chain and index; owners; pruning."""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from boundloop import events as ev
from boundloop.errors import (
    JournalCorrupt,
)
from boundloop.journal import chain, codec
from boundloop.journal._core import check_chain_end, prune_runs
from boundloop.journal.base import (
    OwnerRecord,
    RunInfo,
    valid_run_id,
)
from boundloop.journal.lmdb._errors import _guarded
from boundloop.journal.lmdb._records import (
    _SEP,
    _decode_index,
    _ekey,
    _info_enc,
    _names,
    _owner_dec,
    _seq_of,
)


class _Reads:
    """LmdbJournal's reads and maintenance (a part of the class)."""

    if TYPE_CHECKING:  # set up by LmdbJournal.__init__, or in _Writes
        path: Path
        _events: Any
        _runs: Any
        _order: Any
        _open: Any
        _owners: Any

        def _usable(self, write: bool = False) -> None: ...
        def _txn(self, db: Any = None, write: bool = False,
                 until: float | None = None) -> contextlib.AbstractContextManager[Any]: ...

    def read(self, run_id: str, after: int = 0) -> Iterator[tuple[int, ev.Event]]:
        """The run's ``(seq, event)`` pairs after ``after``, each checked first: the sequence
        is dense up to the index's last, every record matches its chain link, and the chain
        ends at the head kept in the run's index. Nothing is returned unless all of it holds
        (records before ``after`` are not read: the link of record ``after`` starts the check).

        Raises:
            JournalCorrupt: (a ``chain.ChainError``) naming the run and sequence number.
        """
        self._usable()
        if not valid_run_id(run_id):
            return iter(())
        with _guarded(f"run {run_id!r}"), self._txn() as txn:
            return iter(self._read_in(txn, run_id, max(after, 0)))

    def _read_in(self, txn: Any, run_id: str, after: int) -> list[tuple[int, ev.Event]]:
        rid = run_id.encode()
        prefix = rid + _SEP
        raw = txn.get(rid, db=self._runs)
        cur = txn.cursor(db=self._events)
        if raw is None:
            if cur.set_range(prefix) and cur.key().startswith(prefix):
                raise chain.ChainError(run_id, _seq_of(cur.key(), prefix),
                                       "records of a run that has no index entry")
            return []
        info = _decode_index(run_id, raw)
        last = info.last_seq
        if len(info.head) != chain.LINK_SIZE:
            raise chain.ChainError(run_id, 0, "the run's index entry holds no chain head")
        after = min(after, last)
        if after == 0:
            prev = chain.seed(run_id)
        else:
            start = txn.get(_ekey(run_id, after), db=self._events)
            if start is None or len(start) <= chain.LINK_SIZE:
                raise chain.ChainError(run_id, after, "the record is missing or truncated")
            prev = start[:chain.LINK_SIZE]
        out: list[tuple[int, ev.Event]] = []
        expected = after + 1
        # The per-record checks of _seq_of and chain.unseal, inlined: this loop is most of
        # a replay's time (measured: ~25 % faster than calling them per record).
        size, blake2b, decode = chain.LINK_SIZE, hashlib.blake2b, codec.decode
        if cur.set_range(_ekey(run_id, expected)):
            for key, value in cur:
                if key != prefix + expected.to_bytes(8, "big"):
                    if not key.startswith(prefix):
                        break
                    seq = _seq_of(key, prefix)
                    what = (f"the record is missing (the next one stored is seq {seq})"
                            if seq > expected else "a record's key is damaged")
                    raise chain.ChainError(run_id, expected, what)
                link = value[:size]
                body = value[size:]
                if len(value) <= size or \
                        blake2b(prev + body, digest_size=size).digest() != link:
                    chain.unseal(run_id, expected, prev, value)  # raises, saying what
                prev = link
                try:
                    event = decode(body, run_id)
                except JournalCorrupt as exc:
                    raise chain.ChainError(run_id, expected,
                                           f"the record does not decode: {exc}") from None
                out.append((expected, event))
                expected += 1
        check_chain_end(run_id, expected, last, prev, info.head)
        return out

    def _checked_head(self, run_id: str) -> bytes | None:
        self._usable()
        with _guarded(f"run {run_id!r}"), self._txn() as txn:
            self._read_in(txn, run_id, 0)
            raw = txn.get(run_id.encode(), db=self._runs)
            return None if raw is None else _decode_index(run_id, raw).head

    def indexed_run_ids(self) -> list[str]:
        """Every run id in the indexes (the order index's, oldest first, then any other run
        with an index entry), whatever state they are in: what ``boundloop verify`` checks.
        An id that is not valid UTF-8 (a damaged key) is named with backslash escapes."""
        self._usable()
        with _guarded("the run index"), self._txn() as txn:
            ordered = [v for _, v in txn.cursor(db=self._order)]
            entries = sorted(k for k, _ in txn.cursor(db=self._runs))
        return _names(ordered + entries)

    def recorded_run_ids(self) -> list[str]:
        """Every run id that records are stored under, sorted (one key read per run)."""
        self._usable()
        found: list[bytes] = []
        with _guarded("the records"), self._txn() as txn:
            cur = txn.cursor(db=self._events)
            more = cur.first()
            while more:
                rid = cur.key().split(_SEP, 1)[0]
                if found and rid <= found[-1]:
                    # Keys out of order: the walk would go round for ever.
                    raise JournalCorrupt(f"the journal at {self.path} is damaged: its "
                                         "records are out of order; restore it from a "
                                         "backup")
                found.append(rid)
                more = cur.set_range(rid + b"\x01")  # past every key of that run
        return _names(found)

    def find(self, run_id: str) -> RunInfo | None:
        self._usable()
        if not valid_run_id(run_id):
            return None
        with _guarded(f"run {run_id!r}"), self._txn() as txn:
            raw = txn.get(run_id.encode(), db=self._runs)
            if raw is not None:
                return _decode_index(run_id, raw)
            prefix = run_id.encode() + _SEP
            cur = txn.cursor(db=self._events)
            if cur.set_range(prefix) and cur.key().startswith(prefix):
                # Records without an index entry: a damaged index, not an unknown run.
                raise chain.ChainError(run_id, _seq_of(cur.key(), prefix),
                                       "records of a run that has no index entry")
            return None

    def runs(self) -> Iterator[str]:
        return iter([i.run_id for i in self.infos()])

    def infos(self) -> list[RunInfo]:
        """Every run's index entry, oldest first (each checked against the order index)."""
        self._usable()
        out: list[RunInfo] = []
        with _guarded("the run index"), self._txn() as txn:
            for key, rid in txn.cursor(db=self._order):
                run_id = rid.decode()
                raw = txn.get(rid, db=self._runs)
                info = None if raw is None else _decode_index(run_id, raw)
                if info is None or info.order.to_bytes(8, "big") != key:
                    raise chain.ChainError(run_id, 0, "the order index does not match the "
                                                      "run's index entry")
                out.append(info)
        return out

    def open_runs(self) -> Iterator[str]:
        return iter([info.run_id for info in self.open_infos()])

    def open_infos(self) -> list[RunInfo]:
        """The index entries of the open runs (each checked against the run index), in one
        read transaction."""
        self._usable()
        infos: list[RunInfo] = []
        with _guarded("the index of open runs"), self._txn() as txn:
            for key, _ in txn.cursor(db=self._open):
                run_id = key.decode()
                raw = txn.get(key, db=self._runs)
                info = None if raw is None else _decode_index(run_id, raw)
                if info is None or info.status is not None:
                    raise chain.ChainError(run_id, 0, "the index of open runs does not match "
                                                      "the run's index entry")
                infos.append(info)
        return infos

    # -- owners ------------------------------------------------------------------------

    def _write(self, fn: Any) -> Any:
        """Run ``fn(txn)`` in its own durable write transaction (rare, small writes).

        LMDB serialises write transactions, so this simply waits for the writer thread's.
        """
        self._usable(write=True)
        with _guarded(), self._txn(write=True) as txn:
            return fn(txn)

    def put_owner(self, record: OwnerRecord) -> None:
        self._write(lambda txn: txn.put(record.owner.encode(),
                                        chain.checksum(_info_enc.encode(record)),
                                        db=self._owners))

    def remove_owner(self, owner: str) -> None:
        self._write(lambda txn: txn.delete(owner.encode(), db=self._owners))

    def owners(self) -> dict[str, OwnerRecord]:
        self._usable()
        out: dict[str, OwnerRecord] = {}
        with _guarded("the runner index"), self._txn(self._owners) as txn:
            for key, value in txn.cursor():
                owner = key.decode()
                body = chain.verified(value)
                record = None if body is None else _owner_dec.decode(body)
                if record is None or record.owner != owner:
                    raise JournalCorrupt(f"the journal is damaged: the record of runner "
                                         f"{owner!r} does not match its checksum; restore the "
                                         "journal from a backup")
                out[owner] = record
        return out

    # -- retention ---------------------------------------------------------------------
    def prune(self, finished_before: float, dry_run: bool = False,
              keep: Callable[[RunInfo], bool] | None = None, *,
              progress: Callable[[int, int | None], None] | None = None) -> list[str]:
        def remove(victims: list[RunInfo]) -> set[str]:
            def delete(txn: Any) -> None:
                for n, info in enumerate(victims):
                    if progress is not None and n and n % 256 == 0:
                        progress(n, len(victims))
                    prefix = info.run_id.encode() + _SEP
                    cur = txn.cursor(db=self._events)
                    if cur.set_range(prefix):
                        while cur.key().startswith(prefix):
                            if not cur.delete():
                                break
                    txn.delete(info.run_id.encode(), db=self._runs)
                    txn.delete(info.order.to_bytes(8, "big"), db=self._order)

            self._write(delete)
            return {i.run_id for i in victims}

        return prune_runs(self.infos(), finished_before, dry_run, keep, progress, remove)
