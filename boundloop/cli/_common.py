"""What the commands share: exit codes, ``--journal`` and ``--json``, durations, and
opening a runner on the journal for the commands that write."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import click

from boundloop.errors import BoundloopError

if TYPE_CHECKING:
    _ParamType = click.ParamType[float]
else:  # click < 8.3: ParamType is not generic
    _ParamType = click.ParamType


EXIT_OK = 0

#: ``replay`` found the fold disagreeing with RunFinished, or ``--check`` found a divergence.
EXIT_MISMATCH = 1

#: Bad input: an unknown command or option, a bad duration or limit.
EXIT_USAGE = 2

#: No run with that id in the journal.
EXIT_UNKNOWN_RUN = 3

#: The journal is missing, locked, unreadable or damaged.
EXIT_JOURNAL = 4

#: What to run about runs listed as damaged: the records themselves, or how they follow.
_DAMAGE_HINT = ("`boundloop verify` checks their records, `boundloop replay RUN_ID` how "
                "they follow")

#: A bug in boundloop (the message says how to see the traceback).
EXIT_INTERNAL = 70

EXIT_CODES = (
    "Exit codes: 0 ok; 1 replay found a mismatch, --check a divergence, or verify a damaged "
    "run; 2 bad input; "
    "3 unknown run id; 4 journal missing, locked, unreadable or damaged (stats: after its "
    "figures); 70 internal error."
)

F = TypeVar("F", bound=Callable[..., Any])


def journal_dir(value: str | None) -> str:
    """``--journal`` (the command's, else the group's), else ``$BOUNDLOOP_JOURNAL``, else
    ``./.boundloop``."""
    from boundloop.ops import journal_dir as resolve

    if value is None:
        ctx = click.get_current_context(silent=True)
        root = ctx.find_root() if ctx is not None else None
        if root is not None and isinstance(root.obj, dict):
            value = root.obj.get("journal")
    return resolve(value)


journal_option = click.option(
    "--journal", "journal", default=None, metavar="DIR|URL",
    help="Journal directory, or a postgresql:// URL (default: $BOUNDLOOP_JOURNAL or "
         "./.boundloop).")


def json_option(what: str) -> Callable[[F], F]:
    """``--json``: print ``what`` as JSON instead of a table."""
    return click.option("--json", "as_json", is_flag=True,
                        help=f"Print {what} as JSON.")


class Duration(_ParamType):
    """A duration such as ``30d``, ``12h``, ``1h30m`` or ``90s`` (in seconds)."""

    name = "duration"

    def convert(self, value: Any, param: click.Parameter | None,
                ctx: click.Context | None) -> float:
        if isinstance(value, int | float):
            return float(value)
        from boundloop.ops import parse_duration

        try:
            return parse_duration(str(value))
        except BoundloopError as exc:
            self.fail(str(exc), param, ctx)


DURATION = Duration()


def _runner(journal: str | None) -> Any:
    """A Runner on an existing journal (never creates one), and the journal to close."""
    from boundloop.ops import open_journal
    from boundloop.runner import Runner

    j = open_journal(journal_dir(journal))
    return Runner(j, model_threads=1, tool_threads=1, supervisors=1), j


def _ids(j: Any, run_id: str, execution_id: str) -> tuple[str, str]:
    """The full run and execution ids that the (possibly shortened) ids given name."""
    from boundloop.ops import resolve_execution_id, resolve_run_id

    run_id = resolve_run_id(j, run_id)
    return run_id, resolve_execution_id(j, run_id, execution_id)
