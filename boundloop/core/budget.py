"""Budgets, usage arithmetic and reservations (pure)."""

from __future__ import annotations

import math
import sys
from typing import Annotated, Any

import msgspec

from boundloop.errors import ConfigError

NonNegInt = Annotated[int, msgspec.Meta(ge=0)]
NonNegFloat = Annotated[float, msgspec.Meta(ge=0)]

#: The largest whole-number limit (a signed 64-bit integer: what every journal can store).
MAX_WHOLE = 2 ** 63 - 1
#: The longest deadline, timeout or backoff, in seconds (about 31 years): beyond this,
#: timers cannot wait (``threading.TIMEOUT_MAX`` is about 9.2e9 s).
MAX_SECONDS = 1e9


def bad_seconds(value: Any, *, zero_ok: bool) -> bool:
    """True when ``value`` is not a number of seconds from 0 (above 0 unless ``zero_ok``)
    to ``MAX_SECONDS``: a non-number, NaN, infinity, or out of range."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return True
    if isinstance(value, int):
        return value < 0 or (value == 0 and not zero_ok) or value > MAX_SECONDS
    if not math.isfinite(value):
        return True
    return value < 0 or (value == 0 and not zero_ok) or value > MAX_SECONDS


class Usage(msgspec.Struct, frozen=True):
    """Metered tokens (SPEC 7).

    ``input_tokens`` counts input neither written to nor read from a cache; all input is
    ``input_tokens + cache_write_tokens + cache_read_tokens``. ``cost`` is set when a price
    table is given or the model reports it. ``unpriced_steps`` counts the model steps a run
    priced by the catalogue (``price="auto"``) could not price: when it is above 0, ``cost``
    leaves them out (it is partial).
    """

    input_tokens: NonNegInt = 0
    output_tokens: NonNegInt = 0
    cache_write_tokens: NonNegInt = 0
    cache_read_tokens: NonNegInt = 0
    cost: NonNegFloat | None = None
    unpriced_steps: NonNegInt = 0

    @property
    def all_input_tokens(self) -> int:
        """Every input token, cached or not."""
        return self.input_tokens + self.cache_write_tokens + self.cache_read_tokens

    @property
    def total_tokens(self) -> int:
        """All input plus output."""
        return self.all_input_tokens + self.output_tokens

    def __add__(self, other: Usage) -> Usage:
        cost = None if self.cost is None and other.cost is None else (
            (self.cost or 0.0) + (other.cost or 0.0))
        return Usage(
            self.input_tokens + other.input_tokens,
            self.output_tokens + other.output_tokens,
            self.cache_write_tokens + other.cache_write_tokens,
            self.cache_read_tokens + other.cache_read_tokens,
            cost,
            self.unpriced_steps + other.unpriced_steps,
        )

    def __sub__(self, other: Usage) -> Usage:
        cost = None if self.cost is None and other.cost is None else max(
            0.0, (self.cost or 0.0) - (other.cost or 0.0))
        return Usage(
            max(0, self.input_tokens - other.input_tokens),
            max(0, self.output_tokens - other.output_tokens),
            max(0, self.cache_write_tokens - other.cache_write_tokens),
            max(0, self.cache_read_tokens - other.cache_read_tokens),
            cost,
            max(0, self.unpriced_steps - other.unpriced_steps),
        )


class Price(msgspec.Struct, frozen=True):
    """A price table: currency units per million tokens of each kind."""

    input_per_mtok: float = 0.0
    output_per_mtok: float = 0.0
    cache_write_per_mtok: float | None = None
    cache_read_per_mtok: float | None = None

    def cost(self, usage: Usage) -> float:
        """What ``usage`` costs under this table (cache prices default to the input price)."""
        cw = self.cache_write_per_mtok
        cw = self.input_per_mtok if cw is None else cw
        cr = self.input_per_mtok if self.cache_read_per_mtok is None else self.cache_read_per_mtok
        per_mtok = (usage.input_tokens * self.input_per_mtok
                    + usage.output_tokens * self.output_per_mtok
                    + usage.cache_write_tokens * cw + usage.cache_read_tokens * cr)
        return per_mtok / 1_000_000


class Quote(msgspec.Struct, frozen=True):
    """What the price catalogue said of one step's usage (``price="auto"``): its ``cost``,
    or None with ``why`` it could not be priced. The lookup is an effect, made outside
    policy; the decider only reads its answer."""

    cost: float | None = None
    why: str = ""


def priced(usage: Usage, price: Price | None) -> Usage:
    """``usage`` with its cost filled in from ``price`` when the model did not report one."""
    if price is None or usage.cost is not None:
        return usage
    return msgspec.structs.replace(usage, cost=price.cost(usage))


#: The token and cost limits, in the order they are checked and reported.
TOKEN_LIMITS = ("input_tokens", "output_tokens", "total_tokens", "cost")

_MINIMUMS: dict[str, float] = {
    "max_model_steps": 1, "max_tool_calls": 0, "max_parallel": 1, "deadline_s": 0,
    "max_input_tokens": 0, "max_output_tokens": 0, "max_total_tokens": 0, "max_cost": 0,
    "max_result_bytes": 0, "malformed_retries": 0,
}
_INTEGERS = {"max_model_steps", "max_tool_calls", "max_parallel", "max_input_tokens",
             "max_output_tokens", "max_total_tokens", "max_result_bytes", "malformed_retries"}
_REQUIRED = {"max_model_steps", "max_tool_calls"}


def _limit_problem(name: str, value: Any, minimum: float) -> str | None:
    """What a valid value of the limit ``name`` is, when ``value`` is not one."""
    unbounded = "" if name in _REQUIRED else " (or None for no limit)"
    if name in _INTEGERS:
        if isinstance(value, int) and not isinstance(value, bool):
            if minimum <= value <= MAX_WHOLE:
                return None
            return f"at least {minimum:.0f} and at most {MAX_WHOLE} (2**63 - 1){unbounded}"
        kind = "a whole number" if isinstance(value, float) else "a number"
        return f"{kind} from {minimum:.0f} to {MAX_WHOLE} (2**63 - 1){unbounded}"
    if isinstance(value, bool) or not isinstance(value, int | float):
        return f"a number{unbounded}"
    if name == "deadline_s":
        return None if not bad_seconds(value, zero_ok=False) else \
            f"above 0 and at most {MAX_SECONDS:.0e} seconds (or None for no deadline)"
    if not math.isfinite(value) or value < minimum:
        return f"at least {minimum:.0f} and finite{unbounded}"
    return None


class Budget(msgspec.Struct, frozen=True, kw_only=True):
    """The hard limits of one run (SPEC 5). None means unbounded.

    Whole-number limits go from their minimum to ``MAX_WHOLE`` (2**63 - 1); ``deadline_s``
    is above 0 and at most ``MAX_SECONDS``; ``max_cost`` is a finite number >= 0 (use None,
    not infinity, for no limit).

    Raises:
        ConfigError: a limit is not a number, is NaN or infinite, is out of its range, or
            (for ``max_model_steps`` and ``max_tool_calls``) is None; the message gives the
            allowed range.
    """

    max_model_steps: int = 6
    max_tool_calls: int = 20
    max_parallel: int | None = None
    deadline_s: float | None = None
    max_input_tokens: int | None = None
    max_output_tokens: int | None = None
    max_total_tokens: int | None = None
    max_cost: float | None = None
    max_result_bytes: int | None = None
    reserve_final_step: bool = True
    malformed_retries: int | None = 0

    def __post_init__(self) -> None:
        for name, minimum in _MINIMUMS.items():
            value = getattr(self, name)
            if value is None:
                if name in _REQUIRED:
                    raise ConfigError(f"Budget.{name} must be a number, not None: it is always "
                                      "finite")
                continue
            problem = _limit_problem(name, value, minimum)
            if problem is not None:
                raise ConfigError(f"Budget.{name} must be {problem}, got {value!r}")
        if not isinstance(self.reserve_final_step, bool):
            raise ConfigError("Budget.reserve_final_step must be True or False")

    def limit(self, name: str) -> float | None:
        """The value of the limit reported as ``name`` (e.g. ``"tool_calls"``)."""
        return {
            "model_steps": self.max_model_steps, "tool_calls": self.max_tool_calls,
            "deadline": self.deadline_s, "input_tokens": self.max_input_tokens,
            "output_tokens": self.max_output_tokens, "total_tokens": self.max_total_tokens,
            "cost": self.max_cost,
        }[name]


class Remaining(msgspec.Struct, frozen=True):
    """What is left of each budget; None where the budget is unbounded."""

    model_steps: int
    tool_calls: int
    deadline_s: float | None = None
    input_tokens: int | None = None
    output_tokens: int | None = None
    total_tokens: int | None = None
    cost: float | None = None


def smaller(a: Any, b: Any) -> Any:
    """The smaller of two limits where None means unbounded."""
    if a is None:
        return b
    if b is None:
        return a
    return min(a, b)


def remaining(budget: Budget, model_steps: int, tool_calls: int, usage: Usage,
              elapsed_s: float) -> Remaining:
    """What is left of ``budget`` after the given counters, usage and elapsed time."""
    b = budget  # _left inline, and each figure read only when its limit is set: per step
    return Remaining(
        model_steps=max(b.max_model_steps - model_steps, 0),
        tool_calls=max(b.max_tool_calls - tool_calls, 0),
        deadline_s=None if b.deadline_s is None else max(b.deadline_s - elapsed_s, 0),
        input_tokens=None if b.max_input_tokens is None else
        max(b.max_input_tokens - usage.all_input_tokens, 0),
        output_tokens=None if b.max_output_tokens is None else
        max(b.max_output_tokens - usage.output_tokens, 0),
        total_tokens=None if b.max_total_tokens is None else
        max(b.max_total_tokens - usage.total_tokens, 0),
        cost=None if b.max_cost is None else max(b.max_cost - (usage.cost or 0.0), 0),
    )


def exceeded(budget: Budget, usage: Usage) -> str | None:
    """The first token or cost limit that ``usage`` is above, else None."""
    # In TOKEN_LIMITS' order, reading each figure only when its limit is set (this runs
    # for every step and every charge; most budgets set none of these).
    if budget.max_input_tokens is not None and usage.all_input_tokens > budget.max_input_tokens:
        return "input_tokens"
    if budget.max_output_tokens is not None and usage.output_tokens > budget.max_output_tokens:
        return "output_tokens"
    if budget.max_total_tokens is not None and usage.total_tokens > budget.max_total_tokens:
        return "total_tokens"
    if budget.max_cost is not None and (usage.cost or 0.0) > budget.max_cost:
        return "cost"
    return None


def default_reservation(history_json_bytes: int, declared_output_max: int | None) -> Usage:
    """SPEC 5.1: ceil(history JSON bytes / 4) input tokens plus the declared output maximum."""
    return Usage(input_tokens=math.ceil(history_json_bytes / 4),
                 output_tokens=declared_output_max or 0)


def carve(parent: Remaining, asked: Budget) -> Budget:
    """A child's budget: for every shared limit, the smaller of what it asks and what is left."""

    return msgspec.structs.replace(
        asked,
        max_tool_calls=smaller(asked.max_tool_calls, parent.tool_calls),
        # A spent parent deadline must not read as None (unbounded): keep it just above 0.
        deadline_s=None if (d := smaller(asked.deadline_s, parent.deadline_s)) is None
        else max(d, 1e-6),
        max_input_tokens=smaller(asked.max_input_tokens, parent.input_tokens),
        max_output_tokens=smaller(asked.max_output_tokens, parent.output_tokens),
        max_total_tokens=smaller(asked.max_total_tokens, parent.total_tokens),
        max_cost=smaller(asked.max_cost, parent.cost),
    )


class TreeLeft(msgspec.Struct, frozen=True):
    """What the run's ancestors have left (None where unbounded all the way up)."""

    tool_calls: int | None = None
    input_tokens: int | None = None
    output_tokens: int | None = None
    total_tokens: int | None = None
    cost: float | None = None


class ChildSpend(msgspec.Struct, frozen=True):
    """What one descendant spent since its ancestor last asked."""

    child_run_id: str
    tool_calls: int
    usage: Usage
    #: The calls among ``tool_calls`` by tool name (for per-tool caps).
    tools: dict[str, int] = msgspec.field(default_factory=dict)


class LedgerReply(msgspec.Struct, frozen=True):
    """The authority's answer: whether a reservation was granted, what descendants spent,
    and what the ancestors have left."""

    granted: bool
    children: list[ChildSpend]
    left: TreeLeft
    #: For each tool of the reservation that an ancestor caps (``bl.tool(max_calls=N)``):
    #: how many of the batch's calls of it may run (the others are denied) ...
    tools_granted: dict[str, int] = msgspec.field(default_factory=dict)
    #: ... and the cap that binds (the ancestor's N), for the denial's reason.
    tool_caps: dict[str, int] = msgspec.field(default_factory=dict)


def add_counts(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
    """Per-tool call counts ``a`` plus ``b`` (a new dict)."""
    out = dict(a)
    for name, n in b.items():
        out[name] = out.get(name, 0) + n
    return out


def sub_counts(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
    """Per-tool call counts ``a`` less ``b``, without the tools left at 0 or below."""
    out = {name: n - b.get(name, 0) for name, n in a.items()}
    return {name: n for name, n in out.items() if n > 0}


def within_tree(budget: Budget, tool_calls: int, usage: Usage, left: TreeLeft) -> Budget:
    """``budget`` narrowed so the run cannot spend more than its ancestors have left, given
    what it has used (SPEC 8: a child never gets a fresh allowance)."""

    def cap(own: Any, used: float, room: Any) -> Any:
        if room is None:
            return own
        # Clamped: the narrowed budget must stay a valid Budget (whole limits <= MAX_WHOLE,
        # the cost finite).
        most = min(used + room, MAX_WHOLE if isinstance(room, int) and isinstance(used, int)
                   else sys.float_info.max)
        return most if own is None else min(own, most)

    return msgspec.structs.replace(
        budget,
        max_tool_calls=cap(budget.max_tool_calls, tool_calls, left.tool_calls),
        max_input_tokens=cap(budget.max_input_tokens, usage.all_input_tokens, left.input_tokens),
        max_output_tokens=cap(budget.max_output_tokens, usage.output_tokens, left.output_tokens),
        max_total_tokens=cap(budget.max_total_tokens, usage.total_tokens, left.total_tokens),
        max_cost=cap(budget.max_cost, usage.cost or 0.0, left.cost),
    )
