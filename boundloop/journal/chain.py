"""The hash chain over a run's stored records, and the checksum of small index entries.

Record format (journal formats 2 and 3). Every event of a run is stored under the key
``run id || NUL || seq`` (seq a big-endian u64, dense from 1) as

    value = link (32 bytes) || body (the event's stored bytes: its msgpack bytes as
            ``codec.encode`` makes them, or their compressed form, ``codec.pack``)

where ``link_n = BLAKE2b-256(link_{n-1} || body_n)`` and ``link_0 = seed(run id)``, a BLAKE2b-256
of a fixed label and the run id, so a record moved to another run, to another position, or out
of the run breaks the chain. The run's index entry (its ``RunInfo``) keeps ``head``, the last
link, written in the same transaction as the records: a damaged, removed or appended-to last
record is caught too. The hash is plain, not keyed: an auditor who noted a run's head (``boundloop
verify`` prints it) can later recompute it from the records with nothing but this rule.

Small index entries (a run's ``RunInfo``, a runner's ``OwnerRecord``) are stored as
``BLAKE2b-128(body) || body`` so a damaged index entry is refused too, not read as other data.
"""

from __future__ import annotations

import hashlib

from boundloop.errors import JournalCorrupt

#: Bytes of a link; a record's value starts with its link.
LINK_SIZE = 32
#: Bytes of the checksum in front of an index entry.
SUM_SIZE = 16
#: The record format of a new journal (meta key ``format``): 2 = hash chain, plain msgpack
#: bodies.
FORMAT = 2
#: The format of a journal whose bodies may be compressed (``codec.pack``). A format 2 journal
#: becomes one when a writer opened with ``compress=True`` opens it: its plain bodies read as
#: they are (no record changes), and the stamp keeps an older boundloop from misreading it.
COMPRESSED = 3
#: The formats this version reads.
READS = (FORMAT, COMPRESSED)
_SEED_LABEL = b"boundloop journal chain v2\x00"


class ChainError(JournalCorrupt):
    """A run's stored records fail their check: ``run_id`` and ``seq`` say where (``seq`` is 0
    when the damage is in the run's index entry rather than in a record)."""

    def __init__(self, run_id: str, seq: int, what: str) -> None:
        self.run_id = run_id
        self.seq = seq
        self.what = what
        where = f"run {run_id!r}, seq {seq}" if seq else f"run {run_id!r}"
        super().__init__(f"the journal is damaged at {where}: {what}; its records cannot be "
                         "trusted: restore the journal from a backup (`boundloop verify` lists "
                         "every damaged run)")


def seed(run_id: str) -> bytes:
    """``link_0`` of run ``run_id``."""
    return hashlib.blake2b(_SEED_LABEL + run_id.encode(), digest_size=LINK_SIZE).digest()


def link(prev: bytes, body: bytes) -> bytes:
    """The link of a record whose body is ``body``, after a record whose link is ``prev``."""
    return hashlib.blake2b(prev + body, digest_size=LINK_SIZE).digest()


def seal(prev: bytes, body: bytes) -> bytes:
    """The stored value of a record: its link, then its body."""
    return link(prev, body) + body


def unseal(run_id: str, seq: int, prev: bytes, value: bytes) -> bytes:
    """The body of a stored record, after checking its link against ``prev``.

    Raises:
        ChainError: the record is too short or its link does not match.
    """
    if len(value) <= LINK_SIZE:
        raise ChainError(run_id, seq, f"the record is {len(value)} bytes, too short to be one")
    body = value[LINK_SIZE:]
    if link(prev, body) != value[:LINK_SIZE]:
        raise ChainError(run_id, seq, "the record does not match its hash-chain link "
                                      "(altered, or moved from elsewhere)")
    return body


def checksum(body: bytes) -> bytes:
    """The stored form of an index entry: a BLAKE2b-128 of it, then it."""
    return hashlib.blake2b(body, digest_size=SUM_SIZE).digest() + body


def verified(value: bytes) -> bytes | None:
    """The body of an index entry stored by ``checksum``, or None when it does not match."""
    body = value[SUM_SIZE:]
    if len(value) < SUM_SIZE or hashlib.blake2b(body, digest_size=SUM_SIZE).digest() \
            != value[:SUM_SIZE]:
        return None
    return body
