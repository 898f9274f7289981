"""The redaction key lives apart from the journal (SPEC 9): where it comes from, in which
order, how the journal's fingerprint refuses another key, which keys are refused, the modes
of what boundloop writes, and read-only opens that create nothing."""

from __future__ import annotations

import os
import stat
import threading
from collections.abc import Iterator
from pathlib import Path

import lmdb
import pytest

import boundloop as bl
from boundloop import keys
from boundloop.journal import LmdbJournal
from boundloop.testing import FaultyJournal

GOOD = bytes(range(1, 33))
OTHER = bytes(range(101, 133))


@pytest.fixture
def state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh state directory of this test's own (not created yet)."""
    path = tmp_path / "state"
    monkeypatch.setenv("XDG_STATE_HOME", str(path))
    monkeypatch.delenv(keys.ENV_VAR, raising=False)
    return path


@pytest.fixture
def journal(tmp_path: Path) -> Path:
    return tmp_path / "journal"


def meta(path: Path) -> dict[bytes, bytes]:
    env = lmdb.open(str(path), readonly=True, lock=False, max_dbs=8, subdir=True)
    try:
        db = env.open_db(b"meta", create=False)
        with env.begin(db=db) as txn:
            return dict(txn.cursor())
    finally:
        env.close()


def key_files(state: Path) -> list[Path]:
    keydir = state / "boundloop" / "keys"
    return sorted(p for p in keydir.iterdir()) if keydir.exists() else []


def run_once(runner: bl.Runner) -> str:
    result = runner.run(model=bl.ScriptedModel([bl.Final("ok")]), prompt="p")
    assert result.status == "final"
    return result.run_id


def tree(path: Path) -> dict[str, tuple[int, int]]:
    """Every file under ``path`` with its size and mtime (to see that nothing changed; the
    reader slots in LMDB's lock file are the only bytes a reader may touch, SPEC 6)."""
    if not path.exists():
        return {}
    return {str(p.relative_to(path)): (p.stat().st_size,
                                       0 if p.name == "lock.mdb" else p.stat().st_mtime_ns)
            for p in path.rglob("*")}


@pytest.fixture
def umask() -> Iterator[None]:
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


# -- the default: one key per journal in the state directory --------------------------------
@pytest.mark.parametrize("mask", [0o000, 0o022, 0o077, 0o277])
def test_default_key_is_in_the_state_directory_private_whatever_the_umask(
        state: Path, journal: Path, mask: int, umask: None) -> None:
    os.umask(mask)
    with bl.Runner(journal) as runner:
        run_once(runner)
        key = runner.journal.secret_key
    os.umask(0o022)
    files = key_files(state)
    assert len(files) == 1 and files[0].read_bytes() == key and len(key) == 32
    assert stat.S_IMODE(files[0].stat().st_mode) == 0o600
    for d in (state / "boundloop", state / "boundloop" / "keys"):
        assert stat.S_IMODE(d.stat().st_mode) == 0o700, d
    # The journal keeps its id (which names the file) and the key's fingerprint, not the key.
    stored = meta(journal)
    journal_id = stored[keys.META_JOURNAL_ID].decode()
    assert files[0].name == f"{journal_id}.key"
    assert stored[keys.META_FINGERPRINT].decode() == keys.fingerprint(key)
    for p in journal.rglob("*"):
        if p.is_file():
            assert key not in p.read_bytes(), p
    assert not (journal / keys.LEGACY_KEY_FILE).exists()


def test_the_key_persists_and_each_journal_has_its_own(state: Path, tmp_path: Path) -> None:
    with bl.Runner(tmp_path / "a") as runner:
        key_a = runner.journal.secret_key
    with bl.Runner(tmp_path / "b") as runner:
        key_b = runner.journal.secret_key
    with bl.Runner(tmp_path / "a") as runner:
        assert runner.journal.secret_key == key_a
    assert key_a != key_b and len(key_files(state)) == 2


def test_xdg_state_home_else_the_home_directory(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg"))
    assert keys.state_dir() == tmp_path / "xdg" / "boundloop" / "keys"
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    for unusable in ("", "relative/dir"):  # XDG: a relative path is ignored
        monkeypatch.setenv("XDG_STATE_HOME", unusable)
        assert keys.state_dir() == tmp_path / "home" / ".local" / "state" / "boundloop" / "keys"


def test_loose_modes_of_the_state_directory_are_made_private_again(
        state: Path, journal: Path) -> None:
    with bl.Runner(journal):
        pass
    (path,) = key_files(state)
    os.chmod(path, 0o644)
    os.chmod(path.parent, 0o755)
    with bl.Runner(journal):
        pass
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="needs root")
def test_a_state_key_file_of_another_user_is_refused(state: Path, journal: Path) -> None:
    with bl.Runner(journal):
        pass
    (path,) = key_files(state)
    os.chown(path, 65534, 65534)
    with pytest.raises(bl.ConfigError, match="another user"):
        bl.Runner(journal)


def test_a_lost_state_key_is_refused_not_replaced(state: Path, journal: Path) -> None:
    with bl.Runner(journal) as runner:
        run_once(runner)
    (path,) = key_files(state)
    path.unlink()
    with pytest.raises(bl.ConfigError) as info:
        bl.Runner(journal)
    message = str(info.value)
    assert str(path) in message and keys.ENV_VAR in message and "redaction_key=" in message
    assert key_files(state) == []  # no new key was made for a journal that has one


def test_racing_creators_agree_on_one_key(state: Path) -> None:
    path = keys.key_path(keys.new_journal_id())
    got: list[bytes] = []
    threads = [threading.Thread(target=lambda: got.append(keys._create_state_key(path)))
               for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 8 and len(set(got)) == 1
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary left


# -- explicit keys and the environment variable ---------------------------------------------
def test_explicit_key_bytes_or_file(state: Path, tmp_path: Path) -> None:
    keyfile = tmp_path / "k.bin"
    keyfile.write_bytes(GOOD)
    with bl.Runner(tmp_path / "j1", redaction_key=GOOD) as runner:
        assert runner.journal.secret_key == GOOD
    for source in (str(keyfile), keyfile):
        with bl.Runner(tmp_path / "j1", redaction_key=source) as runner:
            assert runner.journal.secret_key == GOOD
    with bl.Runner(tmp_path / "j2", redaction_key=bytearray(GOOD)) as runner:
        assert runner.journal.secret_key == GOOD
    assert key_files(state) == []  # nothing kept in the state directory then
    with pytest.raises(bl.ConfigError, match="bytes or the path"):
        bl.Runner(tmp_path / "j3", redaction_key=42)  # type: ignore[arg-type]
    mistaken = "the-key-itself-given-as-a-str-0123456789"
    with pytest.raises(bl.ConfigError, match="names no file") as info:
        bl.Runner(tmp_path / "j3", redaction_key=mistaken)
    assert mistaken not in str(info.value)  # a key given as a str is not echoed
    assert not (tmp_path / "j3").exists()


def test_resolution_order(state: Path, journal: Path, tmp_path: Path,
                          monkeypatch: pytest.MonkeyPatch) -> None:
    env_file = tmp_path / "env.key"
    env_file.write_bytes(GOOD)
    monkeypatch.setenv(keys.ENV_VAR, str(env_file))
    # The environment variable comes before the state directory ...
    with bl.Runner(journal) as runner:
        assert runner.journal.secret_key == GOOD
    assert key_files(state) == []
    # ... and redaction_key= before the environment variable.
    with bl.Runner(tmp_path / "other", redaction_key=OTHER) as runner:
        assert runner.journal.secret_key == OTHER
    # Without either, a journal made with the variable's key cannot find it.
    monkeypatch.delenv(keys.ENV_VAR)
    with pytest.raises(bl.ConfigError, match=keys.ENV_VAR):
        bl.Runner(journal)
    monkeypatch.setenv(keys.ENV_VAR, "")  # empty means unset
    with pytest.raises(bl.ConfigError):
        bl.Runner(journal)
    with bl.Runner(journal, redaction_key=env_file) as runner:
        assert runner.journal.secret_key == GOOD


def test_env_var_naming_a_missing_file_is_refused(state: Path, journal: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(keys.ENV_VAR, str(journal.parent / "nope.key"))
    with pytest.raises(bl.ConfigError, match="cannot read"):
        bl.Runner(journal)


# -- the fingerprint ----------------------------------------------------------------------------
def test_another_key_than_the_journals_is_refused(state: Path, journal: Path,
                                                  tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    with bl.Runner(journal, redaction_key=GOOD) as runner:
        run_id = run_once(runner)
    before = tree(journal)
    with pytest.raises(bl.ConfigError) as info:
        bl.Runner(journal, redaction_key=OTHER)
    message = str(info.value)
    assert "not the key of the journal" in message and "fingerprint" in message
    assert "redaction_key=" in message and "new journal directory" in message
    other = tmp_path / "other.key"
    other.write_bytes(OTHER)
    monkeypatch.setenv(keys.ENV_VAR, str(other))
    with pytest.raises(bl.ConfigError, match="not the key of the journal"):
        bl.Runner(journal)
    # Nothing was written by the refused runners; the right key still works.
    assert {k: v[0] for k, v in tree(journal).items() if k != "lock.mdb"} == \
        {k: v[0] for k, v in before.items() if k != "lock.mdb"}
    monkeypatch.delenv(keys.ENV_VAR)
    with bl.Runner(journal, redaction_key=GOOD) as runner:
        assert runner.journal.info(run_id).status == "final"


def test_the_default_key_of_one_journal_does_not_open_another(state: Path,
                                                              tmp_path: Path) -> None:
    with bl.Runner(tmp_path / "a") as runner:
        key_a = runner.journal.secret_key
    with bl.Runner(tmp_path / "b"):
        pass
    with pytest.raises(bl.ConfigError, match="not the key of the journal"):
        bl.Runner(tmp_path / "b", redaction_key=key_a)


def test_runners_sharing_one_journal_in_a_process_share_its_key(state: Path,
                                                                journal: Path) -> None:
    with bl.Runner(journal, redaction_key=GOOD) as first:
        with bl.Runner(journal) as second:  # no key: the journal's, as bound
            assert second.journal.secret_key == GOOD
        with bl.Runner(journal, redaction_key=GOOD) as third:
            assert third.journal.secret_key == GOOD
        with pytest.raises(bl.ConfigError, match="not the key of the journal"):
            bl.Runner(journal, redaction_key=OTHER)
        run_once(first)  # the refused runner left the shared journal open


def test_a_journal_object_must_hold_the_given_key(state: Path, journal: Path) -> None:
    inner = LmdbJournal(journal)
    try:
        inner.bind_key(GOOD)
        with bl.Runner(FaultyJournal(inner), redaction_key=GOOD) as runner:
            run_once(runner)
        with pytest.raises(bl.ConfigError, match="not the key of the journal"):
            bl.Runner(FaultyJournal(inner), redaction_key=OTHER)
    finally:
        inner.close()


# -- refused keys ------------------------------------------------------------------------------
@pytest.mark.parametrize("bad, why", [(b"\x00" * 32, "all zero"), (b"\x00" * 64, "all zero"),
                                      (GOOD[:31], "31 bytes"), (b"", "0 bytes")])
def test_zero_and_short_keys_are_refused(state: Path, tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch, bad: bytes,
                                         why: str) -> None:
    with pytest.raises(bl.ConfigError, match=why):
        bl.Runner(tmp_path / "j1", redaction_key=bad)
    keyfile = tmp_path / "bad.key"
    keyfile.write_bytes(bad)
    with pytest.raises(bl.ConfigError, match=why):
        bl.Runner(tmp_path / "j2", redaction_key=keyfile)
    monkeypatch.setenv(keys.ENV_VAR, str(keyfile))
    with pytest.raises(bl.ConfigError, match=why):
        bl.Runner(tmp_path / "j3")
    # A refused key leaves nothing behind: no journal, no state directory.
    for name in ("j1", "j2", "j3"):
        assert not (tmp_path / name).exists()
    assert not state.exists()


def test_a_key_file_too_large_or_not_a_file_is_refused(state: Path, tmp_path: Path) -> None:
    big = tmp_path / "big.key"
    big.write_bytes(b"k" * (keys.MAX_KEY_BYTES + 1))
    with pytest.raises(bl.ConfigError, match="larger than"):
        bl.Runner(tmp_path / "j", redaction_key=big)
    with pytest.raises(bl.ConfigError, match="not a regular file"):
        bl.Runner(tmp_path / "j", redaction_key=tmp_path)


def test_a_key_file_inside_the_journal_directory_is_refused(state: Path, journal: Path,
                                                            monkeypatch: pytest.MonkeyPatch
                                                            ) -> None:
    journal.mkdir()
    inside = journal / "my.key"
    inside.write_bytes(GOOD)
    with pytest.raises(bl.ConfigError, match="inside the journal directory"):
        bl.Runner(journal, redaction_key=inside)
    monkeypatch.setenv(keys.ENV_VAR, str(inside))
    with pytest.raises(bl.ConfigError, match="inside the journal directory"):
        bl.Runner(journal)
    # A state directory under the journal directory too.
    monkeypatch.delenv(keys.ENV_VAR)
    monkeypatch.setenv("XDG_STATE_HOME", str(journal / "state"))
    with pytest.raises(bl.ConfigError, match="inside the journal directory"):
        bl.Runner(journal)
    assert not (journal / "state").exists()


# -- a key file left inside the journal directory by an older version ----------------------
def old_journal(path: Path, key: bytes, mode: int = 0o600) -> Path:
    """A journal as an older boundloop left it: runs, no id, no fingerprint, and its key
    in ``redaction.key`` beside the data."""
    with LmdbJournal(path) as j:
        j.append("old-run", 0, [bl.RunAdmitted(run_id="old-run", budget=bl.Budget(),
                                               history=[], tools=[])])
    legacy = path / keys.LEGACY_KEY_FILE
    legacy.write_bytes(key)
    os.chmod(legacy, mode)
    assert keys.META_FINGERPRINT not in meta(path)
    return legacy


def test_an_old_journals_key_file_is_adopted_once_and_left_in_place(state: Path,
                                                                    journal: Path) -> None:
    legacy = old_journal(journal, GOOD)
    with bl.Runner(journal) as runner:
        run_once(runner)
        assert runner.journal.secret_key == GOOD  # old and new digests match
    (copy,) = key_files(state)
    assert copy.read_bytes() == GOOD and stat.S_IMODE(copy.stat().st_mode) == 0o600
    assert meta(journal)[keys.META_FINGERPRINT].decode() == keys.fingerprint(GOOD)
    assert legacy.read_bytes() == GOOD  # left for `verify` to warn about
    legacy.unlink()  # once moved out, the journal still opens with its key
    with bl.Runner(journal) as runner:
        assert runner.journal.secret_key == GOOD


@pytest.mark.parametrize("planted, mode", [
    (b"\x00" * 32, 0o600), (OTHER, 0o664), (OTHER, 0o606), (OTHER[:31], 0o600),
    (OTHER + b"x", 0o600)])
def test_an_old_key_file_that_may_have_been_planted_is_never_used(
        state: Path, journal: Path, planted: bytes, mode: int) -> None:
    legacy = old_journal(journal, planted, mode)
    with bl.Runner(journal) as runner:
        key = runner.journal.secret_key
    assert key != planted and len(key) == 32 and key_files(state)[0].read_bytes() == key
    assert legacy.read_bytes() == planted


@pytest.mark.parametrize("planted", [b"\x00" * 32, OTHER])
def test_a_key_file_in_a_new_journal_directory_is_never_used(state: Path, journal: Path,
                                                             planted: bytes) -> None:
    journal.mkdir()  # someone made the directory first and put a key of theirs in it
    legacy = journal / keys.LEGACY_KEY_FILE
    legacy.write_bytes(planted)
    os.chmod(legacy, 0o600)
    with bl.Runner(journal) as runner:
        run_once(runner)
        key = runner.journal.secret_key
    assert key != planted and key_files(state)[0].read_bytes() == key
    assert legacy.read_bytes() == planted


def test_an_explicit_key_wins_over_an_old_key_file(state: Path, journal: Path) -> None:
    old_journal(journal, GOOD)
    with bl.Runner(journal, redaction_key=OTHER) as runner:
        assert runner.journal.secret_key == OTHER
    assert key_files(state) == []


# -- read-only opens ---------------------------------------------------------------------------
def test_read_only_open_creates_nothing(state: Path, journal: Path, tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    with bl.Runner(journal) as runner:
        run_once(runner)
        key = runner.journal.secret_key
    before_journal, before_state = tree(journal), tree(state)
    with LmdbJournal(journal, readonly=True) as reader:
        assert reader.secret_key == key  # found in the state directory
        assert list(reader.runs())
    # Another user's state directory (not created): the reader works without the key.
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "elsewhere"))
    with LmdbJournal(journal, readonly=True) as reader:
        without = reader.secret_key
        assert len(without) == 32 and without != key
        assert list(reader.runs())
    assert not (tmp_path / "elsewhere").exists()
    # The environment variable's key is used when it is the journal's, ignored otherwise.
    right, wrong = tmp_path / "right.key", tmp_path / "wrong.key"
    right.write_bytes(key)
    wrong.write_bytes(OTHER)
    monkeypatch.setenv(keys.ENV_VAR, str(right))
    with LmdbJournal(journal, readonly=True) as reader:
        assert reader.secret_key == key
    monkeypatch.setenv(keys.ENV_VAR, str(wrong))
    with LmdbJournal(journal, readonly=True) as reader:
        assert reader.secret_key not in (key, OTHER)
    assert tree(journal) == before_journal and tree(state) == before_state


def test_read_only_open_of_a_journal_without_a_fingerprint(state: Path, journal: Path) -> None:
    with LmdbJournal(journal) as writer:  # never asked for a key: none was made
        writer.append("r1", 0, [bl.RunAdmitted(run_id="r1", budget=bl.Budget(), history=[],
                                               tools=[])])
    assert keys.META_FINGERPRINT not in meta(journal) and key_files(state) == []
    with LmdbJournal(journal, readonly=True) as reader:
        assert len(reader.secret_key) == 32
    assert key_files(state) == [] and not state.exists()
