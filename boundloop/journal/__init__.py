"""The durable event log: the only code that touches storage.

``base`` is the store protocol (``Journal``: what a backend implements, with defaults for
the rest) and ``_core`` what every backend shares whatever its storage (the append checks:
fence, sequence, claims, epochs; the hash chain; the format stamp; the redaction key's
binding; group-commit plumbing). The backends keep only their own transactions and
layout: ``lmdb`` (a package), ``postgres`` (a package), ``memory``. ``chain`` and ``codec``
are the record format.
"""

from boundloop.journal.base import Journal, OwnerRecord, RunInfo
from boundloop.journal.lmdb import LmdbJournal

__all__ = ["Journal", "LmdbJournal", "OwnerRecord", "RunInfo"]
