"""The base of the journal contract's parts: what a backend implements (``make_store``,
``files``) and the fixtures every test of the suite gets (``path``, ``journal``)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from boundloop.journal.base import Journal


class ContractBase:
    """What each part of the journal contract is given; ``JournalContract`` combines the
    parts, and a backend's test class implements ``make_store``."""

    #: True when the store keeps its data in files under ``path`` (their modes are checked:
    #: SPEC 9, the directory 0700 and its files 0600).
    files: bool = True

    def make_store(self, path: Path) -> Journal:
        """Open the backend's journal stored at ``path``, creating it when absent.

        Called again with the same ``path`` (after the previous journal was closed), it must
        open the same store: its runs, owners and secret key kept. A different ``path`` is
        a different, empty store. ``path`` is a directory that may not exist yet; a backend
        that keeps nothing in files uses it as a name (a schema, a key prefix).
        """
        raise NotImplementedError(f"{type(self).__name__} must implement make_store(path)")

    # -- fixtures ------------------------------------------------------------------------
    @pytest.fixture
    def path(self, tmp_path: Path) -> Path:
        """Where this test's store lives."""
        return tmp_path / "journal"

    @pytest.fixture
    def journal(self, path: Path) -> Iterator[Journal]:
        """This test's store, closed after it."""
        j = self.make_store(path)
        try:
            yield j
        finally:
            j.close()
