"""Opening a journal for a command, and naming its runs and their calls by id or prefix."""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from pathlib import Path

from boundloop import events as ev
from boundloop.errors import (
    AmbiguousId,
    ConfigError,
    JournalUnavailable,
    UnknownRun,
)
from boundloop.journal.base import Journal


# -- opening -----------------------------------------------------------------------------
def journal_dir(value: str | os.PathLike[str] | None = None) -> str:
    """``value``, else ``$BOUNDLOOP_JOURNAL``, else ``./.boundloop`` (SPEC 10)."""
    if value is not None and str(value):
        return os.fspath(value)
    return os.environ.get("BOUNDLOOP_JOURNAL") or ".boundloop"


def open_journal(path: str | os.PathLike[str] | None = None, *,
                 create: bool = False, readonly: bool = False, walk: bool = True) -> Journal:
    """Open the LMDB journal in ``path`` (see ``journal_dir``), or the PostgreSQL journal a
    ``postgresql://`` URL names, for inspection.

    With ``readonly`` nothing is written, created or chmodded, and no write lock is taken,
    so it never waits for a writer (SPEC 6: commands that only read). ``walk``: see
    ``LmdbJournal``.

    Raises:
        JournalUnavailable: there is no journal there (and ``create`` is False), or it cannot
            be opened (locked, unreadable, not an LMDB environment).
        JournalCorrupt: what is there is not a journal (an empty data.mdb, say).
    """
    from boundloop.journal.lmdb import LmdbJournal

    value = journal_dir(path)
    if "://" in value:
        from boundloop.journal import postgres  # psycopg is imported only for a URL

        if postgres.url_scheme(value):
            # postgresql:// (SPEC 12); any other scheme is a ConfigError naming those.
            return postgres.open_url(value, readonly=readonly, create=create and not readonly)
    where = Path(value)
    if not create:
        hint = "pass the right --journal or set $BOUNDLOOP_JOURNAL"
        if not where.exists():
            raise JournalUnavailable(f"no journal at {where}; {hint}")
        if not where.is_dir():
            raise JournalUnavailable(f"{where} is not a journal directory; {hint}")
        if not (where / "data.mdb").exists():
            raise JournalUnavailable(f"{where} holds no journal (no data.mdb); {hint}")
    try:
        return LmdbJournal(where, create=create and not readonly, readonly=readonly,
                           walk=walk)
    except OSError as exc:
        raise JournalUnavailable(f"cannot open the journal at {where}: "
                                 f"{exc.strerror or exc}") from None
    except Exception as exc:
        if type(exc).__module__.split(".")[0] == "lmdb":  # lmdb.Error: locked, invalid, ...
            raise JournalUnavailable(f"cannot open the journal at {where}: {exc}") from None
        raise


_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}
_DURATION = re.compile(r"(\d+(?:\.\d+)?)([smhdw])")


def parse_duration(text: str) -> float:
    """Seconds in a duration like ``30d``, ``12h``, ``1h30m``, ``90s`` or ``2w``.

    Raises:
        ConfigError: ``text`` is not such a duration.
    """
    compact = text.strip().lower().replace(" ", "")
    pos, total = 0, 0.0
    for match in _DURATION.finditer(compact):
        if match.start() != pos:
            break
        total += float(match.group(1)) * _UNITS[match.group(2)]
        pos = match.end()
    if not compact or pos != len(compact):
        raise ConfigError(f"bad duration {text!r}: use a number and a unit (s, m, h, d, w), "
                          "e.g. 30d, 12h, 1h30m, 90s")
    return total


def read_events(journal: Journal, run_id: str) -> list[ev.Event]:
    """The run's events, oldest first (their sequence numbers are 1, 2, ...).

    Raises:
        UnknownRun: the journal holds no such run.
    """
    return list(journal.events(run_id))


#: How many candidates an ambiguous prefix names.
_CANDIDATES = 4


def _pick(given: str, ids: Iterable[str], what: str) -> str | None:
    """The one id of ``ids`` that starts with ``given`` (None: none does).

    Raises:
        AmbiguousId: several do (a few are named).
    """
    found: list[str] = []
    for candidate in ids:
        if candidate.startswith(given) and candidate not in found:
            found.append(candidate)
    if len(found) > 1:
        shown = ", ".join(sorted(found)[:_CANDIDATES])
        more = f" and {len(found) - _CANDIDATES} more" if len(found) > _CANDIDATES else ""
        raise AmbiguousId(f"{what} {given!r} is ambiguous: {len(found)} {what}s begin with "
                          f"it ({shown}{more}); give more of it")
    return found[0] if found else None


def resolve_run_id(journal: Journal, given: str) -> str:
    """The run id ``given`` names: itself when a run has that id (an exact id always wins),
    else the one run id it begins.

    Raises:
        UnknownRun: no run id is or begins with ``given``.
        AmbiguousId: ``given`` begins several run ids (and is none of them).
    """
    if given and journal.find(given) is not None:
        return given
    found = _pick(given, journal.runs(), "run id") if given else None
    if found is None:
        journal.info(given)  # raises UnknownRun, with the usual message
        raise UnknownRun(f"no run {given!r} in this journal")
    return found


def resolve_execution_id(journal: Journal, run_id: str, given: str) -> str:
    """The execution id of run ``run_id`` that ``given`` names: itself when one of the run's
    calls has that id, else the one it begins; when none does, ``given`` as it is (the
    caller says it is unknown).

    Raises:
        AmbiguousId: ``given`` begins several of the run's execution ids.
    """
    ids = list(dict.fromkeys(eid for e in journal.events(run_id)
                             if isinstance(eid := getattr(e, "execution_id", None), str)))
    if not given or given in ids:
        return given
    return _pick(given, ids, "execution id") or given
