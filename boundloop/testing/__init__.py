"""Deterministic test tools that ship with boundloop (DESIGN rule 9).

- ``FaultyJournal``: a journal wrapper that fails (or kills the process) at a chosen append.
- ``JournalContract``: the journal contract suite, for pytest: subclass it and implement
  ``make_store(path)`` to prove a journal backend keeps boundloop's contract (see the
  guide "Writing a journal backend" in the documentation). It needs pytest, so it is
  imported on first use.

(``ScriptedModel`` and ``FakeClock`` are exported from ``boundloop`` itself.)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from boundloop.testing._faulty import MODES, FaultyJournal

if TYPE_CHECKING:
    from boundloop.testing._journal_contract import JournalContract

__all__ = ["MODES", "FaultyJournal", "JournalContract"]


def __getattr__(name: str) -> Any:
    # The contract suite is pytest code: importing boundloop.testing must not need pytest.
    if name == "JournalContract":
        from boundloop.testing._journal_contract import JournalContract

        return JournalContract
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
