"""The journal contract (DESIGN rule 5): written once, run against every backend.

Shipped as ``boundloop.testing.JournalContract`` so that a third-party backend proves the
same behaviour as LMDB and PostgreSQL. A test module subclasses it (its name starting with
``Test``, so pytest collects it) and implements ``make_store(path)``::

    from boundloop.testing import JournalContract

    class TestMyJournal(JournalContract):
        def make_store(self, path):
            return MyJournal(path)

This module needs pytest (it is imported by ``boundloop.testing`` on first use only).

The suite lives in private modules by job, combined here: ``_contract_base`` (what a
backend implements, ``make_store`` and ``files``, and the fixtures), ``_contract_appends``
(appends, reads, the expected sequence, the run index, fencing), ``_contract_concurrency``
(group commit and close), ``_contract_storage`` (owners, retention, persistence);
``_contract_events`` makes the events they append.
"""

from __future__ import annotations

from boundloop.testing._contract_appends import AppendContract
from boundloop.testing._contract_concurrency import ConcurrencyContract
from boundloop.testing._contract_events import admitted as admitted
from boundloop.testing._contract_events import finished as finished
from boundloop.testing._contract_events import run_ids as run_ids
from boundloop.testing._contract_events import several as several
from boundloop.testing._contract_events import step as step
from boundloop.testing._contract_storage import StorageContract

__all__ = ["JournalContract", "admitted", "finished", "run_ids", "several", "step"]


# The parts in reverse: pytest collects a class's tests from its most basic base up, so
# they run in the suite's order (appends, concurrency, storage).
class JournalContract(StorageContract, ConcurrencyContract, AppendContract):
    """Behaviour every Journal backend must have (the interface of
    ``boundloop.journal.base.Journal``), as pytest tests.

    Subclass it in a test module, as ``class TestMyJournal(JournalContract)``, and implement
    ``make_store``. Each test gets a fresh directory ``path`` (pytest's ``tmp_path``); the
    ``journal`` fixture is ``make_store(path)``, closed after the test. A store that keeps
    no files sets ``files = False``: the two tests of the directory's modes are skipped.
    """
