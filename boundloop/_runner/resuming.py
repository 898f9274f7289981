"""Recovering the runs of gone owners, and resuming a run where it stopped."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

from boundloop import events as ev
from boundloop._runner.starting import Starting
from boundloop.agent import Agent
from boundloop.cancel import CancelToken
from boundloop.context import Model
from boundloop.core import kinds
from boundloop.core.replay import ReplayError, RunState
from boundloop.errors import (
    ConfigError,
    JournalCorrupt,
    JournalError,
    RecoveryError,
    SequenceConflict,
)
from boundloop.journal.base import Fence
from boundloop.loop import Permit
from boundloop.owners import owner_alive
from boundloop.recovery import RecoveredRun
from boundloop.results import RunResult
from boundloop.tools import ToolLike


class Resuming(Starting):
    """``recover`` and ``resume``."""

    # -- recovery ----------------------------------------------------------------------
    def recover(self, *, damaged: list[str] | None = None) -> list[RecoveredRun]:
        """Take ownership of every open run whose owner is gone, and report what each left
        unresolved. Executes nothing; ``resume`` resolves and continues a run.

        Two runners recovering at once never both take a run: a claim is an append at the
        run's last sequence number, and only one such append can succeed.

        Args:
            damaged: where to put the ids of open runs that cannot be read (they are left
                alone, and every other run is recovered). Without it such a run raises.

        Raises:
            JournalCorrupt, ReplayError: an open run cannot be read (and ``damaged`` was not
                given); nothing was claimed.
            RunnerClosed: this process is a child forked after the runner was made.
        """
        self._here()
        owners = self._journal.owners()
        # Every candidate is read before any is claimed: a run that cannot be read raises
        # here with nothing taken over (claimed runs the caller never hears of would be
        # stranded).
        loaded: list[tuple[str, RunState, int]] = []
        for run_id in self._journal.open_runs():
            with self._lock:
                if run_id in self._tokens:
                    continue
            info = self._journal.find(run_id)
            if info is None or not (info.owner == self.owner
                                    or self._owner_gone(info.owner, owners)):
                continue
            try:
                state, seq = self._load(run_id)
            except (JournalCorrupt, ReplayError):
                if damaged is None:
                    raise
                damaged.append(run_id)
                continue
            if not state.finished and not state.queued:  # queued runs are a worker's
                loaded.append((run_id, state, seq))
        out: list[RecoveredRun] = []
        for run_id, state, seq in loaded:
            if state.owner != self.owner:
                if not self._owner_gone(state.owner, owners):
                    continue  # claimed by a live runner since the index was read
                try:
                    state = self._claim(run_id, seq, state)
                except SequenceConflict:
                    continue  # another runner claimed it first, or its owner moved on
            out.append(RecoveredRun(run_id, state, state.open_actions))
        for owner, record in owners.items():
            # Owner records of gone runners are dropped: a run whose owner has no record is
            # judged gone all the same, and the table stays as small as the live fleet.
            if owner != self.owner and not owner_alive(record):
                try:
                    self._journal.remove_owner(owner)
                except JournalError:
                    break
        return out

    def resume(self, run_id: str, model: Model | Agent, tools: Sequence[ToolLike] = (),
               *,
               cancel: CancelToken | None = None, permit: Permit | None = None) -> RunResult:
        """Resolve what a recovered (or reviewed) run left open, then continue it with the
        budgets it had left; returns its RunResult (``needs_review`` when a person must
        resolve an action first, see ``resolve``).

        Raises:
            UnknownRun: no such run.
            RecoveryError: the run finished, or a live runner owns it.
        """
        return self.submit_resume(run_id, model, tools, cancel=cancel, permit=permit).result()

    def submit_resume(self, run_id: str, model: Model | Agent,
                      tools: Sequence[ToolLike] = (), *,
                      cancel: CancelToken | None = None,
                      permit: Permit | None = None) -> Future[RunResult]:
        """``resume``, returning a Future instead of waiting."""
        return self._submit_resume(run_id, model, tools, cancel, permit, None)[0]

    def _submit_resume(self, run_id: str, model: Any, tools: Sequence[Any],
                       cancel: CancelToken | None, permit: Permit | None,
                       loop: asyncio.AbstractEventLoop | None,
                       gate: Callable[[], bool] | None = None,
                       ) -> tuple[Future[RunResult], CancelToken]:
        self._here()
        with self._lock:
            if run_id in self._tokens:
                raise RecoveryError(f"run {run_id!r} is in flight on this runner")
        state, seq = self._load(run_id)
        if state.finished and state.status not in kinds.WAITING_STATUSES:
            raise RecoveryError(f"run {run_id!r} finished ({state.status}); only open runs and "
                                "runs that need review can be resumed")
        if isinstance(model, Agent):
            if model.name != state.agent:
                raise ConfigError(f"run {run_id!r} runs agent {state.agent!r}, not "
                                  f"{model.name!r}")
            tools = tools or model.tools
            permit = permit if permit is not None else model.permit
            model = model.model
        if state.owner != self.owner:
            if not state.finished and not self._owner_gone(state.owner,
                                                           self._journal.owners()):
                raise RecoveryError(f"run {run_id!r} is owned by the live runner "
                                    f"{state.owner!r}; resume it there")
            state, seq = self._claim_for_resume(run_id, seq, state)
            seq += 1
            if gate is not None and not gate():
                # Claimed, but it must not start here (a worker over an agent's limit):
                # it goes back to nobody, fenced at the epoch just claimed.
                self._journal.append(run_id, seq, [ev.OwnerClaimed(
                    run_id=run_id, ts=self.clock.time(), elapsed_s=state.elapsed_s,
                    owner="", epoch=state.epoch + 1)], Fence(self.owner, state.epoch))
                raise RecoveryError(f"run {run_id!r} was given back: it may not start here "
                                    "now")
        spec = self._spec(model, tools, None, None, state.budget, cancel, run_id, permit,
                          resume=state, loop=loop, scrubber=self._scrubber(run_id, state),
                          labels=state.labels, agent=state.agent,
                          agent_version=state.agent_version)
        return self._start(spec, seq, resuming=True), spec.cancel
