"""``boundloop drill``: the crash-recovery and ownership drill (see ``boundloop.drill``)."""

from __future__ import annotations

import click

from boundloop.cli._common import EXIT_MISMATCH, json_option
from boundloop.cli._output import _echo_json, _Out, _progress


@click.command()
@click.option("--runs", type=click.IntRange(min=1), default=200, show_default=True)
@click.option("--kills", type=click.IntRange(min=0), default=50, show_default=True,
              help="Faults to inject at most: SIGKILLs, and with --pause SIGSTOPs too. "
                   "They are spread over the work as it goes, so none comes once the work "
                   "is done: the report says how many were injected.")
@click.option("--seed", type=int, default=1, show_default=True)
@click.option("--workers", type=click.IntRange(min=1, max=16), default=2, show_default=True,
              help="Worker processes sharing the journal.")
@click.option("--pause", is_flag=True, default=False,
              help="Also freeze workers past their lease (SIGSTOP), let the others take "
                   "their runs over, then wake them (SIGCONT) as zombies.")
@click.option("--lease", "lease_s", type=click.FloatRange(min=0.1, max=86_400), default=1.0,
              show_default=True, help="The workers' lease_s, in seconds.")
@click.option("--pidns/--no-pidns", default=None,
              help="Run each worker in its own pid namespace (unshare, as root), so a "
                   "paused worker is judged by its lease (default: with --pause, when "
                   "available).")
@click.option("--dir", "where", type=click.Path(file_okay=False), default=None,
              help="Where to keep the drill's journal and ledger (default: a temp dir).")
@click.option("--journal", "journal", default=None, metavar="URL",
              help="Run on PostgreSQL: a postgresql:// URL of a role that may create "
                   "databases; the drill creates a fresh database drill_<random> on that "
                   "server for its run, and keeps it (default: LMDB, in --dir).")
@click.option("--pgdata", type=click.Path(file_okay=False, exists=True), default=None,
              help="With --journal: the server's data directory; the drill crash-restarts "
                   "the server (pg_ctl restart -m immediate, as the directory's owner) as some "
                   "of its faults. Without it (or --pg-restart-cmd) the server is not "
                   "restarted.")
@click.option("--pg-restart-cmd", "restart_cmd", default=None, metavar="CMD",
              help="With --journal: a shell command that crash-restarts the server and "
                   "returns (instead of --pgdata).")
@click.option("--pg-restarts", "restarts", type=click.IntRange(min=0), default=None,
              help="How many of the faults are server restarts (default: one in 50, at "
                   "least one).")
@click.option("--compress", is_flag=True, default=False,
              help="The workers store the journal's records compressed "
                   "(Runner(compress=True)).")
@click.option("--queue", is_flag=True, default=False,
              help="Enqueue every run up front; the workers are bl.Worker processes serving "
                   "the drill's agent (they take queued and orphaned runs themselves), one "
                   "run in five calls a tool that needs approval, which a person thread "
                   "approves or denies; some faults are SIGTERMs (exit code 0 expected).")
@json_option("the report")
def drill(runs: int, kills: int, seed: int, workers: int, pause: bool, lease_s: float,
          pidns: bool | None, where: str | None, journal: str | None, pgdata: str | None,
          restart_cmd: str | None, restarts: int | None, compress: bool, queue: bool,
          as_json: bool) -> None:
    """Crash-recovery and ownership drill: SIGKILL (and with --pause, SIGSTOP past the
    lease) workers at random moments while the others take their runs over; check the
    journal against a ledger of real side effects. Exits 1 if any invariant fails.
    With --journal postgresql://..., the workers share a PostgreSQL database, and with
    --pgdata (or --pg-restart-cmd) the server is crash-restarted too."""
    import tempfile
    from pathlib import Path

    from boundloop.drill import DrillReport, can_unshare, command, format_report, run_drill
    from boundloop.journal.postgres import is_url

    if pidns and not can_unshare():
        raise click.UsageError("--pidns needs root and a working unshare(1)")
    if journal is not None and not is_url(journal):
        raise click.UsageError("--journal takes a postgresql:// URL (the LMDB drill keeps "
                               "its journal in --dir)")
    if journal is None and (pgdata or restart_cmd or restarts):
        raise click.UsageError("--pgdata, --pg-restart-cmd and --pg-restarts need --journal "
                               "postgresql://...")
    if pgdata and restart_cmd:
        raise click.UsageError("give --pgdata or --pg-restart-cmd, not both")
    if queue and (pgdata or restart_cmd or restarts):
        raise click.UsageError("--queue does not restart the server yet: leave out "
                               "--pgdata, --pg-restart-cmd and --pg-restarts")
    base = Path(where) if where else Path(tempfile.mkdtemp(prefix="boundloop-drill-"))
    report: DrillReport
    with _progress(_Out(), "drill (faults injected)") as bar:
        if queue:
            from boundloop.drill import run_queue_drill

            report = run_queue_drill(base, runs, kills, seed, workers,
                                     out=(lambda s: None) if as_json else bar.echo,
                                     pause=pause, lease_s=lease_s, pidns=pidns,
                                     journal=journal, progress=bar.update, compress=compress)
        else:
            report = run_drill(base, runs, kills, seed, workers,
                               out=(lambda s: None) if as_json else bar.echo, pause=pause,
                               lease_s=lease_s, pidns=pidns, journal=journal, pgdata=pgdata,
                               restart_cmd=restart_cmd, restarts=restarts,
                               progress=bar.update, compress=compress)
    if as_json:
        import msgspec

        _echo_json({**msgspec.to_builtins(report), "ok": report.ok, "dir": str(base)})
    else:
        text = format_report(report, command(runs, kills, seed, workers, pause, lease_s,
                                             pidns, journal, pgdata, restart_cmd, restarts,
                                             compress, queue))
        click.echo("\n".join(line.rstrip() for line in text.splitlines()))
    if not report.ok:
        click.get_current_context().exit(EXIT_MISMATCH)
