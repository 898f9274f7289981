"""``boundloop compact`` (SPEC 9): prune frees pages inside data.mdb but never shrinks it;
compact rewrites the journal without them, crash-safely, and only while nothing uses it."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgspec
import pytest

import boundloop as bl
from boundloop import events as ev
from boundloop import ops as bi
from boundloop import owners
from boundloop.journal.lmdb import COMPACT_PAUSE_ENV, LmdbJournal

CLI = [sys.executable, "-m", "boundloop"]
OLD = 1_000_000.0  # finished long ago: pruned by --older-than 0s
LATER = time.time() + 10 * 365 * 86400  # "finishes" in ten years: never pruned


def small_run(run_id: str, finished_at: float | None) -> list[ev.Event]:
    events: list[ev.Event] = [
        ev.RunAdmitted(run_id=run_id, ts=1.0, budget=bl.Budget(max_model_steps=3),
                       history=[bl.UserMessage("hello")], tools=[], owner="gone:1:x"),
        ev.ModelStepStarted(run_id=run_id, step=1, tools_allowed=False,
                            reservation=bl.Usage(input_tokens=10)),
        ev.ModelStepCompleted(run_id=run_id, step=1, response=bl.Final(f"answer {run_id}")),
    ]
    if finished_at is not None:
        events.append(ev.RunFinished(run_id=run_id, ts=finished_at, status="final",
                                     exhausted_limit=None, model_steps=1, tool_calls=0,
                                     explanation="The model gave a final answer."))
    return events


def fill(journal: LmdbJournal, runs: dict[str, float | None]) -> None:
    """Append every run's events, many appends in flight at once (group commit)."""
    left = len(runs)
    lock = threading.Lock()
    all_done = threading.Event()
    errors: list[BaseException] = []

    def done(err: BaseException | None) -> None:
        nonlocal left
        with lock:
            if err is not None:
                errors.append(err)
            left -= 1
            if left == 0:
                all_done.set()

    for run_id, finished_at in runs.items():
        journal.submit(run_id, 0, small_run(run_id, finished_at), done)
    assert all_done.wait(120)
    assert not errors, errors[:3]


def build(path: Path, total: int, keep_every: int) -> dict[str, float | None]:
    """``total`` small runs: every ``keep_every``-th one is kept by prune (half of those
    are still open, half finish in the future); the others finished long ago."""
    runs: dict[str, float | None] = {}
    for n in range(total):
        if n % keep_every:
            runs[f"r{n:06d}"] = OLD
        else:
            runs[f"r{n:06d}"] = None if n % (2 * keep_every) else LATER
    with LmdbJournal(path, sync=False) as j:
        fill(j, runs)
    return runs


def cli(*args: str, journal: Path, env: dict[str, str] | None = None
        ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, "--journal", str(journal), *args], capture_output=True,
                          text=True, timeout=120, env=env)


def heads(path: Path, run_ids: list[str]) -> dict[str, str]:
    with LmdbJournal(path, readonly=True) as j:
        return {r: j.chain_head(r).hex() for r in run_ids}


def check_compaction(tmp_path: Path, total: int, keep_every: int) -> None:
    path = tmp_path / "journal"
    runs = build(path, total, keep_every)
    kept = [r for r, ts in runs.items() if ts != OLD]
    pruned = cli("prune", "--older-than", "0s", "--json", journal=path)
    assert pruned.returncode == 0, pruned.stderr
    data = path / "data.mdb"
    before = data.stat().st_size
    kept_heads = heads(path, kept)

    done = cli("compact", journal=path)
    assert done.returncode == 0, done.stderr
    after = data.stat().st_size
    assert done.stdout.startswith(f"compacted {path}: data.mdb {before} bytes before, "
                                  f"{after} bytes after")

    fresh = tmp_path / "fresh"
    with LmdbJournal(fresh, sync=False) as j:
        fill(j, {r: runs[r] for r in kept})
    fresh_size = (fresh / "data.mdb").stat().st_size
    print(f"\n{total} runs, {len(kept)} kept: data.mdb {before} bytes after prune, {after} "
          f"after compact; a fresh journal of the kept runs: {fresh_size}")
    assert after <= 1.1 * fresh_size
    assert after < before / 3

    with LmdbJournal(path, readonly=True) as j:  # every remaining run replays, unchanged
        assert sorted(j.runs()) == sorted(kept)
        assert sorted(j.open_runs()) == sorted(r for r in kept if runs[r] is None)
        for run_id in kept:
            state = bl.replay(j.events(run_id))
            assert state.finished == (runs[run_id] is not None)
            assert state.transcript[-1].text == f"answer {run_id}"  # type: ignore[union-attr]
    assert heads(path, kept) == kept_heads
    with LmdbJournal(path) as j:  # and the journal takes new appends
        j.append("new", 0, small_run("new", None))
    assert cli("verify", journal=path).returncode == 0
    assert sorted(os.listdir(path)) == ["data.mdb", "lock.mdb"]
    assert [p.name for p in tmp_path.iterdir() if ".compact-" in p.name] == []
    assert data.stat().st_mode & 0o777 == 0o600


def test_compact_after_prune_gives_back_the_space(tmp_path: Path) -> None:
    check_compaction(tmp_path, total=20_000, keep_every=20)


@pytest.mark.soak
def test_compact_after_prune_gives_back_the_space_at_scale(tmp_path: Path) -> None:
    check_compaction(tmp_path, total=200_000, keep_every=10)


# -- refusals ------------------------------------------------------------------------------
HOLD = """
import sys, time
from boundloop.journal.lmdb import LmdbJournal
j = LmdbJournal(sys.argv[1], readonly=sys.argv[2] == "ro")
print("open", flush=True)
time.sleep(60)
"""


@pytest.mark.parametrize("mode", ["rw", "ro"])
def test_compact_is_refused_while_another_process_has_the_journal_open(
        tmp_path: Path, mode: str) -> None:
    path = tmp_path / "journal"
    build(path, 50, 2)
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(path), mode],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "open\n"
        size = (path / "data.mdb").stat().st_size
        done = cli("compact", journal=path)
        assert done.returncode == 4, done
        assert "other processes have the journal" in done.stderr
        assert len(done.stderr.splitlines()) == 1
        assert (path / "data.mdb").stat().st_size == size
    finally:
        holder.kill()
        holder.wait()
    assert cli("compact", journal=path).returncode == 0


def test_compact_is_refused_while_open_in_this_process_or_owned_by_a_live_runner(
        tmp_path: Path) -> None:
    path = tmp_path / "journal"
    build(path, 10, 2)
    with LmdbJournal(path) as j:
        with pytest.raises(bl.JournalUnavailable, match="open in this process"):
            bi.compact(path)
        j.put_owner(owners.this_process("me:1:live", time.time() + 60))
    with pytest.raises(bl.JournalUnavailable, match="live runner.*me:1:live"):
        bi.compact(path)
    done = cli("compact", journal=path)
    assert done.returncode == 4 and "live runner" in done.stderr
    with LmdbJournal(path) as j:
        j.remove_owner("me:1:live")
        dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                              capture_output=True, text=True, check=True)
        j.put_owner(msgspec.structs.replace(owners.this_process("gone:1:dead", time.time() - 60),
                                            pid=int(dead.stdout)))
    assert cli("compact", journal=path).returncode == 0


def test_a_journal_being_compacted_cannot_be_opened(tmp_path: Path) -> None:
    path = tmp_path / "journal"
    build(path, 10, 2)
    env = {**os.environ, COMPACT_PAUSE_ENV: "2"}
    proc = subprocess.Popen([*CLI, "--journal", str(path), "compact"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 30
        while not list(tmp_path.glob(".journal.compact-*")):
            assert time.time() < deadline and proc.poll() is None
            time.sleep(0.02)
        with pytest.raises(bl.JournalUnavailable, match="being compacted"):
            LmdbJournal(path, readonly=True)
        done = cli("runs", journal=path)
        assert done.returncode == 4 and "being compacted" in done.stderr
    finally:
        proc.kill()
        proc.wait()


# -- crash safety --------------------------------------------------------------------------
def test_compact_killed_at_any_moment_leaves_a_whole_journal(tmp_path: Path) -> None:
    """SIGKILL a compaction in each of its steps, at a random moment of it (the test hook
    pauses before each step and names it), and at random moments overall: the journal
    always opens and holds every run unchanged, the old file until the swap, then the new."""
    path = tmp_path / "journal"
    runs = build(path, 400, 4)
    assert cli("prune", "--older-than", "0s", journal=path).returncode == 0
    kept = sorted(r for r, ts in runs.items() if ts != OLD)
    expected = heads(path, kept)
    pause = 0.15
    env = {**os.environ, COMPACT_PAUSE_ENV: str(pause)}
    rng = random.Random(7)
    data = path / "data.mdb"
    plan = [(step, rng.uniform(0, pause)) for step in ("copy", "check", "swap", "done")
            for _ in range(2)] + [(None, rng.uniform(0, 1.2)) for _ in range(4)]
    for step, delay in plan:
        inode = data.stat().st_ino
        proc = subprocess.Popen([*CLI, "--journal", str(path), "compact"], env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        assert proc.stderr is not None
        if step is not None:
            for line in proc.stderr:
                if line.strip() == f"compact: {step}":
                    break
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        if step is not None:
            assert proc.returncode == -signal.SIGKILL
            assert (data.stat().st_ino != inode) == (step == "done"), step
        assert heads(path, kept) == expected
        with LmdbJournal(path, readonly=True) as j:
            assert sorted(j.runs()) == kept
        assert sorted(os.listdir(path)) == ["data.mdb", "lock.mdb"]
    done = cli("compact", journal=path)  # and a later one finishes, cleaning up
    assert done.returncode == 0, done.stderr
    assert [p.name for p in tmp_path.iterdir() if ".compact-" in p.name] == []
    assert heads(path, kept) == expected
    with LmdbJournal(path) as j:
        j.append("new", 0, small_run("new", None))
    assert cli("verify", journal=path).returncode == 0
