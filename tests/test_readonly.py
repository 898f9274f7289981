"""Commands that only read (SPEC 6) write nothing, create nothing, chmod nothing, and never
wait for a writer: tested on a copied journal, and against a process holding a write
transaction."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import boundloop as bl
from boundloop import cli

READERS = [["runs"], ["runs", "--json"], ["show", "done"], ["show", "done", "--json"],
           ["replay", "done"], ["export", "done"], ["export", "done", "--strip-content"],
           ["recover"], ["recover", "--json"], ["prune", "--older-than", "0s", "--dry-run"]]


def boundloop(journal: Path, *args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "boundloop", "--journal", str(journal), *args],
                          capture_output=True, text=True, timeout=timeout)


def snapshot(directory: Path) -> dict[str, tuple[int, bytes | int]]:
    """Every file's mode and bytes (lock.mdb: its size; readers may use its slots)."""
    out: dict[str, tuple[int, bytes | int]] = {}
    for path in sorted(directory.rglob("*")):
        st = path.stat()
        rel = str(path.relative_to(directory))
        out[rel] = (st.st_mode, st.st_size if path.name == "lock.mdb" else path.read_bytes())
    out["."] = (directory.stat().st_mode, b"")
    return out


@pytest.fixture(scope="module")
def journal(tmp_path_factory: pytest.TempPathFactory) -> Path:
    where = tmp_path_factory.mktemp("ro") / "j"
    with bl.Runner(where) as runner:
        runner.run(model=bl.ScriptedModel([bl.Final("ok")]), prompt="p", run_id="done")
    return where


@pytest.mark.parametrize("with_lock", [True, False], ids=["copy", "copy-without-lock"])
def test_reading_commands_leave_a_copied_journal_unchanged(journal: Path, tmp_path: Path,
                                                           with_lock: bool) -> None:
    copy = tmp_path / "copy"
    shutil.copytree(journal, copy)
    if not with_lock:
        (copy / "lock.mdb").unlink()
    os.chmod(copy / "data.mdb", 0o644)  # a mode a writer would change to 0600
    before = snapshot(copy)
    for args in READERS:
        proc = boundloop(copy, *args)
        assert proc.returncode == 0, (args, proc.stderr)
        assert snapshot(copy) == before, args
    assert "done" in boundloop(copy, "runs").stdout


def test_runs_does_not_wait_for_a_writer(journal: Path, tmp_path: Path) -> None:
    copy = tmp_path / "busy"
    shutil.copytree(journal, copy)
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import sys, time, lmdb
        env = lmdb.open(sys.argv[1], max_dbs=16)
        with env.begin(write=True):
            print("holding", flush=True)
            time.sleep(10)
    """), str(copy)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "holding"
        started = time.monotonic()
        proc = boundloop(copy, "runs", timeout=8)
        took = time.monotonic() - started
        assert proc.returncode == 0, proc.stderr
        assert "done" in proc.stdout and took < 3, took
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.parametrize("size", ["missing", "empty"])
def test_no_or_an_empty_data_file_is_not_a_journal(tmp_path: Path, size: str) -> None:
    where = tmp_path / "j"
    where.mkdir()
    if size == "empty":
        (where / "data.mdb").write_bytes(b"")
    for args in (["runs"], ["show", "x"], ["recover"], ["export", "x"]):
        proc = boundloop(where, *args)
        assert proc.returncode == 4, (args, proc.stdout, proc.stderr)
        assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr
    assert sorted(p.name for p in where.iterdir()) == ([] if size == "missing" else
                                                       ["data.mdb"])
    if size == "empty":
        with pytest.raises(bl.JournalCorrupt):
            bl.Runner(where)


def test_an_os_error_is_a_journal_problem_not_an_internal_error(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    def refuse(*args: object, **kwargs: object) -> object:
        raise PermissionError(13, "Permission denied", "/srv/journal/data.mdb")

    monkeypatch.setattr("boundloop.ops.open_journal", refuse)
    with pytest.raises(SystemExit) as exited:
        cli.main(["--journal", "/srv/journal", "runs"])
    assert exited.value.code == 4
    err = capsys.readouterr().err
    assert "Permission denied" in err and "/srv/journal/data.mdb" in err
    assert len(err.strip().splitlines()) == 1
