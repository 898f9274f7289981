"""The one exception tree of boundloop.

Errors of models and tools are data (statuses on a RunResult), never exceptions escaping
``Runner.run``. What raises is misuse (bad configuration, unknown ids) and the journal.
"""

from __future__ import annotations

__all__ = [
    "AdmissionError", "BoundloopError", "ConfigError", "JournalCorrupt", "JournalError",
    "JournalUnavailable", "LeaseLost", "RecoveryError", "RunnerClosed", "SequenceConflict",
    "UnknownRun", "ApprovalError",
]


class BoundloopError(Exception):
    """Root of every exception boundloop raises."""


class ConfigError(BoundloopError, ValueError):
    """A budget, tool, or runner option is invalid; the message says which and why."""


class JournalError(BoundloopError):
    """The event journal could not do what was asked."""


class JournalUnavailable(JournalError):
    """The journal is closed, full, or failing: nothing more can be recorded."""


class JournalCorrupt(JournalError):
    """An event in the journal could not be decoded."""


class SequenceConflict(JournalError):
    """An append expected a different last sequence number: another writer got there first."""


class LeaseLost(JournalError):
    """This runner no longer owns the run at its epoch (another runner claimed it, or this
    runner's lease ran out): the append stored nothing, and the run stops on this runner."""


class AdmissionError(BoundloopError):
    """A run could not be admitted (used where a status cannot be returned)."""


class UnknownRun(BoundloopError, KeyError):
    """No run with that id exists in the journal."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "unknown run"


class AmbiguousId(BoundloopError):
    """An id prefix given on the command line matches more than one run or action."""


class RecoveryError(BoundloopError):
    """A run cannot be recovered, resumed, or resolved as asked."""


class RunnerClosed(BoundloopError):
    """The Runner was closed; create a new one to start runs."""


class ApprovalError(RecoveryError):
    """An approve or deny was refused: the call does not wait for a decision (it was
    decided already, the run moved on, or no such call waits)."""
