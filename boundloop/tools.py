"""Tools: ``@tool``, ``Tool``, ``ToolContext``, schema derivation and argument validation."""

from __future__ import annotations

import copy
import dataclasses
import importlib
import inspect
import itertools
import threading
import typing
from collections.abc import Callable, Collection, Mapping
from typing import Any

import msgspec

from boundloop._tool_schema import (
    _cut,
    _json_type,
    _plain_schema,
    _schema_problem,
    _schema_validator,
)
from boundloop.core.budget import MAX_SECONDS, MAX_WHOLE, bad_seconds
from boundloop.errors import BoundloopError, ConfigError
from boundloop.policy.redact import ARGUMENTS_NOT_KEPT, arguments_not_kept, shape_problem
from boundloop.policy.safe_text import describe_exception

__all__ = ["ApprovalRule", "ArgumentError", "RetryPolicy", "Tool", "ToolContext", "ToolLike",
           "tool"]

#: ``needs_approval`` as a callable: ``(call, ctx) -> bool`` (a ``bl.ToolCall`` and the
#: step's ``bl.ModelContext``), True when this call must wait for a person.
ApprovalRule = Callable[[Any, Any], Any]

if typing.TYPE_CHECKING:
    from boundloop.cancel import CancelToken
    from boundloop.results import RunResult


@dataclasses.dataclass(frozen=True)
class RetryPolicy:
    """How a failed attempt is retried, under the same idempotency key.

    Args:
        max_attempts: attempts in all, the first included (at least 1).
        backoff_s: delay before the second attempt, doubled for each later one; a delay
            that would end past the run's deadline is not taken (no retry then).
        retry_on: exception types that are retried. A timeout counts as ``TimeoutError`` and
            is retried only when the tool is idempotent or its ``reconcile`` says the
            attempt did not take effect.
    """

    max_attempts: int = 3
    backoff_s: float = 0.0
    retry_on: tuple[type[BaseException], ...] = (Exception,)

    def __post_init__(self) -> None:
        if isinstance(self.max_attempts, bool) or not isinstance(self.max_attempts, int) \
                or not 1 <= self.max_attempts <= MAX_WHOLE:
            raise ConfigError(f"RetryPolicy.max_attempts must be a whole number from 1 to "
                              f"{MAX_WHOLE} (2**63 - 1), got {self.max_attempts!r}")
        if bad_seconds(self.backoff_s, zero_ok=True):
            raise ConfigError(f"RetryPolicy.backoff_s must be a number of seconds from 0 to "
                              f"{MAX_SECONDS:.0e}, got {self.backoff_s!r}")
        retry_on: Any = self.retry_on
        try:
            kinds = (retry_on,) if isinstance(retry_on, type) else tuple(retry_on)
        except TypeError:
            kinds = (retry_on,)
        if not all(isinstance(t, type) and issubclass(t, BaseException) for t in kinds):
            raise ConfigError(f"RetryPolicy.retry_on must be exception types, got {retry_on!r}")
        object.__setattr__(self, "retry_on", kinds)

    def delay(self, attempt: int) -> float:
        """The delay before ``attempt`` (2 or more), at most ``MAX_SECONDS``."""
        if not self.backoff_s:
            return 0.0
        # 2.0 ** 64 keeps the float finite; the cap keeps every timer's timeout valid.
        return min(float(self.backoff_s) * 2.0 ** min(max(attempt - 2, 0), 64), MAX_SECONDS)


@dataclasses.dataclass(frozen=True)
class ToolContext:
    """What a handler learns about the call it serves (declare a parameter of this type).

    ``epoch`` is the run's ownership epoch, a fencing token: a downstream system that keeps
    the highest epoch it saw per ``idempotency_key`` can refuse a late attempt from a runner
    that lost the run (SPEC 6).
    """

    run_id: str
    call_id: str
    execution_id: str
    idempotency_key: str
    attempt: int
    deadline: float | None
    cancel: CancelToken
    epoch: int = 0
    _run_child: Callable[..., RunResult] | None = dataclasses.field(default=None, repr=False)

    def run_child(self, *args: Any, **kwargs: Any) -> RunResult:
        """Run a nested run that draws on this run's budgets (SPEC 8) and wait for it; same
        arguments as ``Runner.run``. Its shared limits are the smaller of what it asks and
        what is left here. From an ``async def`` handler use ``await ctx.arun_child(...)``.

        Raises:
            ConfigError: called on an event loop (it would block the loop the child needs).
        """
        if self._run_child is None:
            raise ConfigError("this call's context cannot start child runs")
        import asyncio  # here: `boundloop runs` and the like need no event loop

        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return self._run_child(*args, **kwargs)
        raise ConfigError("run_child waits for the child run and would block this event "
                          "loop; in an async handler use `await ctx.arun_child(...)`")

    async def arun_child(self, *args: Any, **kwargs: Any) -> RunResult:
        """``run_child`` for ``async def`` handlers: awaits the child without blocking."""
        if self._run_child is None:
            raise ConfigError("this call's context cannot start child runs")
        import asyncio

        loop = asyncio.get_running_loop()
        done: asyncio.Future[RunResult] = loop.create_future()
        run_child = self._run_child

        def wait_for_child() -> None:
            try:
                result = run_child(*args, **kwargs)
            except BaseException as exc:  # noqa: BLE001 - delivered to the awaiting handler
                loop.call_soon_threadsafe(done.set_exception, exc)
            else:
                loop.call_soon_threadsafe(done.set_result, result)

        # A daemon thread of its own: waiting for a child must not hold a pooled thread.
        threading.Thread(target=wait_for_child, name="boundloop-child", daemon=True).start()
        return await done


class ArgumentError(BoundloopError, ValueError):
    """Arguments that do not match a tool's schema (becomes ``invalid_arguments``)."""


def _context_param(hint: Any) -> bool:
    return hint is ToolContext or (isinstance(hint, str) and hint.endswith("ToolContext"))


class Tool:
    """A tool the model may call: a handler, its argument schema, and how it may be run.

    The schema is derived from the handler's type hints and checked with msgspec; for a
    tool described by a plain JSON Schema (an MCP server's, say) use ``Tool.from_schema``.

    Args:
        name: the name the model uses (default: the function's name).
        handler: the function; sync or ``async def``. A parameter annotated ``ToolContext``
            receives the call's context and is not part of the schema.
        description: for the model (default: the docstring).
        read_only: it changes nothing (a ``read_only`` Runner allows only these).
        idempotent: running it twice with one idempotency key has the effect of once, so
            recovery may retry it.
        irreversible: its effect cannot be undone; an unknown outcome needs a person.
        timeout_s: longest an attempt may run (also bounded by the run's deadline).
        retry: a RetryPolicy, or None for a single attempt.
        reconcile: ``(idempotency_key) -> result | None``: the action's result if it took
            effect, None if it did not; raising means it cannot tell.
        sensitive: argument or result field names to keep out of the journal in clear.
        needs_approval: True (or a callable ``(call, ctx) -> bool`` deciding per call) to
            make an accepted call wait for a person's ``approve`` or ``deny`` before it is
            dispatched; the run pauses durably as ``awaiting_approval`` meanwhile.
        max_calls: the most calls of this tool a run may accept, its nested runs' included
            (None: no cap). Counted as ``max_tool_calls`` counts calls (every accepted
            call, denied ones too), except that a retry of a call is that same call: once
            the cap is reached, further calls of the tool are ``denied`` with a reason
            naming the cap, and the run goes on.
    """

    def __init__(self, name: str | None, handler: Callable[..., Any], *,
                 description: str | None = None, read_only: bool = False,
                 idempotent: bool = False, irreversible: bool = False,
                 timeout_s: float | None = 60.0, retry: RetryPolicy | None = None,
                 reconcile: Callable[[str], Any] | None = None,
                 sensitive: Collection[str] = (),
                 needs_approval: bool | ApprovalRule = False,
                 max_calls: int | None = None) -> None:
        self._configure(name, handler, description, read_only=read_only,
                        idempotent=idempotent, irreversible=irreversible, timeout_s=timeout_s,
                        retry=retry, reconcile=reconcile, sensitive=sensitive,
                        needs_approval=needs_approval, max_calls=max_calls)
        args_type, self._context_name = self._derive()
        self._args_type: type[msgspec.Struct] | None = args_type
        self.schema = self._schema(args_type)

    def _configure(self, name: str | None, handler: Callable[..., Any],
                   description: str | None, *, read_only: bool, idempotent: bool,
                   irreversible: bool, timeout_s: float | None, retry: RetryPolicy | None,
                   reconcile: Callable[[str], Any] | None, sensitive: Collection[str],
                   needs_approval: bool | ApprovalRule = False,
                   max_calls: int | None = None) -> None:
        """The options every tool has, checked (the schema is the caller's business)."""
        if not callable(handler):
            raise ConfigError(f"a tool handler must be callable, got {handler!r}")
        self.handler = handler
        self.name: str = name or str(getattr(handler, "__name__", ""))
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError("a tool needs a non-empty name")
        self.description = description if description is not None else \
            inspect.cleandoc(handler.__doc__ or "")
        if read_only and irreversible:
            raise ConfigError(f"tool {self.name!r} cannot be both read_only and irreversible")
        if timeout_s is not None and bad_seconds(timeout_s, zero_ok=False):
            raise ConfigError(f"tool {self.name!r}: timeout_s must be a number of seconds above "
                              f"0 and at most {MAX_SECONDS:.0e}, or None for no timeout; got "
                              f"{timeout_s!r}")
        if retry is not None and not isinstance(retry, RetryPolicy):
            raise ConfigError(f"tool {self.name!r}: retry must be a bl.RetryPolicy")
        if reconcile is not None and not callable(reconcile):
            raise ConfigError(f"tool {self.name!r}: reconcile must be callable")
        self.read_only = read_only
        self.idempotent = idempotent
        self.irreversible = irreversible
        self.timeout_s = None if timeout_s is None else float(timeout_s)
        self.retry = retry
        self.reconcile = reconcile
        self.sensitive = frozenset(sensitive)
        if not isinstance(needs_approval, bool) and not callable(needs_approval):
            raise ConfigError(f"tool {self.name!r}: needs_approval must be True, False or a "
                              f"callable (call, ctx) -> bool, got {needs_approval!r}")
        self.needs_approval = needs_approval
        if max_calls is not None and (isinstance(max_calls, bool) or not isinstance(
                max_calls, int) or not 0 <= max_calls <= MAX_WHOLE):
            raise ConfigError(f"tool {self.name!r}: max_calls must be a whole number from 0 to "
                              f"{MAX_WHOLE} (2**63 - 1), or None for no cap; got {max_calls!r}")
        self.max_calls: int | None = max_calls
        # Set by Tool.from_schema: its cached jsonschema validator, the parameter that gets
        # the arguments as one dict, and the keywords the handler takes (None: any).
        self._validator: Any = None
        self._dict_param: str | None = None
        self._accepts: frozenset[str] | None = None

    @classmethod
    def from_schema(cls, name: str, schema: Mapping[str, Any], handler: Callable[..., Any], *,
                    description: str | None = "", read_only: bool = False,
                    idempotent: bool = False, irreversible: bool = False,
                    timeout_s: float | None = 60.0, retry: RetryPolicy | None = None,
                    reconcile: Callable[[str], Any] | None = None,
                    sensitive: Collection[str] = (),
                    needs_approval: bool | ApprovalRule = False,
                    max_calls: int | None = None) -> Tool:
        """A tool whose arguments a plain JSON Schema describes (as MCP servers and OpenAPI
        documents give them) instead of the handler's type hints. Needs the ``jsonschema``
        package (``pip install 'boundloop[schema]'``; ``boundloop[mcp]`` includes it).

        The schema's root must be an object schema (``{"type": "object", ...}``). It is
        checked once, here, and its validator built once and kept: Draft 2020-12, unless
        the schema names another draft in ``$schema`` (draft-07, say). ``format`` is an
        annotation, not checked, as that draft says; a ``$ref`` is resolved within the
        schema only (nothing is fetched: an outside reference makes the call's arguments
        invalid). Arguments that do not match become the call's ``invalid_arguments``, with
        a message naming the path (``Expected `integer`, got `string` - at `$.limit```).

        The handler (sync or ``async def``) gets the validated arguments:

        * as **one dict** when, apart from a ``ToolContext`` parameter, it has exactly one
          parameter and the schema has no property of that name (``def create(args)``).
          Properties the model left out are absent: the schema's ``default``s are not
          filled in;
        * else as **keyword arguments**: every property must name a parameter (or the
          handler takes ``**kwargs``), and a parameter without a default must be in the
          schema's ``required``. A field the handler does not take is invalid.

        A parameter annotated ``ToolContext`` gets the call's context either way. The other
        options are those of :class:`Tool`; ``description`` is the model's (None: the
        handler's docstring). ``tool.schema`` is ``{"name", "description", "parameters"}``,
        ``parameters`` being a copy of ``schema``.

        Raises:
            ConfigError: the schema is not JSON data, its root is not an object schema, it
                is not a valid JSON Schema, the handler cannot take its arguments as said
                above, ``jsonschema`` is not installed, or an option is invalid.
        """
        self = cls.__new__(cls)
        self._configure(name, handler, description, read_only=read_only,
                        idempotent=idempotent, irreversible=irreversible, timeout_s=timeout_s,
                        retry=retry, reconcile=reconcile, sensitive=sensitive,
                        needs_approval=needs_approval, max_calls=max_calls)
        plain = _plain_schema(self.name, schema)
        self._validator = _schema_validator(self.name, plain)
        self._args_type = None
        self._context_name, self._dict_param, self._accepts = _schema_binding(
            self.name, handler, plain)
        # The validator keeps its own copy: changing tool.schema cannot change what it checks.
        self.schema = {"name": self.name, "description": self.description,
                       "parameters": copy.deepcopy(plain)}
        return self

    def _derive(self) -> tuple[type[msgspec.Struct], str | None]:
        try:
            sig = inspect.signature(self.handler)
            hints = typing.get_type_hints(self.handler, include_extras=True)
        except (TypeError, ValueError, NameError) as exc:
            raise ConfigError(f"tool {self.name!r}: cannot read the handler's signature "
                              f"({exc})") from None
        fields: list[Any] = []
        context_name = None
        for pname, param in sig.parameters.items():
            hint = hints.get(pname, Any)
            if _context_param(hint):
                context_name = pname
                continue
            if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD, param.POSITIONAL_ONLY):
                raise ConfigError(f"tool {self.name!r}: parameter {pname!r} must be a plain "
                                  "named parameter so it can be given by name")
            if param.default is param.empty:
                fields.append((pname, hint))
            else:
                fields.append((pname, hint, param.default))
        try:
            args = msgspec.defstruct(f"{self.name}_arguments", fields, kw_only=True,
                                     forbid_unknown_fields=True)
            msgspec.json.schema(args)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"tool {self.name!r}: a parameter's type cannot be validated "
                              f"({' '.join(str(exc).split())}); use JSON-like types, "
                              "msgspec Structs or dataclasses") from None
        return args, context_name

    def _schema(self, args_type: type[msgspec.Struct]) -> dict[str, Any]:
        full = msgspec.json.schema(args_type)
        defs = full.get("$defs", {})
        ref = full.get("$ref", "").rsplit("/", 1)[-1]
        params = dict(defs.pop(ref, full))
        params.pop("title", None)
        if defs:
            params["$defs"] = defs
        return {"name": self.name, "description": self.description, "parameters": params}

    def validate(self, arguments: dict[str, Any]) -> dict[str, Any]:
        """The handler's keyword arguments for ``arguments``.

        Raises:
            ArgumentError: they do not match the schema, or could not be kept (nested
                deeper than ``MAX_DEPTH`` levels, or holding themselves); the message says
                what is wrong.
        """
        if isinstance(arguments, dict) and ARGUMENTS_NOT_KEPT in arguments:
            raise ArgumentError(str(arguments[ARGUMENTS_NOT_KEPT]))
        problem = shape_problem(arguments)
        if problem is not None:
            raise ArgumentError(arguments_not_kept(problem)[ARGUMENTS_NOT_KEPT])
        if self._args_type is None:
            return self._schema_arguments(arguments)
        try:
            value = msgspec.convert(arguments, self._args_type)
        except msgspec.ValidationError as exc:
            raise ArgumentError(str(exc)) from None
        except (TypeError, ValueError, OverflowError, RecursionError) as exc:
            raise ArgumentError(f"they cannot be read ({describe_exception(exc)})") from None
        return {f: getattr(value, f) for f in value.__struct_fields__}

    def _schema_arguments(self, arguments: Any) -> dict[str, Any]:
        """``validate`` for a ``from_schema`` tool: its cached jsonschema validator."""
        try:
            errors = list(itertools.islice(self._validator.iter_errors(arguments), 64))
            error = importlib.import_module("jsonschema.exceptions").best_match(errors)
        except RecursionError:
            raise ArgumentError("they are nested too deeply to be checked") from None
        except Exception as exc:  # an outside $ref, a regex Python cannot compile, ...
            raise ArgumentError(f"they could not be checked against the tool's schema "
                                f"({describe_exception(exc)})") from None
        if error is not None:
            raise ArgumentError(_schema_problem(error))
        if not isinstance(arguments, dict):  # pragma: no cover - the root is an object
            raise ArgumentError(f"Expected `object`, got `{_json_type(arguments)}`")
        if self._accepts is not None:
            unknown = [key for key in arguments if key not in self._accepts]
            if unknown:
                raise ArgumentError(f"Object contains unknown field `{_cut(unknown[0])}` "
                                    "(the tool's handler takes no such parameter)")
        return copy.deepcopy(arguments)

    def bind(self, kwargs: dict[str, Any], context: ToolContext) -> dict[str, Any]:
        """The handler's keyword arguments: ``kwargs`` (or, for a ``from_schema`` handler
        that takes the arguments as one dict, that dict under its parameter's name), plus
        the context parameter when the handler declares one."""
        if self._dict_param is not None:
            kwargs = {self._dict_param: kwargs}
        if self._context_name is None:
            return kwargs
        return {**kwargs, self._context_name: context}

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Call the handler directly (handy in tests)."""
        return self.handler(*args, **kwargs)

    def __repr__(self) -> str:
        return f"Tool({self.name!r})"


# --- tools described by a JSON Schema (Tool.from_schema) ------------------------------------
# (the schema's checks and error messages are in boundloop._tool_schema)

def _schema_binding(name: str, handler: Callable[..., Any], plain: dict[str, Any]
                    ) -> tuple[str | None, str | None, frozenset[str] | None]:
    """How ``handler`` takes the arguments of ``plain``: (its ToolContext parameter, the
    parameter that gets them as one dict, the keywords it takes or None for any)."""
    try:
        sig = inspect.signature(handler)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"tool {name!r}: cannot read the handler's signature ({exc})"
                          ) from None
    try:
        hints = typing.get_type_hints(handler)
    except Exception:  # noqa: BLE001 - an annotation that cannot be resolved: use the text
        hints = {}
    context_name = None
    params = []
    for pname, param in sig.parameters.items():
        if _context_param(hints.get(pname, param.annotation)):
            context_name = pname
        else:
            params.append(param)
    properties = set(plain.get("properties") or ())
    required = set(plain.get("required") or ())
    if context_name is not None and context_name in properties:
        raise ConfigError(f"tool {name!r}: the schema has a property {context_name!r}, the "
                          "name of the handler's ToolContext parameter; rename the parameter")
    if len(params) == 1 and params[0].name not in properties and params[0].kind in (
            params[0].POSITIONAL_OR_KEYWORD, params[0].KEYWORD_ONLY):
        return context_name, params[0].name, None
    takes_any = False
    names = set()
    for param in params:
        if param.kind is param.VAR_KEYWORD:
            takes_any = True
            continue
        if param.kind in (param.VAR_POSITIONAL, param.POSITIONAL_ONLY):
            raise ConfigError(f"tool {name!r}: parameter {param.name!r} must be a plain named "
                              "parameter so it can be given by name (a handler with a single "
                              "parameter gets the arguments as one dict)")
        names.add(param.name)
        if param.default is param.empty and param.name not in required:
            raise ConfigError(f"tool {name!r}: the handler's parameter {param.name!r} has no "
                              "default, but the schema does not require it; list it in the "
                              "schema's \"required\" or give it a default")
    missing = sorted(properties - names)
    if missing and not takes_any:
        raise ConfigError(f"tool {name!r}: the schema's properties {missing} are not "
                          "parameters of the handler; add them (or a **kwargs parameter), or "
                          "take the arguments as one dict with a handler of one parameter")
    return context_name, None, None if takes_any else frozenset(names)



#: A tool as ``Runner.run`` takes it: a ``bl.Tool``, or a plain function (made a Tool with
#: the defaults of ``bl.tool``).
ToolLike = Tool | Callable[..., Any]


@typing.overload
def tool(fn: Callable[..., Any], /) -> Tool: ...


@typing.overload
def tool(*, name: str | None = None, description: str | None = None, read_only: bool = False,
         idempotent: bool = False, irreversible: bool = False, timeout_s: float | None = 60.0,
         retry: RetryPolicy | None = None, reconcile: Callable[[str], Any] | None = None,
         sensitive: Collection[str] = (), needs_approval: bool | ApprovalRule = False,
         max_calls: int | None = None) -> Callable[[Callable[..., Any]], Tool]: ...


def tool(fn: Callable[..., Any] | None = None, /, *, name: str | None = None,
         description: str | None = None, read_only: bool = False, idempotent: bool = False,
         irreversible: bool = False, timeout_s: float | None = 60.0,
         retry: RetryPolicy | None = None, reconcile: Callable[[str], Any] | None = None,
         sensitive: Collection[str] = (), needs_approval: bool | ApprovalRule = False,
         max_calls: int | None = None) -> Tool | Callable[[Callable[..., Any]], Tool]:
    """Make a Tool of a function; use bare (``@bl.tool``) or with options (``@bl.tool(...)``)."""

    def wrap(f: Callable[..., Any]) -> Tool:
        return Tool(name, f, description=description, read_only=read_only,
                    idempotent=idempotent, irreversible=irreversible, timeout_s=timeout_s,
                    retry=retry, reconcile=reconcile, sensitive=sensitive,
                    needs_approval=needs_approval, max_calls=max_calls)

    return wrap(fn) if fn is not None else wrap
