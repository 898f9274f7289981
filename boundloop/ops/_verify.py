"""The journal's integrity (``boundloop verify``): each run's hash chain and sequence, and
the indexes, checked in a child process that LMDB may crash on damaged pages."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import msgspec

from boundloop.errors import (
    AmbiguousId,
    ConfigError,
    JournalCorrupt,
    UnknownRun,
)
from boundloop.journal.base import Journal
from boundloop.ops._open import journal_dir, open_journal, resolve_run_id

_json = msgspec.json.Encoder()


# -- integrity ---------------------------------------------------------------------------
class ChainReport(msgspec.Struct, frozen=True, kw_only=True):
    """One line of ``boundloop verify``: a run, its chain head in hex, and whether its
    records check out (``error`` says what is damaged, naming the sequence number)."""

    run_id: str
    head: str | None
    ok: bool
    error: str | None = None


def verify_chains(journal: Journal, run_ids: Sequence[str] = ()) -> list[ChainReport]:
    """Check the hash chain and sequence of every run (or of ``run_ids``), as stored: also
    runs whose index entries are damaged or missing, and the indexes of runs themselves.

    This runs in the calling process: LMDB keeps no checksums of its own pages, so a
    journal whose B-tree pages are damaged can crash it (SIGBUS, or an abort on one of its
    assertions). ``verify_journal`` runs the same check in a child process instead.

    Raises:
        UnknownRun: a run of ``run_ids`` is not in the journal.
        ConfigError: ``journal`` is not an LMDB journal (only it keeps a chain).
    """
    reports: dict[str, ChainReport] = {}
    for report in _chain_reports(journal, run_ids):
        _merge(reports, report)
    return list(reports.values())


def _merge(reports: dict[str, ChainReport], report: ChainReport) -> None:
    """Keep the first report of a run, unless a later one finds damage the first did not."""
    old = reports.get(report.run_id)
    if old is None:
        reports[report.run_id] = report
    elif old.ok and not report.ok:
        reports[report.run_id] = msgspec.structs.replace(report, head=report.head or old.head)


def _chain_reports(journal: Journal, run_ids: Sequence[str] = (), listed: Any = None,
                   indexes: bool | None = None, runs: bool = True) -> Iterator[ChainReport]:
    """Reports of ``run_ids`` (else of every run: those in the indexes, then any with records
    but no index entry), then (``indexes``, by default when no ids are given) of the
    indexes; ``listed`` is called with the ids first."""
    from boundloop.journal import chain
    from boundloop.journal.base import Chained

    if not isinstance(journal, Chained):
        raise ConfigError("this journal keeps no hash chain to verify")
    chained = journal
    # A unique prefix names a run; an unknown id is reported by _check_runs.
    run_ids = [_resolve_or_keep(chained, r) for r in run_ids]
    ids = list(run_ids) if run_ids or not runs else chained.indexed_run_ids()
    if listed is not None:
        listed(ids)
    yield from _check_runs(chained, ids, listed_by_user=bool(run_ids))
    if runs and not run_ids:
        known = set(ids)
        try:
            recorded = chained.recorded_run_ids()
        except JournalCorrupt as exc:
            recorded = []
            yield ChainReport(run_id="(records)", head=None, ok=False, error=str(exc))
        yield from _check_runs(chained, [r for r in recorded if r not in known],
                               listed_by_user=False)
    if not run_ids if indexes is None else indexes:
        for index in (chained.infos, chained.open_runs):
            try:
                list(index())
            except chain.ChainError as exc:
                yield ChainReport(run_id=exc.run_id, head=None, ok=False, error=exc.what)
            except JournalCorrupt as exc:
                yield ChainReport(run_id="(index)", head=None, ok=False, error=str(exc))


def _resolve_or_keep(journal: Any, given: str) -> str:
    from boundloop.errors import BoundloopError

    try:
        return resolve_run_id(journal, given)
    except AmbiguousId:
        raise
    except BoundloopError:  # unknown, or an index that cannot be read: reported per run
        return given


def _check_runs(journal: Any, ids: Sequence[str], listed_by_user: bool
                ) -> Iterator[ChainReport]:
    from boundloop.journal import chain

    for run_id in ids:
        try:
            head = journal.chain_head(run_id)
        except UnknownRun:
            if listed_by_user:
                raise
            yield ChainReport(run_id=run_id, head=None, ok=False,
                              error="the order index names it, but it has no index entry")
        except JournalCorrupt as exc:
            stored = journal.stored_head(run_id)
            if isinstance(exc, chain.ChainError):
                what = f"seq {exc.seq}: {exc.what}" if exc.seq else exc.what
            else:
                what = str(exc)
            yield ChainReport(run_id=run_id, head=stored.hex() if stored else None, ok=False,
                              error=what)
        else:
            yield ChainReport(run_id=run_id, head=head.hex(), ok=True)


_report_json = msgspec.json.Decoder(ChainReport)


def _verify_child() -> None:
    """The child process of ``verify_journal``: ``DIR all|some|indexes [RUN_ID...]`` in argv
    (all: the runs given, else every run, and the indexes; indexes: only those), one JSON
    line per finding on stdout (the ids first, then a report per run, then the indexes')."""
    import sys

    from boundloop.errors import BoundloopError

    out = sys.stdout

    def say(value: Any) -> None:
        out.write(_json.encode(value).decode() + "\n")
        out.flush()

    try:
        # Its pages are walked here, as a finding: the runs are read all the same (a crash
        # reading one is reported by the parent), so that each damaged run is named.
        with open_journal(sys.argv[1], readonly=True, walk=False) as j:
            if sys.argv[2] != "some" and hasattr(j, "walk_pages"):
                try:
                    j.walk_pages()
                except BoundloopError as exc:
                    say({"report": ChainReport(run_id="(pages)", head=None, ok=False,
                                               error=str(exc))})
            for report in _chain_reports(j, sys.argv[3:], listed=lambda ids: say({"ids": ids}),
                                         indexes=sys.argv[2] != "some",
                                         runs=sys.argv[2] != "indexes"):
                say({"report": report})
    except BoundloopError as exc:
        say({"error": str(exc), "kind": type(exc).__name__})


def verify_journal(path: str | os.PathLike[str] | None = None,
                   run_ids: Sequence[str] = (), *,
                   progress: Callable[[int, int | None], None] | None = None
                   ) -> list[ChainReport]:
    """``verify_chains`` on the journal in ``path``, in a child process, so that LMDB
    crashing on damaged B-tree pages is reported as damage instead of killing the caller:
    the run being read when the child died is reported damaged (naming the signal), and a
    new child goes on with the runs after it. ``progress``, if given, is told
    ``(runs checked, runs to check)`` as the child reports them.

    Raises:
        UnknownRun: a run of ``run_ids`` is not in the journal.
        JournalUnavailable, JournalCorrupt: the journal cannot be opened.
    """
    import signal
    import subprocess
    import sys
    import tempfile

    from boundloop import errors

    where = journal_dir(path)
    code = "from boundloop.ops._verify import _verify_child; _verify_child()"
    reports: dict[str, ChainReport] = {}
    todo = list(run_ids)
    mode = "some" if run_ids else "all"
    total: int | None = None  # runs to check in all, once the first child listed them
    while True:
        ids: list[str] | None = None
        done = 0
        # Read as the child writes, for the progress; its stderr goes to a file, so that
        # neither pipe can fill up while the other is read.
        with tempfile.TemporaryFile("w+") as err, subprocess.Popen(
                [sys.executable, "-c", code, where, mode, *todo], stdout=subprocess.PIPE,
                stderr=err, text=True) as proc:
            assert proc.stdout is not None
            try:
                for line in proc.stdout:
                    item = msgspec.json.decode(line)
                    if "error" in item:
                        kind = getattr(errors, item["kind"], errors.JournalError)
                        raise kind(item["error"])
                    if "ids" in item:
                        ids = item["ids"]
                        if total is None:
                            total = len(ids)
                    else:
                        _merge(reports, _report_json.decode(_json.encode(item["report"])))
                        done += 1
                    if progress is not None:
                        progress(len(reports), total)
            except BaseException:
                proc.kill()
                raise
            proc.wait()
            err.seek(0)
            stderr = err.read()
        if proc.returncode >= 0:
            if proc.returncode != 0:
                raise errors.JournalError(f"verify failed: {stderr.strip()[-500:]}")
            return list(reports.values())
        try:
            name = signal.Signals(-proc.returncode).name
        except ValueError:
            name = f"signal {-proc.returncode}"
        crashed = (f"LMDB crashed reading it ({name}): the journal's own B-tree pages are "
                   "damaged (LMDB keeps no checksums of them); restore the journal from a "
                   "backup")
        if ids is None or done >= len(ids):
            # While opening or listing the journal, or checking its indexes.
            _merge(reports, ChainReport(run_id="(journal)", head=None, ok=False, error=crashed))
            return list(reports.values())
        _merge(reports, ChainReport(run_id=ids[done], head=None, ok=False, error=crashed))
        todo = ids[done + 1:]
        if not todo:
            if mode != "all":
                return list(reports.values())
            mode = "indexes"


def key_file_warning(path: str | os.PathLike[str] | None = None) -> str | None:
    """A warning when a redaction key file from an older version lies inside the journal
    directory (SPEC 9: the key lives apart from the journal), else None."""
    key = Path(journal_dir(path)) / "redaction.key"
    if not key.exists():
        return None
    return (f"{key} is a redaction key inside the journal directory (from an older version): "
            "anyone with a copy of the journal can use it to confirm guessed secrets; move it "
            "out of the journal directory (keep it with $BOUNDLOOP_REDACTION_KEY_FILE or in "
            "the state directory) and remove it from there")
