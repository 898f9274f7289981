"""Admission: admits or rejects runs (duplicate ids, the in-flight cap)."""

from __future__ import annotations

import threading
from typing import Any

from boundloop.actors._base import Actor
from boundloop.actors.messages import Admit
from boundloop.journal.base import Journal


class InFlight:
    """The ids of the runs a runner admitted and has not let go of yet.

    Only the admission actor adds (it decides, one run at a time); a run's end takes its id
    out from whichever thread ends it, without a message to admission (a hand-off per run
    less: issue #21). Thread-safe.
    """

    def __init__(self) -> None:
        self._ids: set[str] = set()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._ids)

    def __contains__(self, run_id: object) -> bool:
        return run_id in self._ids

    def add(self, run_id: str) -> None:
        """``run_id`` is in flight from now on."""
        with self._lock:
            self._ids.add(run_id)

    def discard(self, run_id: str) -> None:
        """``run_id`` is no longer in flight (its slot is free at once)."""
        with self._lock:
            self._ids.discard(run_id)


def _answered(reason: str | None, error: BaseException | None) -> None:
    """What an ``Admit`` replies once it has been answered: nothing more."""


class AdmissionActor(Actor):
    """Decides each ``Admit`` and answers it through the message's ``reply``: None (the run
    counts as in flight until ``InFlight.discard``), or the reason to reject it, or the
    error that kept admission from deciding. Admission is a tell, not an ask: the asker
    does not wait (it waits on the run's Future anyway), and an admitted run is handed on
    from here (one hand-off per run less: issue #21)."""

    def __init__(self, journal: Journal, max_in_flight: int, in_flight: InFlight) -> None:
        super().__init__()
        self.journal = journal
        self.max_in_flight = max_in_flight
        self.in_flight = in_flight

    def on_receive(self, message: Any) -> Any:
        match message:
            case Admit(run_id=run_id, resuming=resuming, reply=reply):
                # pykka holds the last message handled until the next one comes: without
                # its reply, it holds no run (and its result) alive meanwhile.
                message.reply = _answered
                try:
                    reason = self._admit(run_id, resuming)
                except Exception as exc:  # noqa: BLE001 - the failure rule: the asker gets it
                    reply(None, exc)
                else:
                    reply(reason, None)
        return None

    def _admit(self, run_id: str, resuming: bool) -> str | None:
        in_flight = self.in_flight
        if run_id in in_flight:
            return f"a run with id {run_id!r} is already in flight"
        if len(in_flight) >= self.max_in_flight:
            return (f"{len(in_flight)} runs are in flight, the most this runner admits "
                    f"(max_in_flight={self.max_in_flight}); retry later")
        if not resuming and self.journal.find(run_id) is not None:
            return f"a run with id {run_id!r} already exists in the journal; use a new id"
        in_flight.add(run_id)
        return None
