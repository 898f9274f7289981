"""Progress of the long commands (issue #11): prune, verify, compact and the drill tell how far
they are, and the CLI draws it as a rich progress bar on a terminal (plain output on a pipe)."""

from __future__ import annotations

import io
import time
from pathlib import Path

import pytest
from rich.console import Console

import boundloop as bl
from boundloop import ops
from boundloop.cli import _output
from boundloop.journal.lmdb import LmdbJournal


def journal_with(path: Path, runs: int) -> list[str]:
    with bl.Runner(path) as runner:
        ids = [runner.run(model=bl.ScriptedModel([bl.Final("ok")]), tools=[], prompt="p",
                          run_id=f"run-{i:03d}").run_id for i in range(runs)]
    return ids


def test_verify_tells_each_run_checked(tmp_path: Path) -> None:
    ids = journal_with(tmp_path / "j", 12)
    told: list[tuple[int, int | None]] = []
    reports = ops.verify_journal(tmp_path / "j", progress=lambda d, t: told.append((d, t)))
    assert sorted(r.run_id for r in reports if r.run_id in ids) == ids
    assert all(r.ok for r in reports)
    checked = [d for d, t in told if t == len(ids)]
    assert checked == sorted(checked) and checked[-1] >= len(ids)  # and the indexes after


def test_prune_tells_runs_removed(tmp_path: Path) -> None:
    ids = journal_with(tmp_path / "j", 300)
    told: list[tuple[int, int | None]] = []
    with LmdbJournal(tmp_path / "j") as j:
        report = ops.prune(j, 0, now=time.time() + 10,
                               progress=lambda d, t: told.append((d, t)))
        assert list(j.runs()) == []
    assert sorted(report.pruned) == ids
    assert told[0] == (0, 300) and told[-1] == (300, 300) and (256, 300) in told


def test_compact_tells_records_copied(tmp_path: Path) -> None:
    journal_with(tmp_path / "j", 5)
    told: list[tuple[int, int | None]] = []
    report = ops.compact(tmp_path / "j", progress=lambda d, t: told.append((d, t)))
    assert report.after > 0
    totals = {t for _, t in told}
    assert len(totals) == 1 and told[-1][0] == totals.pop()  # every record, of one total
    with LmdbJournal(tmp_path / "j", readonly=True) as j:
        assert len(list(j.runs())) == 5


def test_the_bar_shows_on_a_terminal_after_a_second_and_keeps_lines_above_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    screen = io.StringIO()
    out = _output._Out()
    out.console = Console(file=screen, force_terminal=True, width=60)
    out.rich = True
    with _output._progress(out, "checking") as bar:
        bar.update(3, 10)
        time.sleep(1.4)  # the bar appears once the work has taken a second
        bar.echo("a line of the work's own")
        bar.update(7, 10)
        time.sleep(0.3)
    drawn = screen.getvalue()
    assert "checking" in drawn and "7/10" in drawn
    assert "a line of the work's own" in drawn


def test_a_pipe_gets_no_bar_only_the_lines(capsys: pytest.CaptureFixture[str]) -> None:
    out = _output._Out()
    assert not out.rich  # pytest captures: not a terminal
    with _output._progress(out, "checking") as bar:
        bar.update(1, 2)
        bar.echo("plain line")
    assert capsys.readouterr().out == "plain line\n"
