"""What an LMDB journal's files hold, read with py-lmdb itself, beside boundloop (for tests
of the stored form: the format stamp, the stored bodies, the pages)."""

from __future__ import annotations

from pathlib import Path

import lmdb

from boundloop.journal import chain


def _env(path: Path) -> lmdb.Environment:
    return lmdb.open(str(path), readonly=True, lock=False, max_dbs=8)


def stored_format(path: Path) -> int:
    """The record format the journal in ``path`` is stamped with (meta key ``format``)."""
    env = _env(path)
    try:
        with env.begin() as txn:
            raw = txn.get(b"format", db=env.open_db(b"meta", txn=txn, create=False))
        assert raw is not None, "the journal has no format stamp"
        return int.from_bytes(raw, "big")
    finally:
        env.close()


def stored_bodies(path: Path) -> list[bytes]:
    """Every stored event body (a record's value without its chain link), in key order."""
    env = _env(path)
    try:
        with env.begin() as txn:
            db = env.open_db(b"events", txn=txn, create=False)
            return [bytes(v[chain.LINK_SIZE:]) for _, v in txn.cursor(db)]
    finally:
        env.close()


def event_pages(path: Path) -> int:
    """Bytes of B-tree pages (branch, leaf, overflow) of the journal's events table."""
    env = _env(path)
    try:
        with env.begin() as txn:
            st = txn.stat(env.open_db(b"events", txn=txn, create=False))
        return int(st["psize"] * (st["leaf_pages"] + st["branch_pages"]
                                  + st["overflow_pages"]))
    finally:
        env.close()


def flip_first_record_byte(path: Path, run_id: str) -> None:
    """Damage the first record of ``run_id`` (one byte of its body flipped), as a bad disk
    would; the journal must be closed."""
    env = lmdb.open(str(path), max_dbs=8)
    try:
        with env.begin(write=True) as txn:
            db = env.open_db(b"events", txn=txn, create=False)
            for key, value in txn.cursor(db):
                if key.startswith(run_id.encode() + b"\x00"):
                    body = bytearray(value)
                    body[-1] ^= 0x01
                    txn.put(key, bytes(body), db=db)
                    return
        raise AssertionError(f"no record of run {run_id!r}")
    finally:
        env.close()
