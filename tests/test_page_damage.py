"""SPEC 6: damage to LMDB's own B-tree pages (a zeroed page, two pages swapped, a node
offset pointing out of its page) is JournalCorrupt, never a SIGBUS or an LMDB assertion
(SIGABRT) in whatever reads the journal: the Runner, and every command (SPEC 10).

Each damaged journal is read in a subprocess, so a crash is seen instead of taking the test
run down.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import lmdb
import pytest

import boundloop as bl
from boundloop.journal.lmdb._records import _names

PAGE = 4096
CLI = [sys.executable, "-m", "boundloop"]
READ_ALL = """
import sys, boundloop as bl
try:
    with bl.Runner(sys.argv[1]) as runner:
        for run_id in list(runner.journal.runs()):
            bl.replay(list(runner.journal.events(run_id)))
        runner.recover()
except bl.JournalCorrupt as exc:
    print("JournalCorrupt", str(exc).splitlines()[0])
    sys.exit(4)
print("read")
"""


@bl.tool(read_only=True, idempotent=True)
def echo(x: int) -> int:
    """Echo."""
    return x


@pytest.fixture(scope="module")
def clean(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("clean") / "j"
    with bl.Runner(path, sync=False) as runner:
        for i in range(40):
            model = bl.ScriptedModel([bl.CallTools([bl.ToolCall(f"c{s}", "echo", {"x": s})])
                                      for s in range(3)] + [bl.Final("done")])
            assert runner.run(model=model, tools=[echo], prompt=f"p{i}",
                              run_id=f"run-{i:03d}").status == "final"
    return path


def events_tree(path: Path) -> tuple[int, list[int]]:
    """The events table's root page (a branch) and the leaf pages it points to, in key
    order (only live pages: data.mdb also holds old copies of pages, now free)."""
    env = lmdb.open(str(path), max_dbs=8, readonly=True, lock=False)
    try:
        with env.begin() as txn:
            record = txn.get(b"events")
    finally:
        env.close()
    assert record is not None
    depth, root = int.from_bytes(record[6:8], "little"), int.from_bytes(record[40:48], "little")
    assert depth == 2, depth
    page = (path / "data.mdb").read_bytes()[root * PAGE:(root + 1) * PAGE]
    lower = int.from_bytes(page[12:14], "little")
    leaves = []
    for n in range((lower - 16) // 2):
        at = int.from_bytes(page[16 + 2 * n:18 + 2 * n], "little")
        leaves.append(int.from_bytes(page[at:at + 4], "little")
                      | int.from_bytes(page[at + 4:at + 6], "little") << 32)
    return root, leaves


def event_leaves(path: Path) -> list[int]:
    return events_tree(path)[1]


def damaged(clean: Path, tmp_path: Path, damage: Callable[[bytearray], None]) -> Path:
    path = tmp_path / "j"
    shutil.copytree(clean, path)
    data = bytearray((path / "data.mdb").read_bytes())
    damage(data)
    (path / "data.mdb").write_bytes(bytes(data))
    return path


def zero(pgno: int) -> Callable[[bytearray], None]:
    def do(data: bytearray) -> None:
        data[pgno * PAGE:(pgno + 1) * PAGE] = bytes(PAGE)
    return do


def swap(a: int, b: int) -> Callable[[bytearray], None]:
    def do(data: bytearray) -> None:
        pa, pb = data[a * PAGE:(a + 1) * PAGE], data[b * PAGE:(b + 1) * PAGE]
        data[a * PAGE:(a + 1) * PAGE], data[b * PAGE:(b + 1) * PAGE] = pb, pa
    return do


def node_out_of_page(pgno: int) -> Callable[[bytearray], None]:
    def do(data: bytearray) -> None:
        data[pgno * PAGE + 16:pgno * PAGE + 18] = (0xFFF0).to_bytes(2, "little")
    return do


def assert_reported(path: Path) -> None:
    """Every reader of the damaged journal reports it: no signal, no traceback."""
    got = subprocess.run([sys.executable, "-c", READ_ALL, str(path)], capture_output=True,
                         text=True, timeout=60)
    assert got.returncode == 4, (got.returncode, got.stdout, got.stderr)
    assert got.stdout.startswith("JournalCorrupt") and "damaged B-tree page" in got.stdout
    for command in (["runs"], ["runs", "--json"], ["stats"], ["show", "run-003"],
                    ["recover"]):
        out = subprocess.run([*CLI, "--journal", str(path), *command], capture_output=True,
                             text=True, timeout=60)
        assert out.returncode == 4, (command, out.returncode, out.stderr)
        assert len(out.stderr.strip().splitlines()) == 1 and "Traceback" not in out.stderr
        assert "damaged B-tree page" in out.stderr
    verify = subprocess.run([*CLI, "--journal", str(path), "verify"], capture_output=True,
                            text=True, timeout=60)
    assert verify.returncode == 1, (verify.returncode, verify.stderr)


def test_a_clean_journal_reads_whole(clean: Path, tmp_path: Path) -> None:
    path = damaged(clean, tmp_path, lambda data: None)
    got = subprocess.run([sys.executable, "-c", READ_ALL, str(path)], capture_output=True,
                         text=True, timeout=60)
    assert (got.returncode, got.stdout.strip()) == (0, "read"), got.stderr
    assert len(event_leaves(path)) >= 3
    assert got.stdout.strip() == "read"


def test_a_zeroed_leaf_page_is_reported_not_an_lmdb_assertion(
        clean: Path, tmp_path: Path) -> None:
    assert_reported(damaged(clean, tmp_path, zero(event_leaves(clean)[1])))


def test_a_zeroed_branch_page_is_reported(clean: Path, tmp_path: Path) -> None:
    assert_reported(damaged(clean, tmp_path, zero(events_tree(clean)[0])))


def test_two_swapped_pages_are_reported(clean: Path, tmp_path: Path) -> None:
    leaves = event_leaves(clean)
    assert_reported(damaged(clean, tmp_path, swap(leaves[0], leaves[-1])))


def test_a_node_pointing_out_of_the_last_page_is_reported_not_a_sigbus(
        clean: Path, tmp_path: Path) -> None:
    assert_reported(damaged(clean, tmp_path, node_out_of_page(event_leaves(clean)[-1])))


def flip_an_event(clean: Path) -> Callable[[bytearray], None]:
    """A flipped byte in a record of run-000 (in a live leaf of the events table)."""
    leaf = event_leaves(clean)[0]

    def do(data: bytearray) -> None:
        at = data.index(b"call.succeeded", leaf * PAGE, (leaf + 1) * PAGE)
        data[at + 2] ^= 0x01
    return do


def test_runs_lists_a_damaged_run_with_the_others_and_exits_non_zero(
        clean: Path, tmp_path: Path) -> None:
    path = damaged(clean, tmp_path, flip_an_event(clean))
    out = subprocess.run([*CLI, "--journal", str(path), "runs", "--all"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 4, out
    assert out.stderr.strip().splitlines() == [
        "boundloop: 1 damaged run listed (run-000); `boundloop verify` checks their "
        "records, `boundloop replay RUN_ID` how they follow"]
    rows = {line.split()[0]: line.split()[1] for line in out.stdout.splitlines()[2:]
            if line.startswith("run-")}
    assert len(rows) == 40 and rows.pop("run-000") == "damaged"
    assert set(rows.values()) == {"final"}
    as_json = subprocess.run([*CLI, "--journal", str(path), "runs", "--all", "--json"],
                             capture_output=True, text=True, timeout=60)
    assert as_json.returncode == 4
    listed = {r["run_id"]: r for r in json.loads(as_json.stdout)}
    assert len(listed) == 40 and listed["run-000"]["status"] == "damaged"
    assert "run-000" in listed["run-000"]["explanation"]
    assert listed["run-001"]["status"] == "final" and listed["run-001"]["tool_calls"] == 3


def test_stats_exits_non_zero_when_it_leaves_a_damaged_run_out(
        clean: Path, tmp_path: Path) -> None:
    path = damaged(clean, tmp_path, flip_an_event(clean))
    out = subprocess.run([*CLI, "--journal", str(path), "stats"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 4, out
    assert "left out 1 damaged run" in out.stdout
    as_json = subprocess.run([*CLI, "--journal", str(path), "stats", "--json"],
                             capture_output=True, text=True, timeout=60)
    assert as_json.returncode == 4
    assert json.loads(as_json.stdout)["damaged"] == ["run-000"]


def test_a_damaged_run_id_is_never_printed_with_control_codes() -> None:
    assert _names([b"run-1", b"bad\x1b[31m\nid", b"\xff"]) == \
        ["run-1", "bad\\x1b[31m\\x0aid", "\\xff"]


def test_a_commit_while_a_journal_opens_is_not_damage(tmp_path: Path) -> None:
    """Another process commits between the open's first look at the file and its snapshot:
    the tables' roots are checked against what that snapshot says, not what was before."""
    from boundloop.journal.lmdb import LmdbJournal

    path = tmp_path / "j"
    with bl.Runner(path):
        pass
    writer = ("import sys, boundloop as bl\n"
              "with bl.Runner(sys.argv[1], sync=False) as r:\n"
              "    for i in range(60):\n"
              "        r.run(model=bl.ScriptedModel([bl.Final('x' * 3000)]), tools=[],\n"
              "              prompt='p' * 3000)\n")
    journal = LmdbJournal(path, readonly=True)
    env = journal._env
    before = env.info()["last_pgno"]

    class CommitFirst:
        """The environment, with another process's commits landing right before each
        snapshot is taken."""

        def __getattr__(self, name: str) -> object:
            return getattr(env, name)

        def begin(self, *args: object, **kwargs: object) -> object:
            subprocess.run([sys.executable, "-c", writer, str(path)], check=True, timeout=60)
            return env.begin(*args, **kwargs)

    journal._env = CommitFirst()  # type: ignore[assignment]
    try:
        journal._check_roots()
        journal.walk_pages()
        assert env.info()["last_pgno"] > before + 20  # the tables did grow meanwhile
    finally:
        journal._env = env
        journal.close()
    with LmdbJournal(path, readonly=True) as again:
        assert len(list(again.runs())) == 60 * 2


def unfoldable(path: Path) -> Path:
    """A journal with a finished run `good`, an open run `open` of a runner long gone, and
    `z-bad` (its id sorts after `open`, so a reader meets it last): records intact (the
    chain holds) but not a run (the fold refuses an outcome that names no decided call:
    ReplayError)."""
    import threading

    from boundloop import events as ev
    from tests.journal_contract import admitted, step

    with bl.Runner(path, sync=False) as runner:
        assert runner.run(model=bl.ScriptedModel([bl.Final("ok")]), prompt="p",
                          run_id="good").status == "final"
        answers: list[BaseException | None] = []
        written = threading.Semaphore(0)

        def done(err: BaseException | None) -> None:
            answers.append(err)
            written.release()

        runner.journal.submit("open", 0, [admitted("open", owner="gone:1:x"),
                                          step("open", 1)], done)
        runner.journal.submit("z-bad", 0, [admitted("z-bad", owner="gone:2:y"),
                                           ev.CallSucceeded(run_id="z-bad", execution_id="nope",
                                                            attempt=1, content=None)], done)
        assert written.acquire(timeout=10) and written.acquire(timeout=10)
        assert answers == [None, None]
    return path


def owners_of(path: Path, run_id: str) -> list[str]:
    from boundloop import events as ev

    with bl.Runner(path) as runner:
        return [e.owner for e in runner.journal.events(run_id)
                if isinstance(e, ev.RunAdmitted | ev.OwnerClaimed)]


def test_a_run_whose_records_do_not_make_a_run_is_listed_damaged_and_hides_no_other(
        tmp_path: Path) -> None:
    """`runs` and `recover` report every other run and name the unfoldable one, exiting 4."""
    path = unfoldable(tmp_path / "j")
    out = subprocess.run([*CLI, "--journal", str(path), "runs", "--all", "--json"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 4, out
    listed = {r["run_id"]: r for r in json.loads(out.stdout)}
    assert {k: r["status"] for k, r in listed.items()} == {
        "good": "final", "open": "interrupted", "z-bad": "damaged"}
    assert "unknown execution 'nope'" in listed["z-bad"]["explanation"]
    assert "do not make a run" in listed["z-bad"]["explanation"]
    assert out.stderr.strip().splitlines() == [
        "boundloop: 1 damaged run listed (z-bad); `boundloop verify` checks their "
        "records, `boundloop replay RUN_ID` how they follow"]
    rec = subprocess.run([*CLI, "--journal", str(path), "recover", "--json"],
                         capture_output=True, text=True, timeout=60)
    assert rec.returncode == 4, rec
    assert [r["run_id"] for r in json.loads(rec.stdout)] == ["open"]
    assert "1 damaged open run left out (z-bad)" in rec.stderr
    assert owners_of(path, "open") == ["gone:1:x"]  # read-only: nothing was claimed


def test_recover_that_meets_an_unreadable_open_run_takes_over_nothing(tmp_path: Path) -> None:
    """runner.recover() raises naming the run before claiming any (a run claimed and never
    reported would be stranded); given ``damaged=``, it recovers every other run and names
    that one there, and `recover --claim` does so too and exits 4."""
    path = unfoldable(tmp_path / "j")
    with bl.Runner(path) as runner, pytest.raises(bl.BoundloopError, match="'z-bad'"):
        runner.recover()
    assert owners_of(path, "open") == ["gone:1:x"]
    out = subprocess.run([*CLI, "--journal", str(path), "recover", "--claim", "--json"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 4, out
    assert [r["run_id"] for r in json.loads(out.stdout)] == ["open"]
    assert out.stderr.strip().splitlines() == [
        "boundloop: 1 damaged open run left out (z-bad); `boundloop verify` checks their "
        "records, `boundloop replay RUN_ID` how they follow"]
    claimed = owners_of(path, "open")
    assert len(claimed) == 2 and claimed[0] == "gone:1:x"  # taken over, at epoch 2
    path2 = unfoldable(tmp_path / "j2")
    damaged: list[str] = []
    with bl.Runner(path2) as runner:
        got = runner.recover(damaged=damaged)
        assert [r.run_id for r in got] == ["open"] and damaged == ["z-bad"]
        assert owners_of_in(runner, "open")[-1] == runner.owner


def owners_of_in(runner: bl.Runner, run_id: str) -> list[str]:
    from boundloop import events as ev

    return [e.owner for e in runner.journal.events(run_id)
            if isinstance(e, ev.RunAdmitted | ev.OwnerClaimed)]
