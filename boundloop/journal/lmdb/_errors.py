"""LMDB's errors as the journal's: damage, unavailability, private directories."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import lmdb
import msgspec

from boundloop.errors import (
    JournalCorrupt,
    JournalError,
    JournalUnavailable,
)

#: LMDB errors that mean the file is damaged (the others: it cannot be used right now).
_DAMAGE = (lmdb.CorruptedError, lmdb.PageNotFoundError, lmdb.BadChecksumError)


def _lmdb_error(exc: lmdb.Error) -> JournalError:
    """What an LMDB error escaping a journal operation is to the caller."""
    if isinstance(exc, (*_DAMAGE, lmdb.InvalidError, lmdb.BadValsizeError)):
        return JournalCorrupt(f"the journal is damaged: LMDB reports {type(exc).__name__}: "
                              f"{exc}; restore it from a backup (`boundloop verify` lists "
                              "damaged runs)")
    if isinstance(exc, lmdb.MapFullError):
        return JournalUnavailable("the journal is full; prune finished runs (`boundloop "
                                  "prune`) or open it with a larger map_size")
    return JournalUnavailable(f"journal error: LMDB reports {type(exc).__name__}: {exc}; "
                              "close and reopen the journal")


@contextlib.contextmanager
def _guarded(what: str = "") -> Iterator[None]:
    """Map what can escape a journal operation on damaged or unusable storage to the
    journal's own errors: LMDB errors, and index entries that do not decode."""
    try:
        yield
    except JournalError:
        raise
    except lmdb.Error as exc:
        raise _lmdb_error(exc) from None
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:
        where = f" ({what})" if what else ""
        raise JournalCorrupt(f"the journal is damaged{where}: an index entry does not decode "
                             f"({exc}); restore it from a backup (`boundloop verify` lists "
                             "damaged runs)") from None


def _make_private_dirs(path: Path) -> None:
    """Make ``path`` and each missing parent, each ``0700`` whatever the umask."""
    missing = []
    at = path
    while not at.exists():
        missing.append(at)
        if at.parent == at:
            break
        at = at.parent
    for d in reversed(missing):
        with contextlib.suppress(FileExistsError):
            d.mkdir(mode=0o700)
            os.chmod(d, 0o700)
    os.chmod(path, 0o700)


def _bad_file(data: Path, what: str) -> JournalCorrupt:
    return JournalCorrupt(f"{data} {what} (truncated, damaged, or an incomplete copy?); "
                          "restore the journal from a backup, or move the directory aside "
                          "and start a new journal")


