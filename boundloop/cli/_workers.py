"""A person's decisions and the workers: ``approve``, ``deny`` and ``worker``."""

from __future__ import annotations

import os
import sys

import click

from boundloop.cli._common import _ids, _runner, journal_dir, journal_option
from boundloop.cli._output import _plural


def _decide(journal: str | None, run_id: str, execution_id: str, approved: bool,
            by: str | None, note: str) -> None:
    runner, j = _runner(journal)
    try:
        run_id, execution_id = _ids(j, run_id, execution_id)
        decide = runner.approve if approved else runner.deny
        state = decide(run_id, execution_id, by=by, note=note)
    finally:
        runner.close()
        j.close()
    word = "approved" if approved else "denied"
    left = len(state.awaiting)
    then = f"{left} more call(s) of {run_id} wait for a decision" if left else \
        f"{run_id} is queued: a worker serving agent {state.agent!r} continues it" \
        if state.agent else f"{run_id} is queued: resume it with runner.resume(...)"
    click.echo(f"{word}: {execution_id}; {then}")


_BY = click.option("--by", default=None, help="Who decided (default: user@host).")

_NOTE = click.option("--note", default="", help="Why (kept in the journal).")


@click.command()
@journal_option
@click.argument("run_id")
@click.argument("execution_id")
@_BY
@_NOTE
def approve(journal: str | None, run_id: str, execution_id: str, by: str | None,
            note: str) -> None:
    """Approve a call of RUN_ID that waits for a person (`boundloop show RUN_ID` lists
    them): a worker then dispatches it. A call that does not wait is refused. RUN_ID and
    EXECUTION_ID may be unique prefixes."""
    _decide(journal, run_id, execution_id, True, by, note)


@click.command()
@journal_option
@click.argument("run_id")
@click.argument("execution_id")
@_BY
@_NOTE
def deny(journal: str | None, run_id: str, execution_id: str, by: str | None,
         note: str) -> None:
    """Deny a call of RUN_ID that waits for a person: it is recorded denied, never runs,
    and the model sees it when a worker continues the run. RUN_ID and EXECUTION_ID may be
    unique prefixes."""
    _decide(journal, run_id, execution_id, False, by, note)


@click.command()
@journal_option
@click.argument("target", metavar="MODULE:AGENTS")
@click.option("--concurrency", type=click.IntRange(min=1), default=8, show_default=True,
              help="Runs this worker drives at once.")
@click.option("--grace", "grace_s", type=click.FloatRange(min=0), default=30.0,
              show_default=True, help="Seconds running attempts get to end on SIGTERM.")
@click.option("--lease", "lease_s", type=click.FloatRange(min=0.1, max=86_400), default=30.0,
              show_default=True, help="The worker's lease_s, in seconds.")
def worker(journal: str | None, target: str, concurrency: int, grace_s: float,
           lease_s: float) -> None:
    """Serve agents until SIGTERM or SIGINT: MODULE:AGENTS names a bl.Agent, a list of them,
    or a function returning them (e.g. myapp.agents:AGENTS). Takes queued runs and runs
    whose runner is gone; a second signal stops at once."""
    import importlib

    from boundloop.agent import Agent
    from boundloop.worker import Worker

    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise click.BadParameter("give MODULE:AGENTS, e.g. myapp.agents:AGENTS",
                                 param_hint="'MODULE:AGENTS'")
    hint = "'MODULE:AGENTS'"
    sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - the user's module: its error, in one line
        raise click.BadParameter(f"cannot import {module_name!r}: {type(exc).__name__}: "
                                 f"{exc}", param_hint=hint) from None
    if not hasattr(module, attr):
        raise click.BadParameter(f"module {module_name!r} has no {attr!r}", param_hint=hint)
    found = getattr(module, attr)
    if callable(found) and not isinstance(found, Agent):
        try:
            found = found()
        except Exception as exc:  # noqa: BLE001 - the user's factory
            raise click.BadParameter(f"{target} raised {type(exc).__name__}: {exc}",
                                     param_hint=hint) from None
    if isinstance(found, Agent):
        agents = [found]
    elif isinstance(found, list | tuple) and found \
            and all(isinstance(a, Agent) for a in found):
        agents = list(found)
    else:
        raise click.BadParameter(f"{target} is {type(found).__name__} {found!r:.60}, not a "
                                 "bl.Agent or a non-empty list of them", param_hint=hint)
    w = Worker(journal_dir(journal), agents, concurrency=concurrency, grace_s=grace_s,
               lease_s=lease_s)
    names = ", ".join(a.name for a in agents)
    click.echo(f"boundloop worker: serving {names} (concurrency {concurrency}); "
               "SIGTERM or Ctrl-C stops it", err=True)
    w.serve()
    click.echo(f"boundloop worker: stopped after {_plural(len(w.finished), 'run turn')}",
               err=True)
