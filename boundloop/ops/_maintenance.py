"""Keeping a journal small: ``prune`` finished runs, ``compact`` the file."""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from pathlib import Path

import msgspec

from boundloop import owners as owners_mod
from boundloop.core import kinds
from boundloop.errors import (
    ConfigError,
    JournalUnavailable,
)
from boundloop.journal.base import Journal, RunInfo
from boundloop.ops._open import journal_dir


# -- prune -------------------------------------------------------------------------------
class PruneReport(msgspec.Struct, frozen=True, kw_only=True):
    """What ``prune`` removed (or, with ``dry_run``, would remove) and what it kept."""

    cut_ts: float
    dry_run: bool
    pruned: list[str]
    kept: dict[str, str]


def prune(journal: Journal, older_than_s: float, *, dry_run: bool = False,
          now: float | None = None,
          progress: Callable[[int, int | None], None] | None = None) -> PruneReport:
    """Remove finished runs that finished more than ``older_than_s`` seconds ago.

    Open runs are never touched (they have no finish time), nor is what recovery needs:
    runs that finished ``needs_review`` (a person may still resolve and resume them) and
    finished runs whose child runs are still open. ``kept`` names those with the reason.
    ``progress``, if given, is told ``(runs removed, runs to remove)`` as it goes.

    Raises:
        ConfigError: ``older_than_s`` is negative.
    """
    if older_than_s < 0 or math.isnan(older_than_s):
        raise ConfigError(f"older_than_s must be at least 0, got {older_than_s!r}")
    now = time.time() if now is None else now
    cut = now - older_than_s
    open_parents = {i.parent_run_id for i in (journal.find(r) for r in journal.open_runs())
                    if i is not None and i.parent_run_id}
    kept: dict[str, str] = {}

    def keep(info: RunInfo) -> bool:
        if kinds.needs_review(info.status):
            kept[info.run_id] = "needs review: a person may still resolve and resume it"
        elif kinds.awaits_approval(info.status):
            kept[info.run_id] = "awaiting approval: a person may still approve or deny"
        elif info.run_id in open_parents:
            kept[info.run_id] = "a child run of it is still open"
        return info.run_id in kept

    pruned = journal.prune(cut, dry_run=dry_run, keep=keep, progress=progress)
    return PruneReport(cut_ts=cut, dry_run=dry_run, pruned=pruned, kept=kept)




class CompactReport(msgspec.Struct, frozen=True, kw_only=True):
    """What ``compact`` did: the journal's ``data.mdb`` size before and after, in bytes."""

    journal: str
    before: int
    after: int


def compact(path: str | os.PathLike[str] | None = None, *,
            progress: Callable[[int, int | None], None] | None = None) -> CompactReport:
    """Rewrite the LMDB journal in ``path`` to reclaim the space of pruned runs (see
    ``boundloop.journal.lmdb.compact``: crash-safe, and only while nothing else uses it).
    ``progress``, if given, is told ``(records copied, records)`` as it goes.

    Raises:
        JournalUnavailable: there is no journal there, another process has it open, or a
            live runner owns it.
        JournalCorrupt: the journal is damaged.
    """
    from boundloop.journal.lmdb import compact as rewrite

    where = Path(journal_dir(path))
    if not where.is_dir():
        raise JournalUnavailable(f"no journal at {where}; pass the right --journal or set "
                                 "$BOUNDLOOP_JOURNAL")
    before, after = rewrite(where, lambda record: owners_mod.owner_alive(record),
                            progress=progress)
    return CompactReport(journal=str(where), before=before, after=after)
