"""LMDB hygiene: the map grows before it is full, a full journal fails closed."""

from __future__ import annotations

from pathlib import Path

import boundloop as bl
from boundloop import events as ev
from boundloop.journal import LmdbJournal


def notice(run_id: str, i: int) -> ev.Event:
    return ev.NoticeAdded(run_id=run_id, text=f"{i:06d}" + "x" * 2000)


def admitted(run_id: str) -> ev.Event:
    return ev.RunAdmitted(run_id=run_id, budget=bl.Budget(), history=[], tools=[])


def test_map_grows_instead_of_filling(tmp_path: Path) -> None:
    with LmdbJournal(tmp_path / "j", map_size=256 << 10) as j:
        seq = j.append("r", 0, [admitted("r")])
        for i in range(400):  # ~800 KB of events into a 256 KiB map
            seq = j.append("r", seq, [notice("r", i)])
        texts = [e.text[:6] for e in j.events("r") if isinstance(e, ev.NoticeAdded)]
    assert texts == [f"{i:06d}" for i in range(400)]
    with LmdbJournal(tmp_path / "j") as again:  # reopens with the grown size
        assert len(list(again.events("r"))) == 401


def test_full_journal_fails_closed_and_the_run_says_so(tmp_path: Path) -> None:
    journal = LmdbJournal(tmp_path / "j", map_size=256 << 10, max_map_size=256 << 10)
    ran: list[str] = []

    @bl.tool
    def work(payload: str) -> str:
        ran.append(payload)
        return payload

    big = "y" * 40_000
    calls = [bl.CallTools([bl.ToolCall(f"c{i}", "work", {"payload": big})]) for i in range(12)]
    with bl.Runner(journal) as runner:
        result = runner.run(model=bl.ScriptedModel([*calls, bl.Final("done")]), tools=[work],
                            prompt="fill it", budget=bl.Budget(max_model_steps=14))
        assert result.status == "journal_unavailable"
        assert "full" in result.explanation
        # Every call that ran had its decision recorded first; the failed round ran nothing.
        decided = [e for e in runner.journal.events(result.run_id)
                   if isinstance(e, ev.CallDecided)]
        assert len(ran) <= len(decided) < 12
    journal.close()


def test_a_map_grown_by_another_process_is_adopted(tmp_path: Path) -> None:
    import subprocess
    import sys
    import textwrap

    grow = textwrap.dedent("""
        import sys
        import boundloop as bl
        from boundloop import events as ev
        from boundloop.journal import LmdbJournal
        with LmdbJournal(sys.argv[1], map_size=256 << 10) as j:
            seq = j.append("other", 0, [ev.RunAdmitted(run_id="other", budget=bl.Budget(),
                                                       history=[], tools=[])])
            for i in range(400):
                seq = j.append("other", seq, [ev.NoticeAdded(run_id="other", text="x" * 2000)])
    """)
    with LmdbJournal(tmp_path / "j", map_size=256 << 10) as mine:
        seq = mine.append("r", 0, [admitted("r")])
        done = subprocess.run([sys.executable, "-c", grow, str(tmp_path / "j")],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        # This process still has the small map: reading and writing adopt the new size.
        assert len(list(mine.events("other"))) == 401
        mine.append("r", seq, [notice("r", 1)])
        assert [e.text[:6] for e in mine.events("r") if isinstance(e, ev.NoticeAdded)] == [
            "000001"]
