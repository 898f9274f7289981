"""The commands that look after the journal itself: ``prune``, ``verify`` and ``compact``."""

from __future__ import annotations

import click

from boundloop.cli._common import DURATION, EXIT_MISMATCH, journal_dir, journal_option, json_option
from boundloop.cli._output import _echo_json, _mb, _Out, _plural, _progress, _when
from boundloop.errors import JournalUnavailable


@click.command()
@journal_option
@json_option("what was pruned")
@click.option("--older-than", type=DURATION, required=True, metavar="AGE",
              help="Remove runs that finished more than AGE ago (e.g. 30d).")
@click.option("--dry-run", is_flag=True, help="Only say what would be removed.")
@click.option("-v", "--verbose", is_flag=True,
              help="Also list the id of every run removed, and of every run kept and why.")
def prune(journal: str | None, as_json: bool, older_than: float, dry_run: bool,
          verbose: bool) -> None:
    """Remove finished runs older than AGE (retention) and print a summary. Open runs and
    runs recovery still needs are kept. `boundloop compact` then gives the space back."""
    from boundloop.ops import open_journal
    from boundloop.ops import prune as do_prune

    out = _Out()
    with open_journal(journal_dir(journal), readonly=dry_run) as j, \
            _progress(out, "pruning" if not dry_run else "looking for runs to prune") as bar:
        report = do_prune(j, older_than, dry_run=dry_run, progress=bar.update)
    if as_json:
        _echo_json(report)
        return
    verb = "would remove" if dry_run else "removed"
    out.line(f"{verb} {_plural(len(report.pruned), 'finished run')} that finished before "
             f"{_when(report.cut_ts)}")
    reasons: dict[str, int] = {}
    for why in report.kept.values():
        reasons[why] = reasons.get(why, 0) + 1
    for why, n in reasons.items():
        out.line(f"kept {_plural(n, 'run')} older than that: {why}")
    if verbose:
        for run_id in report.pruned:
            out.line(f"  {verb} {run_id}")
        for run_id, why in report.kept.items():
            out.line(f"  kept {run_id}: {why}")
    elif report.pruned or report.kept:
        out.line("(--verbose lists their ids)", style="dim")


@click.command()
@journal_option
@json_option("a list of {run_id, head, ok, error}")
@click.argument("run_ids", nargs=-1, metavar="[RUN_ID]...")
def verify(journal: str | None, as_json: bool, run_ids: tuple[str, ...]) -> None:
    """Check the hash chain of every run (or of RUN_IDs, each an id or a unique prefix of
    one): one line per run with its id, its chain head in hex (keep it to prove the run
    unchanged later) and ok or what is damaged, then a summary line (verified N runs: D
    damaged, K ok). Exits 1 if any run is damaged. Read-only."""
    from boundloop.ops import key_file_warning, verify_journal

    where = journal_dir(journal)
    warning = key_file_warning(where)
    if warning:
        click.echo(f"boundloop: warning: {warning}", err=True)
    # In a child process: LMDB crashing on damaged pages of its own is reported as damage.
    with _progress(_Out(), "verifying the hash chains") as bar:
        reports = verify_journal(where, run_ids, progress=bar.update)
    if as_json:
        _echo_json(reports)
    else:
        if not reports:
            click.echo("boundloop: no runs in this journal", err=True)
        for r in reports:
            click.echo((f"{r.run_id}  {r.head or '-'}  "
                        + ("ok" if r.ok else f"DAMAGED {r.error}")).rstrip())
        if reports:
            bad = sum(1 for r in reports if not r.ok)
            click.echo(f"verified {_plural(len(reports), 'run')}: {bad} damaged, "
                       f"{len(reports) - bad} ok")
    damaged = [r.run_id for r in reports if not r.ok]
    if damaged:
        click.echo(f"boundloop: {len(damaged)} of {len(reports)} runs damaged: "
                   f"{', '.join(damaged)}", err=True)
        click.get_current_context().exit(EXIT_MISMATCH)


@click.command()
@journal_option
@json_option("the sizes")
def compact(journal: str | None, as_json: bool) -> None:
    """Rewrite the journal to reclaim the space of pruned runs (LMDB files never shrink by
    themselves). Crash-safe: the old journal stays whole until the new one replaces it.
    Refused while a runner or any other process has the journal open."""
    from boundloop.ops import compact as do_compact

    where = journal_dir(journal)
    if "://" in where:
        raise JournalUnavailable(f"compact rewrites an LMDB journal; {where.split('://')[0]} "
                                 "journals reclaim space by themselves (PostgreSQL: VACUUM)")
    out = _Out()
    with _progress(out, "compacting the journal (records copied)") as bar:
        report = do_compact(where, progress=bar.update)
    if as_json:
        _echo_json(report)
        return
    out.line(f"compacted {report.journal}: data.mdb {report.before} bytes before, "
             f"{report.after} bytes after ({_mb(report.before)} -> {_mb(report.after)})",
             record=True)
