"""How the ``boundloop`` command lays its output out (SPEC 10), driven as users drive it:
``python -m boundloop`` in a subprocess, piped (plain text) and on a pseudo-terminal (rich),
against a journal made by the demo, filler runs, a run killed by SIGKILL mid-run and a run
whose runner is still alive."""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import signal
import struct
import subprocess
import sys
import termios
import textwrap
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from rich.cells import cell_len

import boundloop as bl

ESCAPE = re.compile(r"\x1b(\[[0-9;?]*[ -/]*[@-~]|\][^\x07]*\x07|[@-Z\\-_])")
BOX = re.compile("[\u2500-\u257f]")
FILLERS = 60
CRASH = textwrap.dedent("""
    import os, signal, sys
    import boundloop as bl

    @bl.tool(irreversible=True)
    def deploy(service: str) -> str:
        os.kill(os.getpid(), signal.SIGKILL)  # dies inside the side effect
        return "unreachable"

    call = bl.ToolCall("c1", "deploy", {"service": "api"})
    with bl.Runner(sys.argv[1]) as runner:
        runner.run(model=bl.ScriptedModel([bl.CallTools([call])]), tools=[deploy],
                   prompt="deploy api", run_id="crashed-run")
""")
LIVE = textwrap.dedent("""
    import os, sys, time
    import boundloop as bl

    @bl.tool(read_only=True, timeout_s=120)
    def wait(flag: str) -> str:
        deadline = time.monotonic() + 60
        while not os.path.exists(flag) and time.monotonic() < deadline:
            time.sleep(0.05)
        return "done"

    call = bl.ToolCall("w1", "wait", {"flag": sys.argv[2]})
    with bl.Runner(sys.argv[1]) as runner:
        runner.run(model=bl.ScriptedModel([bl.CallTools([call]), bl.Final("ok")]),
                   tools=[wait], prompt="wait", run_id="live-run")
""")


def env(columns: int | None) -> dict[str, str]:
    e = {k: v for k, v in os.environ.items()
         if k not in ("BOUNDLOOP_JOURNAL", "BOUNDLOOP_DEBUG", "COLUMNS", "LINES",
                      "FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE", "NO_COLOR")}
    if columns is not None:
        e["COLUMNS"] = str(columns)
    return e


class Done:
    def __init__(self, args: Sequence[str], code: int, out: str, err: str) -> None:
        self.args, self.code, self.out, self.err = list(args), code, out, err

    def json(self) -> Any:
        return json.loads(self.out)

    def __repr__(self) -> str:
        return f"boundloop {' '.join(self.args)} -> {self.code}\n{self.out}\n{self.err}"


def many(*commands: Sequence[str], columns: int | None = 200) -> list[Done]:
    """Several piped ``python -m boundloop`` commands at once, each its own process."""
    procs = [subprocess.Popen([sys.executable, "-m", "boundloop", *c], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env(columns))
             for c in commands]
    out = []
    for c, p in zip(commands, procs, strict=True):
        stdout, stderr = p.communicate(timeout=120)
        out.append(Done(c, p.returncode, stdout, stderr))
    return out


def bl_(*args: str, columns: int | None = 200) -> Done:
    return many(args, columns=columns)[0]


def in_pty(args: Sequence[str], columns: int, *, env_columns: bool = True) -> str:
    """The command's output on a pseudo-terminal ``columns`` wide ($COLUMNS set too, unless
    ``env_columns`` is False), as the terminal receives it."""
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, columns, 0, 0))
    proc = subprocess.Popen([sys.executable, "-m", "boundloop", *args], stdin=slave,
                            stdout=slave, stderr=slave,
                            env=env(columns if env_columns else None), close_fds=True)
    os.close(slave)
    chunks = []
    try:
        while True:
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: the child closed the terminal
                break
            if not data:
                break
            chunks.append(data)
    finally:
        os.close(master)
        proc.wait(timeout=120)
    assert proc.returncode == 0, b"".join(chunks).decode(errors="replace")
    return b"".join(chunks).decode()


def assert_plain(done: Done, width: int | None) -> None:
    """Piped output: no escape codes, no box drawing, no trailing spaces, and no line wider
    than ``width`` (None: any width)."""
    assert done.code == 0 and done.err == "", done
    assert done.out.strip(), done
    assert not ESCAPE.search(done.out), done
    assert not BOX.search(done.out), done
    for line in done.out.splitlines():
        assert line == line.rstrip(), (repr(line), done)
        if width is not None:
            assert cell_len(line) <= width, (cell_len(line), line, done)


def visible_lines(raw: str) -> list[str]:
    return [ESCAPE.sub("", line).replace("\r", "") for line in raw.split("\n")]


@pytest.fixture(scope="module")
def journal(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    path = tmp_path_factory.mktemp("layout") / "journal"
    with bl.Runner(path) as runner:  # the oldest runs: enough to pass the default limit
        for i in range(FILLERS):
            runner.run(model=bl.ScriptedModel([bl.Final(f"filler {i}")]), prompt="p",
                       run_id=f"filler-{i:03d}")
    demo = bl_("demo", "--journal", str(path), "--json")
    assert demo.code == 0, demo
    crash = subprocess.run([sys.executable, "-c", CRASH, str(path)], timeout=60,
                           capture_output=True, text=True)
    assert crash.returncode == -signal.SIGKILL, crash.stderr
    scenarios = {row["scenario"]: row for row in demo.json()}
    yield {"path": str(path), "ids": {name: row["run_id"] for name, row in scenarios.items()},
           "runs": FILLERS + len({row["run_id"] for row in scenarios.values()}) + 1}


def commands(journal: dict[str, Any]) -> list[list[str]]:
    j, ids = journal["path"], journal["ids"]
    return [["runs", "--journal", j], ["runs", "--journal", j, "--tree"],
            ["runs", "--journal", j, "--all"],
            ["show", ids["parallel partial failure"], "--journal", j],
            ["show", ids["nested: parent"], "--journal", j],
            ["show", ids["irreversible timeout"], "--journal", j],
            ["show", "crashed-run", "--journal", j],
            ["recover", "--journal", j], ["replay", "crashed-run", "--journal", j],
            ["stats", "--journal", j], ["stats", "--journal", j, "--by", "tool"],
            ["stats", "--journal", j, "--by", "status"]]


@pytest.mark.parametrize("width", [60, 200, None])
def test_piped_output_is_plain_and_fits(journal: dict[str, Any], width: int | None) -> None:
    cmds = commands(journal)
    for done in many(*cmds, columns=width):
        assert_plain(done, width)
    if width == 60:
        show = many(cmds[6], columns=60)[0]
        assert "status: interrupted" in show.out and "hidden at this width" in show.out


def test_the_demo_fits_too(tmp_path: Path) -> None:
    narrow, wide = many(["demo", "--journal", str(tmp_path / "a")], columns=60)[0], \
        many(["demo", "--journal", str(tmp_path / "b")], columns=None)[0]
    assert_plain(narrow, 60)
    assert_plain(wide, None)
    assert max(cell_len(line) for line in wide.out.splitlines()) > 60  # natural width
    terminal = visible_lines(in_pty(["demo", "--journal", str(tmp_path / "d")], 60))
    assert all(cell_len(line) <= 60 for line in terminal), terminal


def test_a_terminal_gets_rich_output_as_wide_as_it_is(journal: dict[str, Any]) -> None:
    j, ids = journal["path"], journal["ids"]
    for args in (["runs", "--journal", j], ["show", ids["nested: parent"], "--journal", j],
                 ["show", "crashed-run", "--journal", j], ["recover", "--journal", j],
                 ["stats", "--journal", j, "--by", "tool"]):
        for columns, env_columns in ((60, True), (72, False), (200, True)):
            raw = in_pty(args, columns, env_columns=env_columns)
            assert ESCAPE.search(raw), "rich styles its output on a terminal"
            lines = visible_lines(raw)
            assert any(BOX.search(line) for line in lines), "the header rule"
            for line in lines:
                assert cell_len(line) <= columns, (columns, line)
                assert line == line.rstrip(), repr(line)
    wide = "\n".join(visible_lines(in_pty(["show", ids["nested: parent"], "--journal", j],
                                          200)))
    assert "budget after" in wide and "child runs" in wide


def test_runs_has_a_default_limit_all_and_n(journal: dict[str, Any]) -> None:
    j, total = journal["path"], journal["runs"]
    table, as_json, every, some, tree_some, both = many(
        ["runs", "--journal", j], ["runs", "--journal", j, "--json"],
        ["runs", "--journal", j, "--json", "--all"], ["runs", "--journal", j, "--json", "-n", "7"],
        ["runs", "--journal", j, "--json", "--tree", "-n", "2"],
        ["runs", "--journal", j, "-n", "3", "--all"])
    assert total > 50
    assert table.code == 0 and table.err == "", table
    assert table.out.splitlines()[0] == f"the newest 50 runs of {total}, newest first"
    assert "-n N or --all for more than 50" in table.out
    body = [line for line in table.out.splitlines()[2:] if line and not line.startswith("(")]
    assert len(body) == 50 and body[0].startswith("crashed-run")
    assert len(as_json.json()) == 50 and "--all" in as_json.err
    rows = every.json()
    assert len(rows) == total and every.err == ""
    assert [r["run_id"] for r in rows][-2:] == ["filler-001", "filler-000"]  # newest first
    assert [r["run_id"] for r in some.json()] == [r["run_id"] for r in rows[:7]]
    assert some.err == ""  # -n given: no note
    tree = tree_some.json()
    assert [(r["run_id"], r["depth"]) for r in tree] == [
        ("crashed-run", 0), (journal["ids"]["nested: parent"], 0),
        (journal["ids"]["nested: child"], 1)]
    assert both.code == 2 and "contradict" in both.err


def test_parent_column_tree_and_children_in_show(journal: dict[str, Any]) -> None:
    j, ids = journal["path"], journal["ids"]
    parent, child = ids["nested: parent"], ids["nested: child"]
    listed, tree, show_parent, show_json, show_child = many(
        ["runs", "--journal", j], ["runs", "--journal", j, "--tree"],
        ["show", parent, "--journal", j], ["show", parent, "--journal", j, "--json"],
        ["show", child, "--journal", j])
    header = listed.out.splitlines()[1].split()
    assert "parent" in header
    [child_line] = [line for line in listed.out.splitlines() if line.startswith(child)]
    assert parent in child_line.split()
    lines = tree.out.splitlines()
    assert "child runs under their parents" in lines[0]
    at = next(i for i, line in enumerate(lines) if line.startswith(parent + " "))
    assert lines[at + 1].startswith(f"↳ {child} ")
    assert not any(line.startswith(child) for line in lines)  # only under its parent
    assert "child runs (1, oldest first)" in show_parent.out
    assert child in show_parent.out.split("child runs", 1)[1]
    [kid] = show_json.json()["children"]
    assert (kid["run_id"], kid["status"], kid["exhausted_limit"], kid["tool_calls"]) == \
        (child, "limit_exceeded", "tool_calls", 3)
    assert f"parent run: {parent}" in show_child.out and "child runs: none" in show_child.out


def status_line(text: str) -> str:
    return next(line for line in text.splitlines() if line.startswith("status: "))


def test_one_word_for_an_interrupted_run(journal: dict[str, Any]) -> None:
    j = journal["path"]
    listed, table, shown, shown_json, replayed, replayed_json = many(
        ["runs", "--journal", j, "--json", "--all"], ["runs", "--journal", j],
        ["show", "crashed-run", "--journal", j],
        ["show", "crashed-run", "--journal", j, "--json"],
        ["replay", "crashed-run", "--journal", j],
        ["replay", "crashed-run", "--journal", j, "--json"])
    [crashed] = [r for r in listed.json() if r["run_id"] == "crashed-run"]
    assert crashed["status"] == "interrupted"
    assert table.out.splitlines()[2].split()[:2] == ["crashed-run", "interrupted"]
    for done in (shown, replayed):
        line = status_line(done.out)
        assert line.startswith("status: interrupted (") and "running" not in line, done
        assert "its runner is gone" in line
    for done in (shown_json, replayed_json):
        assert (done.json()["status"], done.json()["finished"]) == ("interrupted", False)
        assert "running" not in done.json()["explanation"]


def test_one_word_for_a_running_run(tmp_path: Path) -> None:
    j, flag = tmp_path / "journal", tmp_path / "flag"
    worker = subprocess.Popen([sys.executable, "-c", LIVE, str(j), str(flag)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            done = bl_("runs", "--journal", str(j), "--json")
            if done.code == 0 and any(r["run_id"] == "live-run" and r["tool_calls"] == 1
                                      for r in done.json()):
                break
            assert time.monotonic() < deadline, done
            time.sleep(0.1)
        listed, shown, replayed = many(["runs", "--journal", str(j), "--json"],
                                       ["show", "live-run", "--journal", str(j)],
                                       ["replay", "live-run", "--journal", str(j), "--json"])
        assert [r["status"] for r in listed.json()] == ["running"]
        assert status_line(shown.out) == \
            "status: running (no RunFinished event yet; its runner is alive)"
        assert replayed.json()["status"] == "running"
    finally:
        flag.write_text("go")
        worker.communicate(timeout=60)
    assert worker.returncode == 0
    assert bl_("runs", "--journal", str(j), "--json").json()[0]["status"] == "final"


def test_empty_results_say_why(journal: dict[str, Any], tmp_path: Path) -> None:
    j = journal["path"]
    with bl.Runner(tmp_path / "empty"):
        pass
    since, filtered, limited, empty, rejected, bogus, helped = many(
        ["runs", "--journal", j, "--since", "0s"],
        ["runs", "--journal", j, "--since", "0s", "--status", "final"],
        ["runs", "--journal", j, "--limit-hit", "cost"],
        ["runs", "--journal", str(tmp_path / "empty")],
        ["runs", "--journal", j, "--status", "rejected"],
        ["runs", "--journal", j, "--status", "bogus"],
        ["runs", "--help"])
    total = journal["runs"]
    assert since.code == 0, since
    assert since.out.startswith("no run started in the last 0s (this journal holds "
                                f"{total} runs, the newest started ")
    assert "no runs in this journal" not in since.out
    assert filtered.out.startswith("no run started in the last 0s matching --status final")
    assert limited.out.startswith("no runs match --limit-hit cost")
    assert empty.code == 0 and empty.out == "no runs in this journal\n", empty
    assert rejected.code == 2 and rejected.out == "" and "Traceback" not in rejected.err
    assert len(rejected.err.strip().splitlines()) == 1 and "not journaled" in rejected.err
    assert bogus.code == 2 and "rejected" not in bogus.err
    assert "rejected" in " ".join(helped.out.split())


def test_prune_prints_a_summary(journal: dict[str, Any], tmp_path: Path) -> None:
    copies = [tmp_path / "a", tmp_path / "b"]
    for c in copies:
        shutil.copytree(journal["path"], c)
    quiet, verbose = many(["prune", "--journal", str(copies[0]), "--older-than", "0s"],
                          ["prune", "--journal", str(copies[1]), "--older-than", "0s",
                           "--verbose"])
    finished = journal["runs"] - 1  # all but the interrupted run
    for done in (quiet, verbose):
        assert_plain(done, 200)
        assert done.out.startswith(f"removed {finished} finished runs that finished before ")
    assert len(quiet.out.splitlines()) == 2 and "--verbose" in quiet.out
    assert "filler-000" not in quiet.out and journal["ids"]["tool then final"] not in quiet.out
    assert "removed filler-000" in verbose.out
    assert len(verbose.out.splitlines()) == 1 + finished


def test_progress_bars_on_a_terminal_only(monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    from boundloop.cli import _output as cli

    monkeypatch.setenv("FORCE_COLOR", "1")  # rich's force_terminal
    monkeypatch.setenv("COLUMNS", "80")
    out = cli._Out()
    assert out.rich
    with cli._progress(out, "quick work"):
        pass
    assert "quick work" not in capsys.readouterr().out  # under a second: no bar
    with cli._progress(out, "slow work"):
        time.sleep(1.4)
    assert "slow work" in capsys.readouterr().out
    monkeypatch.delenv("FORCE_COLOR")
    monkeypatch.setenv("TTY_COMPATIBLE", "0")
    piped = cli._Out()
    assert not piped.rich
    with cli._progress(piped, "piped work"):
        time.sleep(1.2)
    assert capsys.readouterr().out == ""


def test_fitting_cuts_then_drops_columns() -> None:
    from boundloop.cli._output import Col, _clip, _fit

    cols = [Col("id"), Col("detail", shrink=6), Col("extra", drop=5)]
    rows = [["abc", "a long detail text", "x"]]
    assert _fit(cols, rows, None) == ([0, 1, 2], [3, 18, 5])
    assert _fit(cols, rows, 40) == ([0, 1, 2], [3, 18, 5])
    shown, widths = _fit(cols, rows, 20)
    assert shown == [0, 1] and sum(widths) + 2 <= 20
    shown, widths = _fit(cols, rows, 5)  # nothing fits: cut as far as allowed
    assert shown == [0, 1] and widths == [3, 6]
    assert _clip("abcdef", 4) == "abc…" and _clip("abc", 4) == "abc" and _clip("ab", 0) == ""
    assert _clip("日本語テキスト", 5) == "日本…"
