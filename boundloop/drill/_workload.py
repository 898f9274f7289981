"""What the drill's workers run: the seeded plans, the model that follows them, the tools,
and the downstream ledger of real side effects they act on (fenced by epoch)."""

from __future__ import annotations

import contextlib
import fcntl
import os
import random
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

from boundloop.messages import CallTools, Final, Message, ToolCall
from boundloop.tools import Tool, ToolContext, tool

TOOLS = ("charge", "ship", "book")
ARGS: dict[str, dict[str, Any]] = {"charge": {"amount": 7}, "ship": {"item": "parcel"},
                                   "book": {"room": "r1"}, "refund": {"amount": 3}}

# -- what runs inside a worker ------------------------------------------------------------
def plan(run_id: str, seed: int) -> list[str]:
    """The tools a run calls, one per step, in a seeded order."""
    order = list(TOOLS)
    random.Random(f"{seed}:{run_id}").shuffle(order)
    return order


def drill_model(seed: int, plan_of: Callable[[str, int], list[str]] = plan,
                step_ids: bool = False) -> Callable[[list[Message], Any], Any]:
    """A model that reads its next step (of ``plan_of(run_id, seed)``) off the history, so
    a resumed run continues. With ``step_ids`` its call ids name the model step too: a
    round that a draining worker skipped is left out of the history, but its call ids stay
    reserved, so the same step asked again needs new ones (as a real model's would be)."""

    def model(history: list[Message], ctx: Any) -> Any:
        names = plan_of(ctx.run_id, seed)
        done = sum(1 for m in history if m.kind == "tool_result")
        if done >= len(names):
            return Final("all done")
        name = names[done]
        call_id = f"c{done + 1}-{ctx.step}" if step_ids else f"c{done + 1}"
        return CallTools([ToolCall(call_id, name, ARGS[name])])

    return model


class Effect(NamedTuple):
    """One real side effect, as its ledger line says."""

    key: str
    tool: str
    run_id: str = ""
    epoch: int = 0
    worker: str = ""
    started: float = 0.0  # wall-clock time the handler started


def effects(path: Path) -> list[Effect]:
    """Every real side effect so far, in ledger order."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        f = line.split()
        if len(f) >= 6:
            out.append(Effect(f[0], f[1], f[2], int(f[3]), f[4], float(f[5])))
        elif len(f) >= 2:
            out.append(Effect(f[0], f[1]))
    return out


def ledger(path: Path) -> list[tuple[str, str]]:
    """Every real side effect so far: (idempotency key, tool)."""
    return [(e.key, e.tool) for e in effects(path)]


def ledger_size(path: Path) -> int:
    """How many side effects the ledger holds (lines), cheaply."""
    try:
        with open(path, "rb") as f:
            return f.read().count(b"\n")
    except FileNotFoundError:
        return 0


def _append_line(path: Path | str, text: str) -> None:
    """One line in one write(2) on an O_APPEND file: whole, even if the process dies."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, (text + "\n").encode())
    finally:
        os.close(fd)


class StaleAttempt(Exception):
    """The downstream refused an attempt: its key was seen at a later epoch, or it was
    reconciled (and so fenced) as not done."""


class Downstream:
    """What the drill's tools act on: a ledger of real side effects that honours the
    fencing token (SPEC 6), as a careful downstream system would.

    Per idempotency key it keeps the highest epoch seen, and refuses an attempt of a lower
    epoch (a zombie's late attempt, after a takeover retried the key). Its reconcile says
    whether the key took effect and, if not, fences the key: ``reconcile`` is given the key
    alone, so this is the only way a late attempt of the old owner (frozen inside its
    handler, still running) cannot land after the new owner was told "not done". Refused
    attempts go to ``<ledger>.refused``. One lock file serialises it across processes.
    """

    def __init__(self, ledger_path: Path) -> None:
        self.ledger = ledger_path
        self.refused = ledger_path.with_name(ledger_path.name + ".refused")
        self.keys = ledger_path.with_name(ledger_path.name + ".keys")
        self.lock = ledger_path.with_name(ledger_path.name + ".lock")

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        fd = os.open(self.lock, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # and the lock with it (a killed holder releases it too)

    def _seen(self, key: str) -> str:
        try:
            return (self.keys / key).read_text()
        except FileNotFoundError:
            return ""

    def _mark(self, key: str, value: str) -> None:
        self.keys.mkdir(exist_ok=True)
        tmp = self.keys / f".{key}.{os.getpid()}"
        tmp.write_text(value)
        os.replace(tmp, self.keys / key)

    def act(self, key: str, epoch: int, line: str) -> None:
        """Perform the side effect ``line`` describes, unless its epoch is stale."""
        with self._locked():
            seen = self._seen(key)
            if seen == "fenced" or (seen and int(seen) > epoch):
                _append_line(self.refused, line)
                raise StaleAttempt(f"key {key} is at epoch {seen}; attempt of epoch {epoch} "
                                   "refused")
            if not seen or int(seen) < epoch:
                self._mark(key, str(epoch))  # first: a kill after it leaves no effect
            _append_line(self.ledger, line)

    def reconcile(self, key: str) -> bool:
        """Whether ``key`` took effect; when not, no attempt of it ever will."""
        with self._locked():
            if any(k == key for k, _ in ledger(self.ledger)):
                return True
            self._mark(key, "fenced")
            return False


def drill_tools(ledger_path: Path, worker: str = "w", approvals: bool = False) -> list[Tool]:
    """The drill's tools: each appends one ledger line per real side effect. With
    ``approvals`` also ``refund``, irreversible, which waits for a person's approval."""
    rng = random.Random()
    downstream = Downstream(ledger_path)

    def act(name: str, ctx: ToolContext) -> str:
        started = time.time()  # first thing: a zombie execution is one that started late
        time.sleep(rng.random() * 0.004)
        downstream.act(ctx.idempotency_key, ctx.epoch,
                       f"{ctx.idempotency_key} {name} {ctx.run_id} {ctx.epoch} {worker} "
                       f"{started:.6f}")
        time.sleep(rng.random() * 0.004)
        return f"{name} done"

    @tool(idempotent=True, timeout_s=10)
    def charge(amount: int, ctx: ToolContext) -> str:
        return act("charge", ctx)

    @tool(irreversible=True, timeout_s=10)
    def ship(item: str, ctx: ToolContext) -> str:
        return act("ship", ctx)

    def booked(key: str) -> str | None:
        return "book done" if downstream.reconcile(key) else None

    @tool(reconcile=booked, timeout_s=10)
    def book(room: str, ctx: ToolContext) -> str:
        return act("book", ctx)

    @tool(irreversible=True, needs_approval=True, timeout_s=10)
    def refund(amount: int, ctx: ToolContext) -> str:
        return act("refund", ctx)

    return [charge, ship, book, refund] if approvals else [charge, ship, book]
