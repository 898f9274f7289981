"""The budget authority: one ledger for a whole run tree.

A nested run draws on what every ancestor has left. Tool calls are reserved here
atomically, so parallel children of one run can never together exceed what it has left;
usage is charged to every ancestor as it is spent, and each ancestor folds what its
descendants spent into its own journal (``ChildCharged``) at its next decision.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec

from boundloop.actors._base import Actor
from boundloop.core.budget import (
    Budget,
    ChildSpend,
    LedgerReply,
    TreeLeft,
    Usage,
    add_counts,
    remaining,
    smaller,
)
from boundloop.core.effects import ChargeTree
from boundloop.loop import Ledger


class Open(msgspec.Struct):
    """Track ``run_id`` (under ``parent``), having already spent what is given."""

    run_id: str
    parent: str | None
    budget: Budget
    tool_calls: int = 0
    usage: Usage = msgspec.field(default_factory=Usage)
    #: The run's per-tool caps (tool name -> max_calls) and its calls so far by tool.
    caps: dict[str, int] = msgspec.field(default_factory=dict)
    tool_counts: dict[str, int] = msgspec.field(default_factory=dict)


class Settle(msgspec.Struct):
    """Perform a run's Ledger effect and call ``reply`` with the LedgerReply."""

    ledger: Ledger
    reply: Callable[[LedgerReply], None]


class Left(msgspec.Struct):
    """Reply (to an ask) with what ``run_id`` and its ancestors have left."""

    run_id: str


class Close(msgspec.Struct):
    """Forget a finished run (its ancestors keep what it spent)."""

    run_id: str


class _Node(msgspec.Struct):
    parent: str | None
    budget: Budget
    tool_calls: int = 0
    usage: Usage = msgspec.field(default_factory=Usage)
    unfolded: dict[str, ChildSpend] = msgspec.field(default_factory=dict)
    caps: dict[str, int] = msgspec.field(default_factory=dict)
    tool_counts: dict[str, int] = msgspec.field(default_factory=dict)


class BudgetActor(Actor):
    """Holds the ledger of every run tree of one runner."""

    def __init__(self) -> None:
        super().__init__()
        self.nodes: dict[str, _Node] = {}

    def on_receive(self, message: Any) -> Any:
        match message:
            case Open():
                if message.run_id not in self.nodes:
                    self.nodes[message.run_id] = _Node(
                        message.parent, message.budget, message.tool_calls, message.usage,
                        caps=dict(message.caps), tool_counts=dict(message.tool_counts))
            case Settle(ledger=ledger, reply=reply):
                answer = self._settle(ledger.run_id, ledger.charge)
                if ledger.charge.close:
                    self.nodes.pop(ledger.run_id, None)
                reply(answer)
            case Left(run_id=run_id):
                return self._left(run_id, include_self=True)
            case Close(run_id=run_id):
                self.nodes.pop(run_id, None)
        return None

    def _chain(self, run_id: str) -> list[tuple[str, _Node]]:
        out = []
        current: str | None = run_id
        while current is not None and current in self.nodes:
            out.append((current, self.nodes[current]))
            current = self.nodes[current].parent
        return out

    def _charge(self, run_id: str, calls: int, usage: Usage,
                tools: dict[str, int] | None = None) -> None:
        tools = tools or {}
        for name, node in self._chain(run_id):
            node.tool_calls += calls
            node.usage = node.usage + usage
            if tools:
                node.tool_counts = add_counts(node.tool_counts, tools)
            if name != run_id:
                had = node.unfolded.get(run_id)
                node.unfolded[run_id] = ChildSpend(
                    run_id, calls + (had.tool_calls if had else 0),
                    usage + had.usage if had else usage,
                    add_counts(had.tools, tools) if had else dict(tools))

    def _tool_room(self, run_id: str, tools: dict[str, int]) -> dict[str, tuple[int, int]]:
        """For each of ``tools`` that an ancestor of ``run_id`` caps: the calls of it every
        such ancestor has left, and the cap of the one with the fewest left."""
        room: dict[str, tuple[int, int]] = {}
        for name, node in self._chain(run_id):
            if name == run_id:
                continue
            for tool in tools:
                cap = node.caps.get(tool)
                if cap is None:
                    continue
                left = max(cap - node.tool_counts.get(tool, 0), 0)
                if tool not in room or left < room[tool][0]:
                    room[tool] = (left, cap)
        return room

    def _left(self, run_id: str, include_self: bool) -> TreeLeft:
        left = TreeLeft()
        for name, node in self._chain(run_id):
            if name == run_id and not include_self:
                continue
            r = remaining(node.budget, 0, node.tool_calls, node.usage, 0.0)
            left = TreeLeft(smaller(left.tool_calls, r.tool_calls),
                            smaller(left.input_tokens, r.input_tokens),
                            smaller(left.output_tokens, r.output_tokens),
                            smaller(left.total_tokens, r.total_tokens),
                            smaller(left.cost, r.cost))
        return left

    def _settle(self, run_id: str, m: ChargeTree) -> LedgerReply:
        if m.tool_calls or m.usage is not None or m.tools:
            self._charge(run_id, m.tool_calls, m.usage or Usage(), m.tools)
        granted = True
        tools_granted: dict[str, int] = {}
        tool_caps: dict[str, int] = {}
        if m.reserve:
            room = self._left(run_id, include_self=False).tool_calls
            granted = room is None or room >= m.reserve
            if granted:
                # Per-tool caps: atomically with the tool calls, so parallel children of
                # one run can never together exceed an ancestor's cap. Every call of the
                # batch counts (a call the cap denies too, as tool_calls counts it).
                for tool, (left, cap) in self._tool_room(run_id, m.reserve_tools).items():
                    tools_granted[tool] = min(m.reserve_tools[tool], left)
                    tool_caps[tool] = cap
                self._charge(run_id, m.reserve, Usage(), m.reserve_tools)
        node = self.nodes.get(run_id)
        children = list(node.unfolded.values()) if node is not None else []
        if node is not None:
            node.unfolded = {}
        return LedgerReply(granted, children, self._left(run_id, include_self=False),
                           tools_granted, tool_caps)
