"""How records are keyed and stored: event keys, index entries, tables, a queued append."""

from __future__ import annotations

import msgspec

from boundloop.journal import chain
from boundloop.journal._core import Request, StoredIndex
from boundloop.journal.base import OwnerRecord

_SEP = b"\x00"


#: A run's index entry as stored: its RunInfo and the head of its hash chain.
_Index = StoredIndex
#: A queued append.
_Request = Request


_info_enc = msgspec.msgpack.Encoder()
_info_dec = msgspec.msgpack.Decoder(_Index)
_owner_dec = msgspec.msgpack.Decoder(OwnerRecord)
#: Meta key of the record format (``chain.FORMAT``), a big-endian u32.
_FORMAT_KEY = b"format"
_TABLES = (b"events", b"runs", b"order", b"open", b"owners", b"meta")

#: The old key file inside a journal directory (``keys.legacy_key_file``; it is
#: not chmod-ed here, so its mode still says whether someone else could have written it).
KEY_FILE = "redaction.key"
#: The files a journal directory holds; only these are given mode 0600.
OWN_FILES = ("data.mdb", "lock.mdb")
#: Largest number of queued appends folded into one transaction.
MAX_BATCH = 4096


def _ekey(run_id: str, seq: int) -> bytes:
    return run_id.encode() + _SEP + seq.to_bytes(8, "big")


def _seq_of(key: bytes, prefix: bytes) -> int:
    """The sequence number in an event key (-1 when the key is not one)."""
    return int.from_bytes(key[len(prefix):], "big") if len(key) == len(prefix) + 8 else -1


def _names(ids: list[bytes]) -> list[str]:
    """Run ids as text, each once, in order."""
    seen: set[bytes] = set()
    out = []
    for rid in ids:
        if rid not in seen:
            seen.add(rid)
            name = rid.decode(errors="backslashreplace")
            if not name.isprintable():  # a damaged key: never control codes on a terminal
                name = "".join(c if c.isprintable() else f"\\x{ord(c):02x}" for c in name)
            out.append(name)
    return out


def _decode_index(run_id: str, raw: bytes) -> _Index:
    """A run's stored index entry, checked.

    Raises:
        JournalCorrupt: (a ``chain.ChainError``) it does not match its checksum or run.
    """
    body = chain.verified(raw)
    if body is None:
        raise chain.ChainError(run_id, 0, "the run's index entry does not match its checksum")
    try:
        info = _info_dec.decode(body)
    except msgspec.DecodeError:
        raise chain.ChainError(run_id, 0, "the run's index entry does not decode") from None
    if info.run_id != run_id:
        raise chain.ChainError(run_id, 0, f"the run's index entry names run {info.run_id!r}")
    return info
