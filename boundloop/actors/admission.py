"""Admission: admits or rejects runs (duplicate ids, the in-flight cap)."""

from __future__ import annotations

from typing import Any

from boundloop.actors._base import Actor
from boundloop.actors.messages import Admit, Release
from boundloop.journal.base import Journal


class AdmissionActor(Actor):
    """Keeps the set of runs in flight; answers ``Admit`` with None or the reason to reject."""

    def __init__(self, journal: Journal, max_in_flight: int) -> None:
        super().__init__()
        self.journal = journal
        self.max_in_flight = max_in_flight
        self.in_flight: set[str] = set()

    def on_receive(self, message: Any) -> Any:
        match message:
            case Admit(run_id=run_id, resuming=resuming):
                return self._admit(run_id, resuming)
            case Release(run_id=run_id):
                self.in_flight.discard(run_id)
        return None

    def _admit(self, run_id: str, resuming: bool) -> str | None:
        if run_id in self.in_flight:
            return f"a run with id {run_id!r} is already in flight"
        if len(self.in_flight) >= self.max_in_flight:
            return (f"{len(self.in_flight)} runs are in flight, the most this runner admits "
                    f"(max_in_flight={self.max_in_flight}); retry later")
        if not resuming and self.journal.find(run_id) is not None:
            return f"a run with id {run_id!r} already exists in the journal; use a new id"
        self.in_flight.add(run_id)
        return None
