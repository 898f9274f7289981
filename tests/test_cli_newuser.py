"""The ``boundloop`` command as a new user meets it (SPEC 10): ids never cut and accepted by a
unique prefix, what recover shows before a resolve, a running run's age, verify's summary,
--version, errors by tool, money as plain decimals, one name per event, and a quick start.
Driven as users drive it: ``python -m boundloop`` piped at 60 and 200 columns and without
$COLUMNS, and on a pseudo-terminal."""

from __future__ import annotations

import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import tomllib
from pathlib import Path
from typing import Any

import pytest
from test_cli_layout import LIVE, assert_plain, bl_, in_pty, many, visible_lines

import boundloop as bl

ROOT = Path(__file__).resolve().parent.parent
#: A run killed inside an irreversible side effect: a default (long) run id, a long call id
#: and a secret among its arguments.
CRASH = textwrap.dedent("""
    import os, signal, sys
    import boundloop as bl

    @bl.tool(irreversible=True)
    def deploy(service: str, api_key: str) -> str:
        os.kill(os.getpid(), signal.SIGKILL)  # dies inside the side effect
        return "unreachable"

    call = bl.ToolCall("toolu_01A09q90qw90lq917835lq9", "deploy",
                       {"service": "billing-api", "api_key": "sk-live-abcdef0123456789"})
    with bl.Runner(sys.argv[1]) as runner:
        runner.run(model=bl.ScriptedModel([bl.CallTools([call])]), tools=[deploy],
                   prompt="deploy billing-api")
""")
WIDTHS = (60, 200, None)


@bl.tool
def boom(x: int) -> str:
    """Always fails."""
    raise RuntimeError("boom")


@pytest.fixture(scope="module")
def journal(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    path = tmp_path_factory.mktemp("newuser") / "journal"
    with bl.Runner(path, price=bl.Price(input_per_mtok=1.0, output_per_mtok=1.0)) as runner:
        for run_id in ("alpha", "alpha-2", "alpha-3"):
            runner.run(model=bl.ScriptedModel([bl.Final("done")]), prompt="p", run_id=run_id)
        runner.run(model=bl.ScriptedModel([bl.CallTools([bl.ToolCall("b1", "boom", {"x": 1})]),
                                           bl.Final("gave up")]),
                   tools=[boom], prompt="p", run_id="failing")
    crash = subprocess.run([sys.executable, "-c", CRASH, str(path)], timeout=60,
                           capture_output=True, text=True)
    assert crash.returncode == -signal.SIGKILL, crash.stderr
    listed = bl_("runs", "--journal", str(path), "--json")
    [crashed] = [r["run_id"] for r in listed.json() if r["status"] == "interrupted"]
    assert len(crashed) >= 32  # a default id: long
    return {"path": str(path), "crashed": crashed, "eid": f"{crashed}:1:0",
            "ids": [r["run_id"] for r in listed.json()]}


def test_ids_are_never_cut(journal: dict[str, Any]) -> None:
    j, crashed, eid = journal["path"], journal["crashed"], journal["eid"]
    for width in WIDTHS:
        recover, runs, show = many(["recover", "--journal", j], ["runs", "--journal", j],
                                   ["show", crashed, "--journal", j], columns=width)
        for done in (recover, runs, show):
            assert_plain(done, width)
        for run_id in journal["ids"]:
            assert re.search(rf"(^|\s){re.escape(run_id)}(\s|$)", runs.out, re.M), (run_id,
                                                                                     runs)
        for done in (recover, show):
            assert re.search(rf"(^|\s){re.escape(eid)}(\s|$)", done.out, re.M), done
        assert f"run {crashed}" in recover.out
        # Call ids and event names wrap or stay whole, never cut with "…".
        assert "ModelStepCompleted" in show.out and not re.search(r"toolu\S*…", show.out)
    for columns in (60, 200):
        for args in (["recover", "--journal", j], ["runs", "--journal", j],
                     ["show", crashed, "--journal", j]):
            text = "\n".join(visible_lines(in_pty(args, columns)))
            assert crashed in text, (columns, args, text)
            if args[0] != "runs":
                assert eid in text, (columns, args, text)


def test_a_table_that_cannot_fit_its_ids_becomes_records(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from boundloop.cli._output import Col, _Out

    monkeypatch.setenv("TTY_COMPATIBLE", "0")
    monkeypatch.setenv("COLUMNS", "40")
    out = _Out()
    assert not out.rich and out.width == 40
    out.table([Col("run id"), Col("execution id"), Col("tool", shrink=4)],
              [("r" * 30, "r" * 30 + ":1:0", "deploy")])
    lines = capsys.readouterr().out.splitlines()
    assert "run id: " + "r" * 30 in lines, lines
    assert "r" * 30 + ":1:0" in [line.split(": ")[-1].strip() for line in lines], lines
    assert not any("…" in line or len(line) > 40 for line in lines), lines


def test_unique_prefixes_name_runs_and_actions(journal: dict[str, Any],
                                               tmp_path: Path) -> None:
    j, crashed, eid = journal["path"], journal["crashed"], journal["eid"]
    short = crashed[:8]
    show, replay, export, verify, exact, shown_exact = many(
        ["show", short, "--journal", j, "--json"], ["replay", short, "--journal", j, "--json"],
        ["export", short, "--journal", j], ["verify", short, "--journal", j],
        ["show", "alpha", "--journal", j, "--json"], ["show", "alpha-2", "--journal", j])
    assert show.code == 0 and show.json()["run_id"] == crashed, show
    assert replay.json()["run_id"] == crashed
    assert export.code == 0 and all(f'"run_id":"{crashed}"' in line
                                    for line in export.out.splitlines()[1:]), export
    assert verify.code == 0 and verify.out.startswith(crashed + "  "), verify
    assert exact.json()["run_id"] == "alpha"  # an exact id wins over a longer id it begins
    assert "run alpha-2" in shown_exact.out
    for args in (["show", "alpha-", "--journal", j], ["replay", "alph", "--journal", j],
                 ["export", "alpha-", "--journal", j], ["verify", "alpha-", "--journal", j],
                 ["resolve", "alpha-", "x", "failed", "--journal", j],
                 ["approve", "alpha-", "x", "--journal", j],
                 ["deny", "alpha-", "x", "--journal", j]):
        done = bl_(*args)
        assert done.code != 0 and done.out == "", done
        [line] = done.err.splitlines()
        assert "ambiguous" in line and "alpha-2" in line and "alpha-3" in line, done
        assert "Traceback" not in done.err
    unknown = bl_("show", "zzz", "--journal", j)
    assert unknown.code == 3 and len(unknown.err.splitlines()) == 1, unknown
    copy = tmp_path / "copy"
    shutil.copytree(j, copy)
    done = bl_("resolve", short, eid[:len(crashed) + 2], "failed", "--note", "checked",
               "--journal", str(copy))
    assert done.code == 0, done
    assert done.out.startswith(f"recorded: {eid} failed;") and crashed in done.out, done


def test_recover_shows_the_arguments_redacted(journal: dict[str, Any]) -> None:
    j = journal["path"]
    for width in WIDTHS:
        done = bl_("recover", "--journal", j, columns=width)
        assert_plain(done, width)
        flat = " ".join(done.out.split())
        assert "billing-api" in flat and "api_key" in flat, done
        assert "sk-live" not in done.out, done
    as_json = bl_("recover", "--journal", j, "--json").json()
    [action] = as_json[0]["unresolved"]
    assert action["arguments"]["service"] == "billing-api"
    assert action["arguments"]["api_key"] != "sk-live-abcdef0123456789"


def test_a_running_run_shows_its_age(tmp_path: Path) -> None:
    j, flag = tmp_path / "journal", tmp_path / "flag"
    worker = subprocess.Popen([sys.executable, "-c", LIVE, str(j), str(flag)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            done = bl_("runs", "--journal", str(j), "--json")
            if done.code == 0 and any(r["tool_calls"] == 1 for r in done.json()):
                break
            assert time.monotonic() < deadline, done
            time.sleep(0.1)
        time.sleep(2.2)
        listed, table, shown = many(["runs", "--journal", str(j), "--json"],
                                    ["runs", "--journal", str(j)],
                                    ["show", "live", "--journal", str(j)])
        age = re.search(r"elapsed: ([0-9.]+)s$", shown.out, re.M)
        assert age and float(age.group(1)) >= 2.0, shown
        [run] = listed.json()
        assert run["status"] == "running" and run["elapsed_s"] >= 2.0, run
        row = table.out.splitlines()[2].split()
        assert row[1] == "running" and float(row[-1].rstrip("s")) >= 2.0, table
    finally:
        flag.write_text("go")
        worker.communicate(timeout=60)
    assert worker.returncode == 0


def test_verify_ends_with_a_summary(journal: dict[str, Any]) -> None:
    done = bl_("verify", "--journal", journal["path"])
    assert done.code == 0, done
    lines = done.out.splitlines()
    n = len(journal["ids"])
    assert len(lines) == n + 1
    for line in lines[:-1]:
        run_id, head, word = line.split()
        assert run_id in journal["ids"] and re.fullmatch("[0-9a-f]{64}", head) and word == "ok"
    assert lines[-1] == f"verified {n} runs: 0 damaged, {n} ok"


def test_version() -> None:
    want = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    for args in (["--version"], ["-V"]):
        done = bl_(*args)
        assert (done.code, done.out, done.err) == (0, f"boundloop {want}\n", ""), done
    entry = subprocess.run([sys.executable, "-c", "from boundloop.cli import main; main()",
                            "--version"], capture_output=True, text=True, timeout=60)
    assert entry.stdout == f"boundloop {want}\n"
    assert bl.__version__ == want


def test_stats_by_tool_counts_errors(journal: dict[str, Any]) -> None:
    as_json = bl_("stats", "--journal", journal["path"], "--by", "tool", "--json").json()
    assert as_json["groups"]["boom"]["errors"] == 1
    for width in (200, None):
        done = bl_("stats", "--journal", journal["path"], "--by", "tool", columns=width)
        assert_plain(done, width)
        lines = done.out.splitlines()
        header = next(line.split() for line in lines if line.startswith("tool  "))
        row = next(line.split() for line in lines if line.startswith("boom "))
        assert header[2] == "errors" and row[2] == "1", done


def test_money_is_a_plain_decimal(journal: dict[str, Any]) -> None:
    from boundloop._text import money

    assert money(3.3e-05) == "$0.000033" and money(12.5) == "$12.5" and money(0.0) == "$0"
    assert money(1234567.25) == "$1234567.25"
    j = journal["path"]
    outs = many(["show", "alpha", "--journal", j], ["runs", "--journal", j],
                ["stats", "--journal", j], ["stats", "--journal", j, "--by", "status"],
                ["replay", "alpha", "--journal", j])
    for done in outs:
        assert done.code == 0, done
        assert not re.search(r"\d[eE][-+]\d", done.out), done
        assert re.search(r"\$0\.0000\d", done.out), done


def test_show_and_export_name_events_alike(journal: dict[str, Any], tmp_path: Path) -> None:
    j = journal["path"]
    show, export = many(["show", "failing", "--journal", j, "--json"],
                        ["export", "failing", "--journal", j])
    shown = [row["event"] for row in show.json()["rows"]]
    exported = [__import__("json").loads(line)["type"] for line in export.out.splitlines()]
    assert shown == exported and "CallDecided" in shown and "CallFailed" in shown
    assert all("type" not in row for row in show.json()["rows"])
    text = bl_("show", "failing", "--journal", j).out
    assert "CallDecided" in text and "call.decided" not in text
    file = tmp_path / "failing.jsonl"
    file.write_text(export.out)
    replayed = bl_("replay", "--events", str(file), "--json")
    assert replayed.code == 0 and replayed.json()["status"] == "final", replayed
    old = bl_("replay", "--events", str(ROOT / "tests" / "golden" / "final.jsonl"))
    assert old.code == 0, old  # exports that name events by their tags still load


def test_small_commands_start_quickly() -> None:
    code = ("import sys, boundloop.cli; heavy = ('boundloop.runner', 'boundloop.mcp', "
            "'asyncio', 'opentelemetry', 'psycopg', 'rich', 'msgspec', 'boundloop.events'); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in heavy or m in heavy))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", proc
    listing = subprocess.run([sys.executable, "-X", "importtime", "-m", "boundloop", "runs",
                              "--journal", str(ROOT / "no-such-journal")],
                             capture_output=True, text=True, timeout=60)
    loaded = {line.split("|")[-1].strip() for line in listing.stderr.splitlines()
              if line.startswith("import time:")}
    assert listing.returncode == 4 and "boundloop.ops" in loaded, listing.stderr[-2000:]
    for heavy in ("boundloop.runner", "boundloop.mcp", "asyncio", "opentelemetry", "psycopg",
                  "boundloop.telemetry"):
        assert heavy not in loaded, heavy
    version = subprocess.run([sys.executable, "-X", "importtime", "-m", "boundloop",
                              "--version"], capture_output=True, text=True, timeout=60)
    assert version.returncode == 0, version
    assert "boundloop.runner" not in version.stderr and "rich" not in version.stderr


@bl.tool(read_only=True)
def echo(n: int) -> str:
    """Returns n."""
    return str(n)


def test_execution_id_prefixes(tmp_path: Path) -> None:
    from boundloop.errors import AmbiguousId
    from boundloop.ops import open_journal, resolve_execution_id, resolve_run_id

    calls = [bl.ToolCall(f"c{i}", "echo", {"n": i}) for i in range(11)]
    with bl.Runner(tmp_path / "j") as runner:
        runner.run(model=bl.ScriptedModel([bl.CallTools(calls), bl.Final("ok")]),
                   tools=[echo], prompt="p", run_id="many-calls")
    with open_journal(tmp_path / "j", readonly=True) as j:
        assert resolve_run_id(j, "many") == "many-calls"
        assert resolve_execution_id(j, "many-calls", "many-calls:1:1") == "many-calls:1:1"
        assert resolve_execution_id(j, "many-calls", "many-calls:1:10") == "many-calls:1:10"
        assert resolve_execution_id(j, "many-calls", "many-calls:1:9") == "many-calls:1:9"
        with pytest.raises(AmbiguousId, match=r"11 execution ids begin with it .* and 7 more"):
            resolve_execution_id(j, "many-calls", "many-calls:1:")
        assert resolve_execution_id(j, "many-calls", "nope") == "nope"  # the caller says
