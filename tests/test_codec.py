"""Compressed journal records (``codec.pack``, record format 3): what they store, what reads
them back, and what a damaged one is."""

from __future__ import annotations

import hashlib
import subprocess
import sys
import threading
import typing
from pathlib import Path

import lmdb
import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from journal_contract import several
from raw_journal import event_pages, stored_bodies, stored_format

import boundloop as bl
from boundloop import events as ev
from boundloop.errors import JournalCorrupt
from boundloop.journal import LmdbJournal, _dictionary, chain, codec
from boundloop.journal import lmdb as lmdb_journal

sys.path.insert(0, str(Path(__file__).resolve().parent / "golden"))
import make_dictionary  # noqa: E402

RID = "019a0c4e5b7d7e3f8c2a1b4d6e8f0a1c"


def test_the_dictionary_never_changes() -> None:
    # Records written with dictionary 1 must decode forever: a new dictionary gets a new id.
    assert hashlib.blake2b(_dictionary.V1, digest_size=32).hexdigest() == (
        "f15b914dd5963465db77d23b1564410e50ef4680502f99c7e6a066e0cb58a278")
    assert codec.DICTIONARY_ID == 1


def test_every_kind_of_event_packs_smaller_and_reads_back() -> None:
    # The contract suite's events, not the dictionary's own: other values, other run ids.
    events = [*several(RID), *make_dictionary.events()]
    assert {type(e) for e in events} == set(typing.get_args(ev.AnyEvent))
    for event in events:
        plain, packed = codec.encode(event), codec.pack(event, event.run_id)
        assert packed[:2] == b"\xc1\x01" and len(packed) < len(plain), type(event)
        assert codec.decode(packed, event.run_id) == event
        assert codec.plain(packed, event.run_id) == plain
        assert codec.decode(plain, event.run_id) == event  # plain bodies read as they were
        assert codec.decode(plain) == event
    ours = several(RID)
    assert sum(len(codec.pack(e, RID)) for e in ours) < 0.5 * sum(map(len, map(codec.encode,
                                                                                ours)))


def test_the_run_id_is_cut_out_and_put_back_wherever_it_occurs() -> None:
    event = ev.CallSucceeded(run_id=RID, execution_id=f"{RID}:1:0", attempt=1,
                             content={RID: RID + RID, "x": f"a{RID}b"})
    packed = codec.pack(event, event.run_id)
    assert packed[2] == 6  # the field, the execution id, the key and three in the value
    assert RID.encode() not in packed
    assert codec.decode(packed, RID) == event
    with pytest.raises(JournalCorrupt, match="without one"):
        codec.decode(packed, "")
    # Read as another run's record, it is not that run's event.
    assert codec.decode(packed, "x" * len(RID)) != event


@settings(max_examples=300, deadline=None)
@given(run_id=st.text(st.sampled_from("ab:01"), min_size=1, max_size=6),
       content=st.recursive(st.text(st.sampled_from("ab:01x"), max_size=40)
                            | st.integers(-2**63, 2**63 - 1) | st.none(),
                            lambda kids: st.lists(kids, max_size=4)
                            | st.dictionaries(st.text(st.sampled_from("ab01"), max_size=5),
                                              kids, max_size=4), max_leaves=12))
def test_any_event_reads_back_exactly(run_id: str, content: object) -> None:
    # Run ids that overlap themselves and the content ("aa" in "aaa") still cut and restore
    # to the same bytes.
    event = ev.CallSucceeded(run_id=run_id, execution_id=f"{run_id}:1:0", attempt=1,
                             content=content)
    packed = codec.pack(event, event.run_id)
    assert codec.plain(packed, run_id) == codec.encode(event)
    assert codec.decode(packed, run_id) == event


def test_run_ids_past_the_places_a_record_can_name_stay_in_it() -> None:
    big = "y" * 70_000
    event = ev.CallSucceeded(run_id=RID, execution_id=f"{RID}:1:0", attempt=1,
                             content=[big, RID])
    packed = codec.pack(event, event.run_id)
    assert codec.decode(packed, RID) == event
    many = ev.CallSucceeded(run_id="abcde", execution_id="abcde:1:0", attempt=1,
                            content="abcde" * 400)
    assert codec.pack(many, "abcde")[2] == 255  # at most 255 places; the rest stay in
    assert codec.decode(codec.pack(many, "abcde"), "abcde") == many


def test_a_run_id_of_four_bytes_or_fewer_is_not_cut() -> None:
    # A place costs 2 bytes, and cutting a short id out of field names and values would
    # break the dictionary's matches: "r1" stays in the frame.
    event = ev.CallSucceeded(run_id="r1", execution_id="r1:1:0", attempt=1, content="r1")
    packed = codec.pack(event, "r1")
    assert packed[2] == 0 and codec.decode(packed) == event
    assert codec.pack(ev.RoundCompleted(run_id="abcde", step=1), "abcde")[2] == 1


@settings(max_examples=400, deadline=None)
@given(at=st.integers(min_value=0), value=st.integers(min_value=0, max_value=255),
       cut=st.integers(min_value=0))
def test_a_damaged_packed_record_is_journal_corrupt_or_an_event(at: int, value: int,
                                                                cut: int) -> None:
    # Alone, the codec cannot tell every change (the chain link does); it never raises
    # anything but JournalCorrupt, and never reads past what it was given.
    event = make_dictionary.events()[-4]  # a CallDecided
    packed = bytearray(codec.pack(event, event.run_id))
    packed[at % len(packed)] = value
    damaged = bytes(packed[:max(1, len(packed) - cut % len(packed))])
    try:
        got = codec.decode(damaged, event.run_id)
    except JournalCorrupt:
        return
    assert isinstance(got, ev.Event)


def test_an_unknown_dictionary_a_short_record_or_places_out_of_order_are_refused() -> None:
    packed = codec.pack(make_dictionary.events()[-4], RID)
    with pytest.raises(JournalCorrupt, match="dictionary 9.*newer boundloop"):
        codec.decode(packed[:1] + b"\x09" + packed[2:], RID)
    with pytest.raises(JournalCorrupt, match="3 bytes"):
        codec.decode(b"\xc1\x01\x00", RID)
    with pytest.raises(JournalCorrupt, match="out of order"):
        codec.decode(b"\xc1\x01\x02\x00\x05\x00\x01" + packed[3 + 2 * packed[2]:], RID)


def test_what_is_put_back_is_the_keys_run_id_so_any_event_reads_back_as_given() -> None:
    # An event naming another run than its key's (only a direct append can make one) comes
    # back as it was given, as from a plain journal.
    odd = ev.NoticeAdded(run_id="run-B", text="about run-B and run-A and run-B again")
    packed = codec.pack(odd, "run-A")
    assert packed[2] == 1 and codec.decode(packed, "run-A") == odd


def test_a_frame_that_claims_too_much_or_has_bytes_after_it_is_refused(
        monkeypatch: pytest.MonkeyPatch) -> None:
    event = ev.NoticeAdded(run_id=RID, text="x" * 5000)
    packed = codec.pack(event, RID)
    with pytest.raises(JournalCorrupt, match="unused data"):
        codec.decode(packed + b"junk", RID)
    monkeypatch.setattr(codec, "MAX_PACKED", 4000)
    with pytest.raises(JournalCorrupt, match="claims 50"):
        codec.decode(packed, RID)  # what a forged frame could claim is never allocated
    assert codec.pack(event, RID) == codec.encode(event)  # bigger ones are stored plain


def test_too_deep_a_record_is_journal_corrupt_and_too_deep_an_event_a_journal_error(
        tmp_path: Path) -> None:
    deep = b"\x81\xa1a" * 100_000 + b"\xc0"
    with pytest.raises(JournalCorrupt, match="nested too deeply"):
        codec.decode(b"\x85\xa4type\xaecall.succeeded\xa6run_id\xa1r\xacexecution_id\xa1e"
                     b"\xa7attempt\x01\xa7content" + deep, "r")
    nested: object = "x"
    for _ in range(100_000):
        nested = [nested]
    for compress in (False, True):
        with LmdbJournal(tmp_path / f"j{compress}", compress=compress) as j:
            with pytest.raises(bl.JournalError, match="cannot be stored"):
                j.append("r", 0, [ev.CallSucceeded(run_id="r", execution_id="e", attempt=1,
                                                   content=nested)])
            assert list(j.runs()) == []


def test_threads_pack_at_once_without_mixing_records() -> None:
    events = [ev.CallSucceeded(run_id=f"{i:032x}", execution_id=f"{i:032x}:1:0", attempt=1,
                               content=[f"result {i}"] * (i % 7)) for i in range(400)]
    out: dict[int, list[bytes]] = {}

    def work(k: int) -> None:
        out[k] = [codec.pack(e, e.run_id) for e in events]

    threads = [threading.Thread(target=work, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for packed in out.values():
        assert [codec.decode(p, e.run_id) for p, e in zip(packed, events, strict=True)] \
            == events


# -- journals -------------------------------------------------------------------------------
@bl.tool(read_only=True, idempotent=True)
def search(query: str) -> list[str]:
    """Search."""
    return [f"found {query}", "and more"]


def _script(n: int) -> bl.ScriptedModel:
    return bl.ScriptedModel([bl.CallTools([bl.ToolCall(f"c{i}", "search", {"query": f"q{i}"})],
                                          usage=bl.Usage(input_tokens=100, output_tokens=20))
                             for i in range(n)] + [bl.Final("done")])


def _facts(event: ev.Event) -> dict[str, object]:
    """An event without what differs between two runs of the same script in two journals
    (times, owner, digests under each journal's key)."""
    out = msgspec.to_builtins(event)
    for name in ("ts", "elapsed_s", "latency_s", "owner", "digest"):  # digests are keyed
        out.pop(name, None)
    return out  # type: ignore[no-any-return]


def _runs(path: Path, n: int, **kw: object) -> list[bl.RunResult]:
    with bl.Runner(path, sync=False, **kw) as runner:  # type: ignore[arg-type]
        return [runner.run(model=_script(5), tools=[search], prompt="go",
                           budget=bl.Budget(max_model_steps=7), run_id=f"{i:032x}")
                for i in range(n)]


def test_a_compressed_journal_holds_the_same_runs_in_about_half_theevent_pages(
        tmp_path: Path) -> None:
    plain, packed = _runs(tmp_path / "plain", 40), _runs(tmp_path / "packed", 40,
                                                         compress=True)
    for a, b in zip(plain, packed, strict=True):
        assert (a.status, a.tool_calls, a.transcript) == (b.status, b.tool_calls, b.transcript)
    assert stored_format(tmp_path / "plain") == chain.FORMAT == 2
    assert stored_format(tmp_path / "packed") == chain.COMPRESSED == 3
    with LmdbJournal(tmp_path / "plain", readonly=True) as p, \
            LmdbJournal(tmp_path / "packed", readonly=True) as c:
        for r in p.runs():
            assert [_facts(e) for e in p.events(r)] == [_facts(e) for e in c.events(r)]
            assert bl.replay(c.events(r)).status == "final"
    assert event_pages(tmp_path / "packed") < 0.6 * event_pages(tmp_path / "plain")
    bodies = stored_bodies(tmp_path / "packed")
    assert len(bodies) == 40 * 40 and all(b[0] == codec.MARK for b in bodies)


def test_a_format_2_journal_is_upgraded_in_place_by_a_compressing_writer(
        tmp_path: Path) -> None:
    path = tmp_path / "j"
    first = _runs(path, 3)
    assert stored_format(path) == 2
    with LmdbJournal(path, readonly=True, compress=True) as j:  # a reader never stamps
        assert len(list(j.events(first[0].run_id))) > 0
    assert stored_format(path) == 2
    with bl.Runner(path, sync=False, compress=True) as runner:
        later = runner.run(model=_script(2), tools=[search], prompt="go")
        for r in [*first, later]:
            assert bl.replay(runner.journal.events(r.run_id)).status == "final"
    assert stored_format(path) == 3
    # Writers that do not compress keep the format (it never goes back) and read both.
    with bl.Runner(path, sync=False) as runner:
        assert bl.replay(runner.journal.events(later.run_id)).status == "final"
        assert runner.run(model=_script(1), tools=[search], prompt="go").status == "final"
    assert stored_format(path) == 3
    done = _cli("verify", path)
    assert done.returncode == 0 and len(done.stdout.splitlines()) == 5 + 1, done  # + summary


@pytest.mark.parametrize("flag", ["compress", "sync", "read_only"])
@pytest.mark.parametrize("given", ["no", 1, None])
def test_the_runners_flags_must_be_true_or_false(tmp_path: Path, flag: str,
                                                 given: object) -> None:
    with pytest.raises(bl.ConfigError, match=f"{flag} must be True or False, got {given!r}"):
        bl.Runner(tmp_path / "j", **{flag: given})  # type: ignore[arg-type]
    assert not (tmp_path / "j").exists()


def test_one_process_cannot_open_a_journal_both_ways(tmp_path: Path) -> None:
    with bl.Runner(tmp_path / "j", compress=True), \
            pytest.raises(bl.ConfigError, match="compress=True"):
        lmdb_journal.acquire(tmp_path / "j")


def test_a_damaged_compressed_record_is_refused_naming_its_run_and_seq(
        tmp_path: Path) -> None:
    path = tmp_path / "j"
    [result] = _runs(path, 1, compress=True)
    env = lmdb.open(str(path), max_dbs=8)
    with env.begin(write=True) as txn:
        db = env.open_db(b"events", txn=txn, create=False)
        key = result.run_id.encode() + b"\x00" + (5).to_bytes(8, "big")
        value = bytearray(txn.get(key, db=db))
        assert value[chain.LINK_SIZE] == codec.MARK
        value[-3] ^= 0x01
        txn.put(key, bytes(value), db=db)
    env.close()
    with LmdbJournal(path, readonly=True) as j, pytest.raises(chain.ChainError) as caught:
        list(j.events(result.run_id))
    assert (caught.value.run_id, caught.value.seq) == (result.run_id, 5)
    done = _cli("verify", path)
    assert done.returncode == 1 and "DAMAGED seq 5" in done.stdout


def _cli(command: str, path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "boundloop", "--journal", str(path), command],
                          capture_output=True, text=True, timeout=60)
