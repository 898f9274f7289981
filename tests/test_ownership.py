"""Two workers sharing a journal never both drive one run (real processes, real SIGKILL)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

import boundloop as bl
from boundloop import events as ev
from boundloop.journal.base import Fence

ORPHANS = 12

ORPHAN_MAKER = textwrap.dedent("""
    import os, signal, sys, threading, time
    import boundloop as bl
    runner = bl.Runner(sys.argv[1])
    hold = threading.Event()
    def stuck(history, ctx):
        hold.wait()
    for i in range({n}):
        runner.submit(model=stuck, prompt="hi", run_id=f"orphan-{{i}}")
    while len(list(runner.journal.open_runs())) < {n}:
        time.sleep(0.01)
    os.kill(os.getpid(), signal.SIGKILL)
""").format(n=ORPHANS)

RECOVERER = textwrap.dedent("""
    import json, sys
    import boundloop as bl
    with bl.Runner(sys.argv[1]) as runner:
        mine = [r.run_id for r in runner.recover()]
        for run_id in mine:
            result = runner.resume(run_id, model=bl.ScriptedModel([bl.Final(sys.argv[2])]))
            assert result.status == "final", result
    print(json.dumps(mine))
""")


def test_two_recovering_workers_split_the_orphans(tmp_path: Path) -> None:
    journal = tmp_path / "j"
    made = subprocess.run([sys.executable, "-c", ORPHAN_MAKER, str(journal)],
                          capture_output=True, text=True, timeout=60)
    assert made.returncode == -signal.SIGKILL, made.stderr
    procs = [subprocess.Popen([sys.executable, "-c", RECOVERER, str(journal), name],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for name in ("a", "b")]
    outs = [p.communicate(timeout=60) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err for _, err in outs]
    a, b = (set(json.loads(out)) for out, _ in outs)
    assert not a & b
    assert a | b == {f"orphan-{i}" for i in range(ORPHANS)}
    with bl.Runner(journal) as runner:
        assert list(runner.journal.open_runs()) == []
        for run_id in a | b:
            events = list(runner.journal.events(run_id))
            claims = [e for e in events if isinstance(e, ev.OwnerClaimed)]
            assert len(claims) == 1
            finals = [e.text for e in bl.replay(events).transcript if e.kind == "final"]
            assert finals == ["a" if run_id in a else "b"]


def test_resume_claims_again_after_an_append_that_kept_the_owner(tmp_path: Path) -> None:
    """An append that lands between resume's read and its claim without changing the owner
    (a fenced runner recording its last attempts as it stops) does not make resume say
    "claimed by another runner": it reads again and claims; a real claim by another runner
    is still refused."""
    journal = tmp_path / "j"
    made = subprocess.run([sys.executable, "-c", ORPHAN_MAKER.replace(f"range({ORPHANS})",
                                                                      "range(2)").replace(
        f"< {ORPHANS}", "< 2"), str(journal)], capture_output=True, text=True, timeout=60)
    assert made.returncode == -signal.SIGKILL, made.stderr
    with bl.Runner(journal) as runner:
        real_claim = runner._claim
        raced: list[str] = []

        def claim_after_a_late_append(run_id: str, seq: int, state: Any) -> Any:
            if run_id not in raced:  # the gone owner's late fact lands first, once
                raced.append(run_id)
                runner.journal.append(run_id, seq, [ev.NoticeAdded(run_id=run_id, text="late")],
                                      Fence(state.owner, state.epoch))
            return real_claim(run_id, seq, state)

        runner._claim = claim_after_a_late_append  # type: ignore[method-assign]
        result = runner.resume("orphan-0", model=bl.ScriptedModel([bl.Final("done")]))
        assert result.status == "final" and raced == ["orphan-0"]
        events = list(runner.journal.events("orphan-0"))
        assert [type(e).__name__ for e in events].count("OwnerClaimed") == 1
        assert any(isinstance(e, ev.NoticeAdded) and e.text == "late" for e in events)

        def claim_taken_by_another(run_id: str, seq: int, state: Any) -> Any:
            runner.journal.append(run_id, seq, [ev.OwnerClaimed(
                run_id=run_id, owner="another-runner", epoch=state.epoch + 1)])
            return real_claim(run_id, seq, state)

        runner._claim = claim_taken_by_another  # type: ignore[method-assign]
        with pytest.raises(bl.RecoveryError, match="claimed by another runner"):
            runner.resume("orphan-1", model=bl.ScriptedModel([bl.Final("never")]))
