"""The multi-worker drill on PostgreSQL (issue 13, SPEC 12), bounded for the suite.

``boundloop drill --journal postgresql://... --workers 4 --pause --pgdata DIR`` runs 4 worker
processes on one fresh database, SIGKILLs them, freezes them past their lease (SIGSTOP, then
SIGCONT: they wake as zombies) and crash-restarts the server (``pg_ctl -m immediate``). The
big run for the note is the same with ``--runs 2000 --kills 1000``.

A real PostgreSQL server runs on loopback for this module (its own: the drill restarts it);
without the binaries the module is skipped with the reason naming the missing one.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

psycopg = pytest.importorskip("psycopg", reason="PostgreSQL tests need psycopg 3: pip "
                                                "install 'boundloop[postgres]'")

from pg_server import PgServer  # noqa: E402

from boundloop.drill import can_unshare, pg_restart_argv  # noqa: E402
from boundloop.drill._invariants import _able_time, _overlap  # noqa: E402
from boundloop.drill._processes import _Life  # noqa: E402


def drill(tmp: Path, *args: str, timeout: float = 150) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-m", "boundloop", "drill", *args, "--dir",
                          str(tmp / "drill"), "--json"], capture_output=True, text=True,
                         timeout=timeout)
    assert out.returncode in (0, 1), out.stderr
    report: dict[str, Any] = json.loads(out.stdout)
    assert report["ok"] is (out.returncode == 0), report
    return report


def assert_invariants(report: dict[str, Any]) -> None:
    """Everything the drill checks, each by name (so a failure says which)."""
    assert report["runs_not_final"] == 0
    assert report["duplicate_executions"] == 0  # nothing irreversible ran twice
    assert report["executed_without_intent"] == 0
    assert report["unresolved_missed"] == 0 and report["unresolved_spurious"] == 0
    assert report["events_lost"] == 0  # sequences contiguous, every run replays
    assert report["replay_mismatches"] == 0
    assert report["acks_lost"] == 0 and report["acks_checked"] > 0  # every ack present
    assert report["zombie_appends_accepted"] == 0  # every zombie append refused
    assert report["epoch_gaps"] == 0  # epochs raised by exactly one per claim
    assert report["epoch_mismatches"] == 0
    assert report["zombie_executions"] == 0
    assert report["worker_errors"] == 0  # no worker crashed with a traceback
    assert report["faults_injected"] == (report["crashes_injected"] + report["pauses_injected"]
                                         + report["restarts_injected"])
    assert report["unowned_bound_s"] == report["lease_s"] * 1.5 + 1.0
    # Only the time in which another worker could claim (and the server was up) counts.
    assert report["max_unowned_s"] <= report["unowned_bound_s"]
    assert report["takeovers_over_bound"] == 0


def _runs_in(url: str) -> list[tuple[str, str | None]]:
    from boundloop.journal.postgres import PostgresJournal

    with PostgresJournal(url, readonly=True) as j:
        return [(i.run_id, i.status) for i in j.infos()]


@pytest.mark.timeout(180)
def test_four_workers_killed_frozen_and_the_server_crash_restarted(pg: PgServer,
                                                                  tmp_path: Path) -> None:
    report = drill(tmp_path, "--journal", pg.url(), "--pgdata", str(pg.data), "--workers",
                   "4", "--pause", "--runs", "40", "--kills", "16", "--pg-restarts", "2",
                   "--lease", "1.0", "--seed", "3")
    assert report["journal"] == "postgresql" and report["workers"] == 4
    assert report["database"].startswith("drill_")
    assert not any("not restarted" in n for n in report["notes"])
    assert report["restarts_injected"] >= 1 and report["server_down_s"] > 0
    assert report["pauses_injected"] >= 1 and report["crashes_injected"] >= 1
    assert report["takeovers_after_kill"] + report["takeovers_after_pause"] >= 1
    assert report["pid_namespaces"] is can_unshare()
    assert_invariants(report)
    assert report["ok"] is True
    # The drill's database holds every run, each finished as the drill's model ends it.
    url = (tmp_path / "drill" / "journal.url").read_text().strip()
    assert url.endswith("/" + report["database"])
    runs = _runs_in(url)
    assert len(runs) == 40 and {status for _, status in runs} == {"final"}


@pytest.mark.timeout(120)
def test_the_drill_on_postgresql_with_the_records_compressed(pg: PgServer,
                                                             tmp_path: Path) -> None:
    report = drill(tmp_path, "--journal", pg.url(), "--workers", "2", "--runs", "8",
                   "--kills", "3", "--seed", "5", "--compress")
    assert report["compress"] is True and report["faults_injected"] >= 1
    assert_invariants(report)
    assert report["ok"] is True
    with psycopg.connect(pg.url(dbname=report["database"]), autocommit=True) as conn:
        [(fmt,)] = conn.execute("SELECT value FROM boundloop_meta WHERE key = 'format'")
        bodies = [bytes(b) for (b,) in conn.execute("SELECT body FROM boundloop_events")]
    assert bytes(fmt) == (3).to_bytes(4, "big")
    assert len(bodies) > 8 * 10 and all(b[0] == 0xC1 for b in bodies)


@pytest.mark.timeout(120)
def test_without_a_way_to_restart_the_server_the_drill_says_so(pg: PgServer,
                                                                tmp_path: Path) -> None:
    report = drill(tmp_path, "--journal", pg.url(), "--workers", "2", "--runs", "8",
                   "--kills", "3", "--seed", "4")
    assert report["restarts_injected"] == 0 and report["server_down_s"] == 0
    assert any("not restarted" in n for n in report["notes"])
    assert_invariants(report)
    assert report["ok"] is True


def test_the_drill_takes_a_url_and_restarts_only_on_postgresql(tmp_path: Path) -> None:
    for args in (["--journal", str(tmp_path / "j")], ["--pgdata", str(tmp_path)],
                 ["--journal", "postgresql://u@h/db", "--pgdata", str(tmp_path),
                  "--pg-restart-cmd", "true"]):
        out = subprocess.run([sys.executable, "-m", "boundloop", "drill", *args],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 2, (args, out.stdout, out.stderr)
        assert "Traceback" not in out.stderr


def test_the_restart_command_of_a_data_directory(pg: PgServer) -> None:
    argv = pg_restart_argv(pg.data)
    assert argv[-1] == "restart" and argv[argv.index("-m") + 1] == "immediate"
    assert Path(argv[argv.index("-D") + 1]) == pg.data.resolve()
    assert Path(next(a for a in argv if a.endswith("/pg_ctl"))).exists()
    assert (argv[:2] == ["runuser", "-u"]) is (pg.user is not None)


def test_the_time_the_server_was_down_does_not_count_as_unowned() -> None:
    def life(owner: str, ready: float, killed: float = 0.0) -> _Life:
        return _Life(owner, 0, [], None, Path("o"), Path("e"), owner=owner, ready_at=ready,
                     killed_at=killed)

    dead, other = life("a", 1.0, killed=10.0), life("b", 1.0)
    assert _able_time([dead, other], "a", 10.0, 13.0) == 3.0
    assert _able_time([dead, other], "a", 10.0, 13.0, [[10.5, 11.5]]) == 2.0
    assert _able_time([dead, other], "a", 10.0, 13.0, [[9.0, 10.5], [12.5, 0.0]]) == 2.0
    assert _overlap(10.0, 13.0, [[9.0, 10.5], [12.5, 0.0]]) == 1.0
