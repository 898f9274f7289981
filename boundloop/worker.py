"""Workers: processes that serve agents by name, from the durable queue and after crashes.

A worker owns one Runner. Every ``poll_s`` (and whenever one of its runs ends) it looks at
the journal's open runs and takes, oldest first, those that nobody drives: runs waiting in
the queue (no owner), and runs whose owner is gone (SPEC 6's rules, unchanged: a claim is a
fenced append, of two claimers one wins). It resumes each run whose agent it serves, which
settles what a crash left open by the tools' own means (reconcile, a retry under the same
idempotency key, or a person) before the run goes on. Runs of agents it does not serve are
left for a worker that serves them.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from types import FrameType
from typing import Any

from boundloop.agent import Agent
from boundloop.core import kinds
from boundloop.core.replay import ReplayError
from boundloop.errors import BoundloopError, ConfigError, JournalCorrupt, RecoveryError
from boundloop.journal.base import Journal, RunInfo
from boundloop.owners import owner_alive
from boundloop.results import RunResult
from boundloop.runner import Runner

#: How often a worker reads every run's index entry for runs that wait for a person on
#: another worker's watch (their deadlines still hold).
SCAN_S = 30.0


class Worker:
    """Serves ``agents`` from a journal until SIGTERM or SIGINT (or ``stop()``).

    Args:
        journal: a journal directory, a ``postgresql://`` URL, or a Journal.
        agents: the agents this worker serves (by name; names must be unique).
        concurrency: the most runs this worker drives at once.
        grace_s: on shutdown, how long running attempts may take to end before the worker
            leaves the rest as a resume would find them.
        poll_s: how often the worker looks for work when nothing wakes it sooner.
        runner_options: passed to ``bl.Runner`` (``lease_s``, ``redaction_key``, ``sync``,
            ``telemetry``, ...).

    Raises:
        ConfigError: an argument is invalid.
    """

    def __init__(self, journal: str | os.PathLike[str] | Journal, agents: Sequence[Agent], *,
                 concurrency: int = 8, grace_s: float = 30.0, poll_s: float = 0.5,
                 **runner_options: Any) -> None:
        if isinstance(agents, Agent):
            agents = [agents]
        by_name: dict[str, Agent] = {}
        for agent in agents:
            if not isinstance(agent, Agent):
                raise ConfigError(f"a worker serves bl.Agent objects, got {agent!r}")
            if agent.name in by_name:
                raise ConfigError(f"two agents are named {agent.name!r}; a worker serves "
                                  "agents by name")
            by_name[agent.name] = agent
        if not by_name:
            raise ConfigError("give the worker at least one agent to serve")
        if isinstance(concurrency, bool) or not isinstance(concurrency, int) \
                or concurrency < 1:
            raise ConfigError(f"concurrency must be a whole number >= 1, got {concurrency!r}")
        for name, value in (("grace_s", grace_s), ("poll_s", poll_s)):
            if isinstance(value, bool) or not isinstance(value, int | float) \
                    or not 0 <= value <= 86_400:
                raise ConfigError(f"{name} must be a number of seconds from 0 to 86400, got "
                                  f"{value!r}")
        self.journal = journal
        self.agents = by_name
        self.concurrency = concurrency
        self.grace_s = float(grace_s)
        self.poll_s = max(float(poll_s), 0.01)
        self.runner_options = runner_options
        self.runner: Runner | None = None
        self._running: dict[str, Future[RunResult]] = {}
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._now = threading.Event()  # a second signal: stop at once
        self._ready = threading.Event()
        #: Runs finished by this worker, and how each ended (for reports and tests).
        self.finished: dict[str, str] = {}
        #: Runs that cannot be read (damaged): named once on stderr, then left alone.
        self.damaged: set[str] = set()
        #: When the deadlines of runs that wait for a person pass (wall clock), by run.
        self._waiting: dict[str, float] = {}
        self._expired_checked = -SCAN_S

    # -- control -------------------------------------------------------------------------
    def stop(self, now: bool = False) -> None:
        """Stop taking work and leave (as SIGTERM does); ``now``: do not wait for running
        attempts (as a second signal does). Safe from any thread and from signal handlers."""
        if now or self._stopping.is_set():
            self._now.set()
        self._stopping.set()
        self._wake.set()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.stop()

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Wait until ``serve`` has opened its runner; True once it has."""
        return self._ready.wait(timeout)

    # -- serving -------------------------------------------------------------------------
    def serve(self) -> None:
        """Serve until SIGTERM or SIGINT (installed when called from the main thread) or
        ``stop()``: take queued runs and runs whose owner is gone, resume those of the
        agents served; then shut down gracefully (see the class) and return."""
        handlers: dict[signal.Signals, Any] = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                handlers[sig] = signal.signal(sig, self._on_signal)
        try:
            self._serve()
        finally:
            for sig, old in handlers.items():
                signal.signal(sig, old)

    async def aserve(self) -> None:
        """``serve`` from asyncio code: SIGTERM and SIGINT are taken on the running loop
        (where it can), and the serving happens on a thread of its own."""
        loop = asyncio.get_running_loop()
        added: list[signal.Signals] = []
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                loop.add_signal_handler(sig, self.stop)
                added.append(sig)
            except (NotImplementedError, RuntimeError, ValueError):
                pass
        try:
            await asyncio.shield(asyncio.to_thread(self._serve))
        except asyncio.CancelledError:
            self.stop()
            await asyncio.to_thread(self._now.wait, self.grace_s + 5)
            raise
        finally:
            for sig in added:
                loop.remove_signal_handler(sig)

    def _serve(self) -> None:
        options = dict(self.runner_options)
        options.setdefault("max_in_flight", max(self.concurrency * 2, 16))
        runner = self.runner = Runner(self.journal, **options)
        self._ready.set()
        try:
            while not self._stopping.is_set():
                self._wake.clear()
                try:
                    self.tick()
                except BoundloopError as exc:
                    # The journal failed for a moment (or a run is damaged): say so, go on.
                    print(f"boundloop worker: {exc}", file=sys.stderr)
                self._wake.wait(self.poll_s)
        finally:
            self._shutdown(runner)
            self._now.set()

    def tick(self) -> int:
        """Look for work once and start what fits; returns how many runs it started."""
        runner = self.runner
        assert runner is not None, "tick() runs inside serve()"
        self._reap()
        started = 0
        free = self.concurrency - len(self._running)
        if free <= 0:
            return 0
        infos = sorted(runner.journal.open_infos(), key=lambda i: i.order)
        owners = runner.journal.owners()
        live = {o for o, rec in owners.items() if o == runner.owner or owner_alive(rec)}
        running_by_agent: dict[str, int] = {}
        if any(a.max_running is not None for a in self.agents.values()):
            for info in infos:
                if info.owner and info.owner in live:
                    name = self._agent_name(runner, info.run_id) or ""
                    running_by_agent[name] = running_by_agent.get(name, 0) + 1
        for info in infos:
            if free <= 0 or self._stopping.is_set():
                break
            if info.run_id in self._running or info.run_id in self.damaged \
                    or not self._free(info, live, runner):
                continue
            agent = self.agents.get(self._agent_name(runner, info.run_id) or "")
            if agent is None or info.parent_run_id is not None:
                continue  # another worker's agent; a child run is its parent's business
            if agent.max_running is not None and \
                    running_by_agent.get(agent.name, 0) >= agent.max_running:
                continue
            if self._start(runner, agent, info.run_id):
                started += 1
                free -= 1
                running_by_agent[agent.name] = running_by_agent.get(agent.name, 0) + 1
        if free > 0:
            started += self._expire(runner, free)
        return started

    def _agent_name(self, runner: Runner, run_id: str) -> str | None:
        """The agent of ``run_id``; None for a run that cannot be read, which is named once
        and left alone (one damaged run must not keep a worker from the others)."""
        try:
            return runner.agent_of(run_id)
        except (JournalCorrupt, ReplayError) as exc:
            self._damaged(run_id, exc)
            return None

    def _damaged(self, run_id: str, exc: BaseException) -> None:
        if run_id not in self.damaged:
            self.damaged.add(run_id)
            print(f"boundloop worker: run {run_id} cannot be read and is left alone "
                  f"(`boundloop verify` tells more): {exc}", file=sys.stderr)

    @staticmethod
    def _free(info: RunInfo, live: set[str], runner: Runner) -> bool:
        """True when nobody drives the open run: queued, or its owner is gone (a run of this
        very runner that stopped here, its lease lapsed, counts too)."""
        if info.owner == "":
            return True
        if info.owner == runner.owner:
            return not runner.in_flight(info.run_id)
        return info.owner not in live

    def _within(self, runner: Runner, agent: Agent) -> bool:
        """Whether the agent's runs still fit ``max_running`` with the one this worker just
        claimed (its claim durable). Of two workers claiming at once, the later sees the
        earlier's claim here and gives its run back; both may give back, never both keep."""
        if agent.max_running is None:
            return True
        owners = runner.journal.owners()
        count = 0
        for info in runner.journal.open_infos():
            if info.owner and (info.owner == runner.owner
                               or owner_alive(owners.get(info.owner))) \
                    and self._agent_name(runner, info.run_id) == agent.name:
                count += 1
        return count <= agent.max_running

    def _start(self, runner: Runner, agent: Agent, run_id: str) -> bool:
        try:
            future, _ = runner._submit_resume(run_id, agent, (), None, None, None,
                                              gate=lambda: self._within(runner, agent))
        except RecoveryError:
            return False  # claimed by another worker first, or its owner came back
        except ConfigError as exc:
            print(f"boundloop worker: run {run_id}: {exc}", file=sys.stderr)
            return False
        except (JournalCorrupt, ReplayError) as exc:
            self._damaged(run_id, exc)
            return False
        self._running[run_id] = future
        future.add_done_callback(lambda f: self._wake.set())
        return True

    def _expire(self, runner: Runner, free: int) -> int:
        """Runs that wait for approval past their deadline end ``limit_exceeded(deadline)``
        (the deadline holds while a run waits for a person, SPEC 14). The deadlines of runs
        whose turn ended here are known; every ``SCAN_S`` the whole journal is looked at
        for those whose turn ended on another worker (reading every run's index entry)."""
        now = time.time()
        if time.monotonic() - self._expired_checked >= SCAN_S:
            self._expired_checked = time.monotonic()
            infos = getattr(runner.journal, "infos", None)
            for info in infos() if infos is not None else []:
                if kinds.awaits_approval(info.status) \
                        and info.run_id not in self._waiting \
                        and self._agent_name(runner, info.run_id) in self.agents:
                    self._note_waiting(runner, info.run_id)
        started = 0
        for run_id, due in sorted(self._waiting.items(), key=lambda kv: kv[1]):
            if due > now or started >= free or self._stopping.is_set():
                break
            del self._waiting[run_id]
            if not kinds.awaits_approval(runner.state(run_id).status):
                continue  # decided meanwhile: queued again, or ended
            agent = self.agents.get(self._agent_name(runner, run_id) or "")
            if agent is not None and self._start(runner, agent, run_id):
                started += 1
        return started

    def _note_waiting(self, runner: Runner, run_id: str) -> None:
        """Remember when the deadline of a run that waits for a person passes."""
        state = runner.state(run_id)
        deadline_s = state.budget.deadline_s
        if kinds.awaits_approval(state.status) and deadline_s is not None \
                and state.waiting_since is not None:
            self._waiting[run_id] = state.waiting_since + max(deadline_s - state.elapsed_s,
                                                              0.0)

    def _reap(self) -> None:
        for run_id, future in list(self._running.items()):
            if future.done():
                del self._running[run_id]
                if not future.cancelled() and future.exception() is None:
                    status = self.finished[run_id] = future.result().status
                    if kinds.awaits_approval(status) and self.runner is not None:
                        self._note_waiting(self.runner, run_id)

    def _shutdown(self, runner: Runner) -> None:
        """Take no new work; let running attempts end within ``grace_s``; leave the rest as
        a resume would find them; release this worker's runs so others take them at once."""
        runner.drain()
        deadline = time.monotonic() + self.grace_s
        while any(not f.done() for f in self._running.values()) \
                and not self._now.is_set() and time.monotonic() < deadline:
            self._wake.clear()
            self._wake.wait(0.05)
        self._reap()
        runner.close(drain=True)
        self.runner = None
