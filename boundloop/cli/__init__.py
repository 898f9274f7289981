"""The ``boundloop`` command: a thin layer over the library (SPEC 10).

Every command reads the journal from ``--journal DIR``, else ``$BOUNDLOOP_JOURNAL``, else
``./.boundloop``. The work is done by :mod:`boundloop.ops` (and the Runner); this package
only parses arguments and prints. ``click`` and ``rich`` are imported here, never by
``import boundloop``.

This module holds the command group and the entry point; the commands are in private
modules by job (``_read``, ``_recovery``, ``_workers``, ``_maintenance``, ``_demo``,
``_drill``), what they share in ``_common`` (options, exit codes) and ``_output`` (tables,
progress).
"""

from __future__ import annotations

import os
import sys
from typing import NoReturn

import click

from boundloop._version import __version__
from boundloop.cli._common import (
    EXIT_CODES,
    EXIT_INTERNAL,
    EXIT_JOURNAL,
    EXIT_OK,
    EXIT_UNKNOWN_RUN,
    EXIT_USAGE,
)
from boundloop.cli._demo import demo
from boundloop.cli._drill import drill
from boundloop.cli._maintenance import compact, prune, verify
from boundloop.cli._read import export, replay, runs, show, stats
from boundloop.cli._recovery import recover, resolve
from boundloop.cli._workers import approve, deny, worker
from boundloop.errors import BoundloopError, JournalError, UnknownRun

__all__ = ["cli", "main"]


@click.group(context_settings={"help_option_names": ["-h", "--help"]}, epilog=EXIT_CODES)
@click.version_option(__version__, "-V", "--version", prog_name="boundloop",
                      message="%(prog)s %(version)s")
@click.option("--journal", "journal", default=None, metavar="DIR",
              help="Journal directory for every command (default: $BOUNDLOOP_JOURNAL or "
                   "./.boundloop); a command's own --journal wins.")
@click.pass_context
def cli(ctx: click.Context, journal: str | None) -> None:
    """boundloop: LLM tool loops under hard budgets, on a durable event journal.

    A RUN_ID or EXECUTION_ID may be shortened to a unique prefix of it (an exact id always
    wins; a prefix several ids begin is refused, naming a few). Ids are never cut in a
    listing: at a narrow width other columns give way, or each row becomes a record."""
    ctx.obj = {"journal": journal}


for _command in (demo, runs, show, replay, prune, verify, compact, export, recover, resolve,
                 approve, deny, worker, drill, stats):
    cli.add_command(_command)


def _fail(message: str, code: int) -> NoReturn:
    click.echo("boundloop: " + " ".join(str(message).split()), err=True)
    sys.exit(code)


def main(argv: list[str] | None = None) -> NoReturn:
    """Entry point: bad input exits non-zero with a one-line message, never a traceback."""
    try:
        code = cli.main(args=argv, prog_name="boundloop", standalone_mode=False)
    except click.exceptions.NoArgsIsHelpError as exc:
        click.echo(exc.ctx.get_help() if exc.ctx else str(exc))
        code = EXIT_OK
    except click.ClickException as exc:
        hint = ""
        if isinstance(exc, click.UsageError) and exc.ctx is not None:
            hint = f" (see `{exc.ctx.command_path} --help`)"
        _fail(exc.format_message() + hint, EXIT_USAGE if exc.exit_code == 2 else exc.exit_code)
    except click.exceptions.Abort:
        _fail("aborted", 130)
    except UnknownRun as exc:
        _fail(str(exc), EXIT_UNKNOWN_RUN)
    except JournalError as exc:
        _fail(str(exc), EXIT_JOURNAL)
    except OSError as exc:  # permissions, a missing or odd file: the journal cannot be used
        where = f" ({exc.filename})" if exc.filename else ""
        _fail(f"cannot use the journal{where}: {exc.strerror or exc}; check the path and "
              "its permissions", EXIT_JOURNAL)
    except BoundloopError as exc:
        from boundloop.core.replay import ReplayError  # imported when needed: fast startup

        if isinstance(exc, ReplayError):
            _fail(f"the journal does not replay: {exc}", EXIT_JOURNAL)
        _fail(str(exc), EXIT_USAGE)
    except Exception as exc:  # noqa: BLE001 - the contract: never a traceback
        if os.environ.get("BOUNDLOOP_DEBUG"):
            raise
        journal_failure = type(exc).__module__.split(".")[0] == "lmdb"
        _fail(f"{'journal error' if journal_failure else 'internal error'}: "
              f"{type(exc).__name__}: {exc}" +
              ("" if journal_failure else " (set BOUNDLOOP_DEBUG=1 to see the traceback)"),
              EXIT_JOURNAL if journal_failure else EXIT_INTERNAL)
    sys.exit(code if isinstance(code, int) else EXIT_OK)
