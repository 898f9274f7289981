"""The journal contract ships with the package (``boundloop.testing.JournalContract``);
these names stay importable here for the tests that build events with its factories."""

from boundloop.testing._journal_contract import (
    JournalContract,
    admitted,
    finished,
    run_ids,
    several,
    step,
)

__all__ = ["JournalContract", "admitted", "finished", "run_ids", "several", "step"]
