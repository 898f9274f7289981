"""The durable event log: the only code that touches storage."""

from boundloop.journal.base import Journal, OwnerRecord, RunInfo
from boundloop.journal.lmdb import LmdbJournal

__all__ = ["Journal", "LmdbJournal", "OwnerRecord", "RunInfo"]
