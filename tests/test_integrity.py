"""Integrity of the LMDB journal (SPEC 6): a hash chain over each run's records, checked on
every read; LMDB's own metadata checked before mapping (no SIGBUS); a lock file removed
while in use is refused; ``boundloop verify``.

The corruption sweeps flip bits of a real journal's ``data.mdb`` one at a time and, after
each flip, read everything back in a worker subprocess (this file run as a script), so that a
crash inside LMDB is counted rather than taking the test down with it.
"""

from __future__ import annotations

import json
import os
import queue
import random
import subprocess
import sys
import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lmdb
import msgspec
import pytest

import boundloop as bl
from boundloop import events as ev
from boundloop.journal import chain, codec
from boundloop.journal.lmdb import LmdbJournal

CLI = [sys.executable, "-m", "boundloop"]


@bl.tool(idempotent=True)
def transfer(amount: int, to: str) -> str:
    """Move money."""
    return "ok"


def _model() -> bl.ScriptedModel:
    return bl.ScriptedModel([bl.CallTools([bl.ToolCall("c1", "transfer",
                                                       {"amount": 7, "to": "bob"})]),
                             bl.Final("done")])


def build(path: Path, runs: int = 3) -> list[str]:
    """A journal of ``runs`` finished runs, each one call of ``transfer``; their ids."""
    ids = []
    with bl.Runner(path, sync=False) as runner:
        for n in range(runs):
            result = runner.run(_model(), [transfer], "pay bob", run_id=f"run-{n}",
                                budget=bl.Budget(max_model_steps=5, max_tool_calls=5))
            assert result.status == "final"
            ids.append(result.run_id)
    return ids


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    path = tmp_path_factory.mktemp("pristine") / "journal"
    return path, build(path)


@pytest.fixture
def journal(pristine: tuple[Path, list[str]], tmp_path: Path) -> tuple[Path, list[str]]:
    """A private copy of the pristine journal."""
    src, ids = pristine
    dst = tmp_path / "journal"
    dst.mkdir(mode=0o700)
    for name in ("data.mdb", "lock.mdb"):
        (dst / name).write_bytes((src / name).read_bytes())
    return dst, ids


def raw_env(path: Path, write: bool = False) -> Any:
    return lmdb.open(str(path), max_dbs=8, readonly=not write, lock=write, subdir=True)


def records(path: Path, run_id: str) -> list[tuple[bytes, bytes]]:
    """The run's stored (key, value) pairs, as LMDB holds them."""
    env = raw_env(path)
    try:
        db = env.open_db(b"events", create=False)
        with env.begin() as txn:
            prefix = run_id.encode() + b"\x00"
            return [(k, v) for k, v in txn.cursor(db=db) if k.startswith(prefix)]
    finally:
        env.close()


def index_entry(path: Path, run_id: str) -> bytes:
    env = raw_env(path)
    try:
        db = env.open_db(b"runs", create=False)
        with env.begin() as txn:
            value = txn.get(run_id.encode(), db=db)
            assert value is not None
            return bytes(value)
    finally:
        env.close()


def cli(*args: str, journal: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, "--journal", str(journal), *args], capture_output=True,
                          text=True, timeout=60)


# -- the chain, as stored ------------------------------------------------------------------
def test_each_record_is_its_link_then_its_event_and_the_head_is_in_the_index(
        journal: tuple[Path, list[str]]) -> None:
    path, ids = journal
    stored_of = {r: records(path, r) for r in ids}
    with LmdbJournal(path, readonly=True) as j:
        for run_id in ids:
            prev = chain.seed(run_id)
            stored = stored_of[run_id]
            events = [e for _, e in j.read(run_id)]
            assert len(stored) == len(events) == j.info(run_id).last_seq
            for (_, value), event in zip(stored, events, strict=True):
                body = value[chain.LINK_SIZE:]
                assert body == codec.encode(event)
                assert value[:chain.LINK_SIZE] == chain.link(prev, body)
                prev = value[:chain.LINK_SIZE]
            assert j.chain_head(run_id) == prev
            assert j.stored_head(run_id) == prev
        assert j.chain_head(ids[0]) != j.chain_head(ids[1])  # seeded by the run id


def test_verify_prints_each_run_and_its_head(journal: tuple[Path, list[str]]) -> None:
    path, ids = journal
    with LmdbJournal(path, readonly=True) as j:
        heads = {r: j.chain_head(r).hex() for r in ids}
    done = cli("verify", journal=path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [f"{r}  {heads[r]}  ok" for r in ids] + [
        f"verified {len(ids)} runs: 0 damaged, {len(ids)} ok"]
    as_json = json.loads(cli("verify", "--json", journal=path).stdout)
    assert as_json == [{"run_id": r, "head": heads[r], "ok": True, "error": None} for r in ids]
    one = cli("verify", ids[1], journal=path)
    assert one.returncode == 0 and one.stdout.splitlines() == [
        f"{ids[1]}  {heads[ids[1]]}  ok", "verified 1 run: 0 damaged, 1 ok"]
    assert cli("verify", "nope", journal=path).returncode == 3


def test_verify_warns_of_a_key_file_in_the_journal_directory(
        journal: tuple[Path, list[str]]) -> None:
    path, _ = journal
    (path / "redaction.key").write_bytes(os.urandom(32))
    done = cli("verify", journal=path)
    assert done.returncode == 0
    assert "warning" in done.stderr and "redaction.key" in done.stderr
    assert len(done.stderr.splitlines()) == 1


# -- targeted damage -----------------------------------------------------------------------
def _patch(path: Path, old: bytes, new: bytes) -> int:
    """Replace every occurrence of ``old`` in data.mdb (live or stale pages); how many."""
    data = path / "data.mdb"
    raw = data.read_bytes()
    data.write_bytes(raw.replace(old, new))
    return raw.count(old)


@pytest.mark.parametrize(("old", "new"), [
    (b"\xa6amount\x07", b"\xa6amount\x08"),       # the amount 7 -> 8
    (b"\xa5allow", b"\xa5allox"),                 # the policy decision
    (b"\xa8transfer", b"\xa8transfur"),           # the tool name
    (b"\xa6status\xa2ok", b"\xa6status\xa2ko"),   # the outcome
    (b"\xa4done", b"\xa4dune"),                   # the final text
])
def test_a_patched_event_is_refused_naming_the_run_and_seq(
        journal: tuple[Path, list[str]], old: bytes, new: bytes) -> None:
    path, ids = journal
    with LmdbJournal(path, readonly=True) as j:
        before = {r: list(j.read(r)) for r in ids}
    assert _patch(path, old, new) >= len(ids)
    seqs = {}
    with LmdbJournal(path, readonly=True) as j:
        for run_id in ids:
            with pytest.raises(chain.ChainError) as caught:
                list(j.read(run_id))
            assert caught.value.run_id == run_id and 1 <= caught.value.seq <= len(before[run_id])
            assert f"run {run_id!r}, seq {caught.value.seq}" in str(caught.value)
            seqs[run_id] = caught.value.seq
            with pytest.raises(bl.JournalCorrupt):
                bl.replay(j.events(run_id))
    done = cli("verify", journal=path)
    assert done.returncode == 1
    for run_id in ids:
        assert f"{run_id}  " in done.stdout
        assert f"DAMAGED seq {seqs[run_id]}:" in done.stdout
    assert done.stderr.strip().endswith(", ".join(ids))
    for command in (["show", ids[0]], ["replay", ids[0]], ["export", ids[0]]):
        shown = cli(*command, journal=path)
        assert shown.returncode == 4, shown
        assert len(shown.stderr.splitlines()) == 1 and f"seq {seqs[ids[0]]}" in shown.stderr


def _rewrite(path: Path, fn: Any) -> None:
    env = raw_env(path, write=True)
    try:
        dbs = {n: env.open_db(n.encode()) for n in ("events", "runs", "order", "open", "meta")}
        with env.begin(write=True) as txn:
            fn(txn, dbs)
    finally:
        env.close()


def _key(run_id: str, seq: int) -> bytes:
    return run_id.encode() + b"\x00" + seq.to_bytes(8, "big")


def test_a_removed_last_record_is_caught_by_the_head(journal: tuple[Path, list[str]]) -> None:
    path, ids = journal
    last = len(records(path, ids[0]))
    _rewrite(path, lambda txn, dbs: txn.delete(_key(ids[0], last), db=dbs["events"]))
    with LmdbJournal(path, readonly=True) as j, pytest.raises(chain.ChainError) as caught:
        list(j.read(ids[0]))
    assert (caught.value.run_id, caught.value.seq) == (ids[0], last)
    assert "missing" in str(caught.value)


def test_a_gap_a_moved_record_and_a_swapped_record_are_caught(
        journal: tuple[Path, list[str]]) -> None:
    path, ids = journal
    a, b, c = ids
    recs = {r: records(path, r) for r in ids}

    def damage(txn: Any, dbs: dict[str, Any]) -> None:
        txn.delete(_key(a, 3), db=dbs["events"])                   # a gap in run a
        txn.put(_key(b, 4), recs[c][3][1], db=dbs["events"])       # run c's record in run b
        txn.put(_key(c, 2), recs[c][4][1], db=dbs["events"])       # swapped within run c
        txn.put(_key(c, 5), recs[c][1][1], db=dbs["events"])

    _rewrite(path, damage)
    with LmdbJournal(path, readonly=True) as j:
        for run_id, seq in ((a, 3), (b, 4), (c, 2)):
            with pytest.raises(chain.ChainError) as caught:
                list(j.read(run_id))
            assert (caught.value.run_id, caught.value.seq) == (run_id, seq)
        for after in (2, 3):  # a read from before the gap, or from the missing record
            with pytest.raises(chain.ChainError, match="seq 3"):
                list(j.read(a, after=after))
        assert [s for s, _ in j.read(a, after=4)] == list(range(5, len(recs[a]) + 1))


@pytest.mark.parametrize("forged", [
    msgspec.msgpack.encode({"type": "model.started", "step": "not a number"}),
    b"\xc1\x01\x00" + b"not a zstd frame at all",  # compressed: does not decompress
    b"\xc1\x01\x00" + codec._compressor().compress(msgspec.msgpack.encode([1, 2, 3])),
])  # ... and decompresses to something that is not an event
def test_a_record_that_does_not_decode_is_corrupt_even_with_a_valid_chain(
        journal: tuple[Path, list[str]], forged: bytes) -> None:
    """A msgspec ValidationError (valid msgpack, not an event) or a compressed body that does
    not decompress to an event is JournalCorrupt, never raw."""
    path, ids = journal
    run_id = ids[0]
    recs = records(path, run_id)
    bodies = [v[chain.LINK_SIZE:] for _, v in recs]
    bodies[1] = forged
    prev = chain.seed(run_id)
    values = []
    for body in bodies:
        values.append(chain.seal(prev, body))
        prev = values[-1][:chain.LINK_SIZE]
    with LmdbJournal(path, readonly=True) as j:
        info = j.info(run_id)
    info = msgspec.structs.replace(info, head=prev)  # type: ignore[type-var]

    def damage(txn: Any, dbs: dict[str, Any]) -> None:
        for (key, _), value in zip(recs, values, strict=True):
            txn.put(key, value, db=dbs["events"])
        txn.put(run_id.encode(), chain.checksum(msgspec.msgpack.encode(info)), db=dbs["runs"])

    _rewrite(path, damage)
    with LmdbJournal(path, readonly=True) as j, pytest.raises(chain.ChainError) as caught:
        list(j.read(run_id))
    assert (caught.value.run_id, caught.value.seq) == (run_id, 2)
    assert "does not decode" in str(caught.value)
    shown = cli("show", run_id, journal=path)
    assert shown.returncode == 4 and len(shown.stderr.splitlines()) == 1


def test_a_damaged_index_entry_is_refused(journal: tuple[Path, list[str]]) -> None:
    path, ids = journal
    entry = index_entry(path, ids[1])
    damaged = entry[:-3] + bytes([entry[-3] ^ 0x01]) + entry[-2:]
    _rewrite(path, lambda txn, dbs: txn.put(ids[1].encode(), damaged, db=dbs["runs"]))
    with LmdbJournal(path, readonly=True) as j:
        for op in (lambda: j.find(ids[1]), lambda: list(j.read(ids[1])), j.infos, j.runs):
            with pytest.raises(bl.JournalCorrupt, match="index entry"):
                op()
        assert len(list(j.read(ids[0]))) > 0  # the other runs still read
    done = cli("verify", journal=path)
    assert done.returncode == 1
    assert f"{ids[1]}  -  DAMAGED" in done.stdout and f"{ids[0]}  " in done.stdout


def _events_root(path: Path) -> tuple[int, int]:
    """The page number and depth of the events table's B-tree root."""
    env = raw_env(path)
    try:
        with env.begin() as txn:
            record = txn.get(b"events")
    finally:
        env.close()
    assert record is not None and len(record) == 48
    return int.from_bytes(record[40:48], "little"), int.from_bytes(record[6:8], "little")


def _node(raw: bytearray, page: int, n: int) -> int:
    """The offset in the file of node ``n`` of page ``page``."""
    at = page * 4096 + 16 + 2 * n
    return page * 4096 + int.from_bytes(raw[at:at + 2], "little")


def _children(raw: bytearray, page: int) -> list[int]:
    """The offsets of the nodes of page ``page``."""
    lower = int.from_bytes(raw[page * 4096 + 12:page * 4096 + 14], "little")
    return [_node(raw, page, n) for n in range((lower - 16) // 2)]


def _point_children_at(pgno: Any, which: slice = slice(None)) -> Any:
    def damage(raw: bytearray, root: int) -> None:
        last = len(raw) // 4096 - 1
        for node in _children(raw, root)[which]:  # child pointers of the root branch page
            raw[node:node + 6] = pgno(last).to_bytes(6, "little")
    return damage


def _huge_overflow(raw: bytearray, root: int) -> None:
    """The first record of the first leaf: a 64 MB value on an "overflow page" 2."""
    leaf = int.from_bytes(raw[_children(raw, root)[0]:][:6], "little")
    node = _children(raw, leaf)[0]
    ksize = int.from_bytes(raw[node + 6:node + 8], "little")
    raw[node:node + 6] = (64 << 20).to_bytes(4, "little") + b"\x01\x00"  # F_BIGDATA
    raw[node + 8 + ksize:node + 16 + ksize] = (2).to_bytes(8, "little")


@pytest.mark.parametrize(("damage", "outcome"), [
    (_point_children_at(lambda last: last + 50), "PageNotFoundError"),  # LMDB checks that
    (_point_children_at(lambda last: 0), "CorruptedError"),  # and a meta page, going down
    (_point_children_at(lambda last: 0, slice(1, 2)), "crashed reading it (SIGABRT)"),
    (_huge_overflow, "crashed reading it (SIGBUS)"),  # a value running past the file
])
def test_verify_reports_damage_to_lmdbs_own_pages(journal: tuple[Path, list[str]],
                                                  damage: Any, outcome: str) -> None:
    """LMDB keeps no checksums of its B-tree pages. It refuses a child page past its last
    one, but a damaged child pointer to a page of the wrong kind fails one of its
    assertions (an abort), and a damaged value size reads past the end of the file (a
    SIGBUS), in any process that reads the run through LMDB unchecked. ``boundloop verify``
    reads in a child process, so it reports each run it could not read (and the damaged
    page its walk found), and exits 1; every other reader walks the pages first."""
    path, ids = journal
    root, depth = _events_root(path)
    assert depth >= 2  # the root is a branch page
    data = path / "data.mdb"
    raw = bytearray(data.read_bytes())
    damage(raw, root)
    data.write_bytes(bytes(raw))
    done = cli("verify", journal=path)
    assert done.returncode == 1, (done.returncode, done.stderr)
    damaged = [line for line in done.stdout.splitlines() if "DAMAGED" in line]
    assert any(outcome in line for line in damaged), done.stdout
    hit = [line.split()[0] for line in damaged if outcome in line and line.split()[0] in ids]
    assert hit, done.stdout
    if "crashed" in outcome:
        reading = subprocess.run([sys.executable, "-c", "import sys, boundloop as bl\n"
                                  "j = bl.journal.LmdbJournal(sys.argv[1], readonly=True)\n"
                                  "list(j.read(sys.argv[2]))", str(path), hit[0]],
                                 capture_output=True, text=True, timeout=60)
        # Any other reader walks the pages when it opens the journal: damage, not a crash.
        assert reading.returncode == 1, reading
        assert "JournalCorrupt" in reading.stderr and "damaged B-tree page" in reading.stderr
    assert any(line.startswith("(pages)") and "damaged B-tree page" in line
               for line in damaged), done.stdout


# -- format version ------------------------------------------------------------------------
def test_a_journal_without_the_chain_format_is_refused_with_what_to_do(
        journal: tuple[Path, list[str]]) -> None:
    path, ids = journal
    _rewrite(path, lambda txn, dbs: txn.delete(b"format", db=dbs["meta"]))
    for readonly in (True, False):
        with pytest.raises(bl.JournalUnavailable, match="older boundloop.*format 1.*export"):
            LmdbJournal(path, readonly=readonly)
    done = cli("runs", journal=path)
    assert done.returncode == 4 and "older boundloop" in done.stderr
    _rewrite(path, lambda txn, dbs: txn.put(b"format", (4).to_bytes(4, "big"),
                                            db=dbs["meta"]))
    for readonly in (True, False):
        with pytest.raises(bl.JournalUnavailable, match="format 4.*upgrade boundloop"):
            LmdbJournal(path, readonly=readonly)


def test_a_new_journal_is_stamped_with_the_format(tmp_path: Path) -> None:
    with LmdbJournal(tmp_path / "j"):
        pass
    env = raw_env(tmp_path / "j")
    try:
        with env.begin() as txn:
            fmt = txn.get(b"format", db=env.open_db(b"meta", txn=txn, create=False))
        assert fmt == chain.FORMAT.to_bytes(4, "big")
    finally:
        env.close()


# -- truncation: never a SIGBUS ------------------------------------------------------------
def _last_live_page(path: Path) -> int:
    """The highest page LMDB's current snapshot uses (the rest up to its last are free)."""
    from boundloop.journal.lmdb._pages import _META, _free_pages

    data = path / "data.mdb"
    with open(data, "rb") as f:
        metas = [_META.unpack(f.read(4096)[:_META.size]), _META.unpack(f.read(4096)[:_META.size])]
        current = max(metas, key=lambda m: m[6])
        pages = data.stat().st_size // 4096
        free = _free_pages(f.fileno(), 4096, current[3], pages)
    assert free is not None
    return max(pg for pg in range(2, current[5] + 1) if pg not in free)


@pytest.mark.parametrize("cut", ["8k", "half", "minus4k", "last-live", "zero"])
def test_a_truncated_data_file_is_an_error_not_a_sigbus(journal: tuple[Path, list[str]],
                                                        cut: str) -> None:
    """A file shorter than its own metadata says is refused before LMDB maps it. LMDB itself
    leaves pages a transaction allocated and freed again unwritten, even at the end of the
    file, so a file whose missing tail is free pages only is whole: it is read as it is."""
    path, ids = journal
    with LmdbJournal(path, readonly=True) as j:
        original = {r: list(j.read(r)) for r in ids}
    data = path / "data.mdb"
    size = data.stat().st_size
    live = _last_live_page(path)
    length = {"8k": 8192, "half": size // 2, "minus4k": size - 4096, "zero": 0,
              "last-live": live * 4096 + 2048}[cut]
    os.truncate(data, length)
    intact = cut == "minus4k" and live < length // 4096
    for command in (["runs"], ["show", ids[0]], ["verify"], ["replay", ids[0]]):
        done = cli(*command, journal=path)
        assert done.returncode >= 0  # never a signal
        if intact:
            assert done.returncode == 0, (command, done.returncode, done.stderr)
            continue
        assert done.returncode == 4, (command, done.returncode, done.stderr)
        assert len(done.stderr.splitlines()) == 1 and "data.mdb" in done.stderr, done.stderr
        assert done.stdout == ""
    if intact:
        with LmdbJournal(path, readonly=True) as j:
            assert {r: list(j.read(r)) for r in ids} == original
    else:
        with pytest.raises(bl.JournalCorrupt, match="data.mdb"):
            bl.Runner(path)
        with pytest.raises(bl.JournalCorrupt):
            LmdbJournal(path, readonly=True)
    assert data.stat().st_size == length  # nothing was written


def test_a_damaged_meta_page_root_is_refused_before_mapping(
        journal: tuple[Path, list[str]]) -> None:
    path, _ = journal
    data = path / "data.mdb"
    raw = bytearray(data.read_bytes())
    for page in (0, 4096):  # both meta pages: the main B-tree root far past the file
        raw[page + 128:page + 136] = (1 << 40).to_bytes(8, "little")
    data.write_bytes(bytes(raw))
    with pytest.raises(bl.JournalCorrupt, match="B-tree root"):
        LmdbJournal(path, readonly=True)
    done = cli("runs", journal=path)
    assert done.returncode == 4 and len(done.stderr.splitlines()) == 1


# -- the lock file -------------------------------------------------------------------------
@pytest.mark.parametrize("how", ["removed", "replaced"])
def test_a_lock_file_removed_while_in_use_fails_closed(tmp_path: Path, how: str) -> None:
    path = tmp_path / "journal"
    lock = path / "lock.mdb"

    @bl.tool(idempotent=True)
    def transfer(amount: int, to: str) -> str:
        """Moves money, and removes the journal's lock file (as a careless cleanup might)."""
        lock.unlink()
        if how == "replaced":
            lock.write_bytes(b"\0" * 8192)
        return "ok"

    with bl.Runner(path) as runner:
        result = runner.run(_model(), [transfer], "pay bob", run_id="victim",
                            budget=bl.Budget(max_model_steps=5, max_tool_calls=5))
        assert result.status == "journal_unavailable", result.explanation
        assert "was removed or replaced while the journal was open" in result.explanation
        with pytest.raises(bl.JournalUnavailable, match="stop every runner"):
            runner.journal.append("other", 0, [ev.RunResumed(run_id="other")])
        acked = list(runner.journal.read("victim"))  # reads still work
    assert [type(e).__name__ for _, e in acked][-1] == "CallDispatched"
    if how == "replaced":
        lock.unlink()
    with LmdbJournal(path, readonly=True) as j:  # everything acknowledged is there, intact
        assert list(j.read("victim")) == acked
        assert j.find("other") is None
    assert cli("verify", journal=path).returncode == 0


#: A runner in a process of its own: one run, then it holds the journal open until told
#: (a line on stdin) to try another run; it prints each run's status.
HOLDER = """
import sys
import boundloop as bl
sys.path.insert(0, sys.argv[2])
from test_integrity import _model, transfer
with bl.Runner(sys.argv[1]) as runner:
    for run_id in ("first-0", "first-1"):
        result = runner.run(_model(), [transfer], "pay bob", run_id=run_id,
                            budget=bl.Budget(max_model_steps=5, max_tool_calls=5))
        print(result.status, result.explanation, flush=True)
        sys.stdin.readline()
"""

#: A second runner, in another process: it must be refused at open, writing nothing.
SECOND_RUNNER = """
import sys
import boundloop as bl
sys.path.insert(0, sys.argv[2])
from test_integrity import _model, transfer
try:
    runner = bl.Runner(sys.argv[1])
except bl.JournalError as exc:
    print("refused", type(exc).__name__, exc)
    sys.exit(0)
with runner:
    result = runner.run(_model(), [transfer], "pay bob", run_id="second-0",
                        budget=bl.Budget(max_model_steps=5, max_tool_calls=5))
print("opened", result.status)
"""


def _digest(path: Path) -> str:
    import hashlib
    return hashlib.sha256((path / "data.mdb").read_bytes()).hexdigest()


@pytest.mark.parametrize("how", ["removed", "replaced"])
def test_a_second_runner_after_the_lock_file_was_removed_is_refused(tmp_path: Path,
                                                                    how: str) -> None:
    """The issue's scenario, with real processes: lock.mdb deleted (or replaced) under a
    live runner, and another process opens a Runner on the journal, making a new lock
    file. Its writers and the first's would not exclude each other (SPEC 6: such a journal
    "is refused, not written"): the second is refused at open with a JournalError saying
    why, and writes nothing; the first refuses to write from then on too."""
    path = tmp_path / "journal"
    here = str(Path(__file__).parent)
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(path), here],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdin is not None
        assert holder.stdout.readline().split()[0] == "final"
        (path / "lock.mdb").unlink()
        if how == "replaced":
            (path / "lock.mdb").write_bytes(b"\0" * 8192)
        before = _digest(path)
        second = subprocess.run([sys.executable, "-c", SECOND_RUNNER, str(path), here],
                                capture_output=True, text=True, timeout=120)
        assert second.returncode == 0, second.stderr
        assert second.stdout.startswith("refused JournalUnavailable"), second.stdout
        assert "lock.mdb" in second.stdout and "removed or replaced" in second.stdout
        assert _digest(path) == before  # the refused runner wrote nothing
        holder.stdin.write("\n")
        holder.stdin.flush()
        refused = holder.stdout.readline()
        assert refused.startswith("journal_unavailable") and "removed or replaced" in refused
        holder.stdin.write("\n")
        holder.stdin.close()
        assert holder.wait(timeout=60) == 0
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()
    # Once the first runner is gone, the journal opens again and everything it
    # acknowledged is there, intact.
    with LmdbJournal(path, readonly=True) as j:
        assert sorted(j.runs()) == ["first-0"]
        assert bl.replay(j.events("first-0")).status == "final"
    assert cli("verify", journal=path).returncode == 0
    second = subprocess.run([sys.executable, "-c", SECOND_RUNNER, str(path), here],
                            capture_output=True, text=True, timeout=120)
    assert second.stdout.startswith("opened final"), second.stdout + second.stderr


def test_runners_of_one_lock_file_are_not_refused(tmp_path: Path) -> None:
    """The check at open refuses a lock file other than the one in use, never a second
    process sharing the same lock file."""
    path = tmp_path / "journal"
    here = str(Path(__file__).parent)
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(path), here],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdin is not None
        assert holder.stdout.readline().split()[0] == "final"
        second = subprocess.run([sys.executable, "-c", SECOND_RUNNER, str(path), here],
                                capture_output=True, text=True, timeout=120)
        assert second.stdout.startswith("opened final"), second.stdout + second.stderr
        holder.stdin.write("\n\n")
        holder.stdin.close()
        assert holder.stdout.readline().startswith("final")
        assert holder.wait(timeout=60) == 0
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()


# -- file modes ------------------------------------------------------------------------------
def test_export_output_is_0600_whatever_the_umask(journal: tuple[Path, list[str]],
                                                  tmp_path: Path) -> None:
    path, ids = journal
    out = tmp_path / "out.jsonl"
    old = os.umask(0)
    try:
        done = subprocess.run([*CLI, "--journal", str(path), "export", ids[0], "-o", str(out)],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        assert out.stat().st_mode & 0o777 == 0o600
        out.chmod(0o666)  # an existing file is made private too
        assert cli("export", ids[0], "-o", str(out), journal=path).returncode == 0
        assert out.stat().st_mode & 0o777 == 0o600
        link = tmp_path / "link.jsonl"
        link.symlink_to(tmp_path / "elsewhere")
        refused = cli("export", ids[0], "-o", str(link), journal=path)
        assert refused.returncode == 2 and "symbolic link" in refused.stderr
        assert not (tmp_path / "elsewhere").exists()
    finally:
        os.umask(old)


def test_missing_parents_of_a_new_journal_are_0700(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        with LmdbJournal(tmp_path / "a" / "b" / "journal"):
            pass
    finally:
        os.umask(old)
    for d in (tmp_path / "a", tmp_path / "a" / "b", tmp_path / "a" / "b" / "journal"):
        assert d.stat().st_mode & 0o777 == 0o700, d


# -- the corruption sweeps -----------------------------------------------------------------
def _snapshot(j: LmdbJournal, ids: list[str]) -> Iterator[tuple[str, Any]]:
    """Every read there is, one at a time: (what, result as builtins)."""
    yield "runs", lambda: list(j.runs())
    yield "open_runs", lambda: sorted(j.open_runs())
    yield "infos", lambda: msgspec.to_builtins(j.infos())
    yield "owners", lambda: msgspec.to_builtins(j.owners())
    for run_id in ids:
        yield f"find {run_id}", lambda r=run_id: msgspec.to_builtins(j.find(r))
        yield f"read {run_id}", lambda r=run_id: msgspec.to_builtins(list(j.read(r)))
        yield f"read-after {run_id}", lambda r=run_id: msgspec.to_builtins(list(j.read(r, 5)))
        yield f"replay {run_id}", lambda r=run_id: msgspec.to_builtins(bl.replay(j.events(r)))


def _trial(path: Path, ids: list[str], original: dict[str, Any] | None) -> tuple[str, Any]:
    """One look at the journal: ("same" | "detected" | "silent: what" | "raw: type", reads)."""
    got: dict[str, Any] = {}
    detected = False
    try:
        j = LmdbJournal(path, readonly=True)
    except bl.JournalError:
        return "detected", got
    except Exception as exc:  # noqa: BLE001 - counted: the sweep wants none
        return f"raw: open {type(exc).__name__}: {exc}", got
    try:
        for what, read in _snapshot(j, ids):
            try:
                got[what] = read()
            except bl.JournalError:
                detected = True
                continue
            except Exception as exc:  # noqa: BLE001
                return f"raw: {what} {type(exc).__name__}: {exc}", got
            if original is not None and got[what] != original[what]:
                return f"silent: {what}", got
    finally:
        j.close()
    return ("detected" if detected else "same"), got


def worker(path: Path, ids: list[str], flips: list[list[int]], start: int) -> None:
    """Apply each flip in turn, look, undo it; print ``index outcome`` per flip."""
    outcome, original = _trial(path, ids, None)
    assert outcome == "same", outcome
    fd = os.open(path / "data.mdb", os.O_RDWR)
    for i in range(start, len(flips)):
        offset, mask = flips[i]
        byte = os.pread(fd, 1, offset)
        os.pwrite(fd, bytes([byte[0] ^ mask]), offset)
        try:
            outcome, _ = _trial(path, ids, original)
        finally:
            os.pwrite(fd, byte, offset)
        print(i, outcome, flush=True)


def _pump(out: Any, lines: queue.Queue[str | None]) -> None:
    for line in out:
        lines.put(line)
    lines.put(None)


def sweep(path: Path, ids: list[str], flips: list[list[int]]) -> dict[int, str]:
    """Outcome of each flip, from worker subprocesses (a new one after each crash)."""
    pristine = (path / "data.mdb").read_bytes()
    results: dict[int, str] = {}
    i = 0
    while i < len(flips):
        proc = subprocess.Popen(
            [sys.executable, __file__, str(path), json.dumps(ids), str(i)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(json.dumps(flips))
        proc.stdin.close()
        lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=_pump, args=(proc.stdout, lines), daemon=True).start()
        hung = False
        while True:
            try:
                line = lines.get(timeout=30)
            except queue.Empty:
                proc.kill()
                hung = True
                break
            if line is None:
                break
            index, outcome = line.rstrip("\n").split(" ", 1)
            results[int(index)] = outcome
            i = int(index) + 1
        rc = proc.wait()
        if i < len(flips):  # the worker died on flip i, with it applied: undo it here
            err = proc.stderr.read() if proc.stderr else ""
            results[i] = "hang" if hung else (f"crash: signal {-rc}" if rc < 0 else
                                              f"crash: exit {rc}: {err.strip()[-300:]}")
            offset = flips[i][0]
            with open(path / "data.mdb", "r+b") as f:
                f.seek(offset)
                f.write(pristine[offset:offset + 1])
            i += 1
    assert (path / "data.mdb").read_bytes() == pristine
    return results


def _summary(results: dict[int, str]) -> Counter[str]:
    return Counter(r.split(":")[0] for r in results.values())


def test_sweep_every_bit_of_one_runs_records_is_caught(journal: tuple[Path, list[str]]) -> None:
    """Each byte of one run's stored records and of its index entry, in turn: after each
    flip every read returns the original or raises JournalCorrupt. No silent change, no
    crash. LMDB copies pages on write, so a value also lies in stale copies on free pages;
    one flip in each copy finds the copies LMDB reads (a flip there is caught), and every
    byte of those is then flipped."""
    path, ids = journal
    target = ids[1]
    values = [v for _, v in records(path, target)] + [index_entry(path, target)]
    data = (path / "data.mdb").read_bytes()
    copies: list[tuple[int, int]] = []
    for value in values:
        at = data.find(value)
        assert at >= 0
        while at >= 0:
            copies.append((at, len(value)))
            at = data.find(value, at + 1)
    probes = sweep(path, ids, [[at + size // 2, 0x10] for at, size in copies])
    live = [copies[i] for i, r in probes.items() if r == "detected"]
    assert {r.split(":")[0] for r in probes.values()} <= {"same", "detected"}, probes
    assert sum(size for _, size in live) == sum(len(v) for v in values)  # one copy each
    flips = [[o, 1 << (o % 8)] for at, size in live for o in range(at, at + size)]
    results = sweep(path, ids, flips)
    counts = _summary(results)
    print(f"\nvalue sweep of run {target!r}: {len(flips)} flips in {len(live)} records "
          f"(and {len(copies)} probes of their copies): {dict(counts)}")
    missed = {flips[i][0]: r for i, r in results.items() if r != "detected"}
    assert not missed, dict(list(missed.items())[:20])


def test_sweep_a_sample_of_the_whole_file(journal: tuple[Path, list[str]]) -> None:
    """600 seeded positions across the whole file, LMDB's own B-tree pages and meta pages
    included. LMDB keeps no page checksums, so a flip in its structure can make LMDB itself
    fail; such crashes are counted and printed. No read may return altered data."""
    path, ids = journal
    size = (path / "data.mdb").stat().st_size
    rng = random.Random(20240601)
    flips = [[o, 1 << rng.randrange(8)] for o in sorted(rng.sample(range(size), 600))]
    results = sweep(path, ids, flips)
    counts = _summary(results)
    crashes = {flips[i][0]: r for i, r in results.items() if r.startswith(("crash", "hang"))}
    print(f"\nwhole-file sweep: {len(flips)} flips of {size} bytes: {dict(counts)}; "
          f"crashes at {crashes}")
    silent = {flips[i][0]: r for i, r in results.items() if r.startswith(("silent", "raw"))}
    assert not silent, silent


if __name__ == "__main__":
    worker(Path(sys.argv[1]), json.loads(sys.argv[2]), json.loads(sys.stdin.read()),
           int(sys.argv[3]))
