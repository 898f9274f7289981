"""SPEC 14: ``boundloop worker MODULE:AGENTS`` and ``Worker.aserve``."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import boundloop as bl

APP = textwrap.dedent('''
    import time
    import boundloop as bl

    @bl.tool
    def act(n: str) -> str:
        """Act."""
        with open("effects.log", "a") as f:
            f.write(n + "\\n")
        return "ok"

    def model(history, ctx):
        if ctx.step == 1:
            return bl.CallTools([bl.ToolCall("c1", "act", {"n": ctx.run_id})])
        return bl.Final("done")

    AGENTS = [bl.Agent("app", model=model, tools=[act])]
    NAMES = "app"
    def make():
        return AGENTS
    def broken():
        raise RuntimeError("no agents today")
''')


def cli(cwd: Path, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "boundloop", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("target", ["agents_app:AGENTS", "agents_app:make"])
def test_the_worker_command_serves_the_queue_and_exits_0_on_sigterm(tmp_path: Path,
                                                                    target: str) -> None:
    (tmp_path / "agents_app.py").write_text(APP)
    journal = tmp_path / "j"
    sys.path.insert(0, str(tmp_path))
    try:
        import agents_app  # type: ignore[import-not-found]
    finally:
        sys.path.remove(str(tmp_path))
    with bl.Runner(journal) as runner:
        for i in range(5):
            runner.enqueue(agents_app.AGENTS[0], prompt="go", run_id=f"r{i}")
    proc = subprocess.Popen([sys.executable, "-m", "boundloop", "worker", target,
                             "--journal", str(journal), "--concurrency", "2"], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        t0 = time.monotonic()
        while time.monotonic() - t0 < 30:
            listed = cli(tmp_path, "runs", "--journal", str(journal), "--status", "final",
                         "--json")
            if listed.returncode == 0 and listed.stdout.count('"final"') == 5:
                break
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert "serving app" in err and "stopped" in err
    assert sorted((tmp_path / "effects.log").read_text().split()) == [f"r{i}" for i in range(5)]


@pytest.mark.parametrize("target, words", [
    ("nocolon", "MODULE:AGENTS"), ("missing_mod:AGENTS", "cannot import"),
    ("agents_app:NOPE", "has no 'NOPE'"), ("os:path", "not a bl.Agent"),
    ("agents_app:broken", "raised RuntimeError"), ("agents_app:NAMES", "not a bl.Agent"),
    ("syntax_err:AGENTS", "SyntaxError"),
])
def test_the_worker_command_refuses_bad_targets(tmp_path: Path, target: str,
                                                words: str) -> None:
    (tmp_path / "agents_app.py").write_text(APP)
    (tmp_path / "syntax_err.py").write_text("def (:\n")
    done = cli(tmp_path, "worker", target, "--journal", str(tmp_path / "j"))
    assert done.returncode == 2, done.stderr
    assert words in done.stderr and "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_aserve_serves_from_asyncio_and_stops(journal_dir: Path) -> None:
    ran: list[str] = []

    @bl.tool
    async def act(n: str) -> str:
        """Act (async)."""
        ran.append(n)
        return "ok"

    async def model(history: list[object], ctx: bl.ModelContext) -> object:
        await asyncio.sleep(0)
        if ctx.step == 1:
            return bl.CallTools([bl.ToolCall("c1", "act", {"n": ctx.run_id})])
        return bl.Final("done")

    agent = bl.Agent("async", model=model, tools=[act])
    with bl.Runner(journal_dir) as runner:
        runner.enqueue(agent, prompt="go", run_id="a1")
    worker = bl.Worker(journal_dir, [agent], poll_s=0.05)

    async def main() -> None:
        task = asyncio.create_task(worker.aserve())
        for _ in range(200):
            await asyncio.sleep(0.05)
            if worker.finished.get("a1") == "final":
                break
        worker.stop()
        await asyncio.wait_for(task, 30)

    asyncio.run(main())
    assert worker.finished == {"a1": "final"} and ran == ["a1"]


def test_a_worker_refuses_bad_configuration(journal_dir: Path) -> None:
    agent = bl.Agent("a", model=bl.ScriptedModel([bl.Final("x")]))
    for bad in ({"concurrency": 0}, {"grace_s": -1}, {"poll_s": "1"}):
        with pytest.raises(bl.ConfigError):
            bl.Worker(journal_dir, [agent], **bad)  # type: ignore[arg-type]
    with pytest.raises(bl.ConfigError, match="two agents"):
        bl.Worker(journal_dir, [agent, agent])
    with pytest.raises(bl.ConfigError):
        bl.Worker(journal_dir, [])
    with pytest.raises(bl.ConfigError):
        bl.Worker(journal_dir, ["a"])  # type: ignore[list-item]
    assert not journal_dir.exists()  # nothing opened before serve()


def test_max_running_holds_across_workers(journal_dir: Path) -> None:
    import threading

    lock = threading.Lock()
    active: set[str] = set()
    peak: list[int] = [0]

    def model(history: list[object], ctx: bl.ModelContext) -> object:
        with lock:
            active.add(ctx.run_id)
            peak[0] = max(peak[0], len(active))
        time.sleep(0.15)
        if ctx.step == 1:
            return bl.CallTools([bl.ToolCall("c1", "noop", {})])
        with lock:
            active.discard(ctx.run_id)
        return bl.Final("done")

    @bl.tool(read_only=True)
    def noop() -> str:
        """Nothing."""
        return "ok"

    agent = bl.Agent("capped", model=model, tools=[noop], max_running=2)
    with bl.Runner(journal_dir) as runner:
        for i in range(10):
            runner.enqueue(agent, prompt="go", run_id=f"c{i}")
    workers = [bl.Worker(journal_dir, [agent], concurrency=4, poll_s=0.02) for _ in range(3)]
    threads = [threading.Thread(target=w.serve) for w in workers]
    for t in threads:
        t.start()
    try:
        t0 = time.monotonic()
        while sum(len(w.finished) for w in workers) < 10 and time.monotonic() - t0 < 60:
            time.sleep(0.05)
    finally:
        for w in workers:
            w.stop()
        for t in threads:
            t.join(30)
    finished = {k: v for w in workers for k, v in w.finished.items()}
    assert finished == {f"c{i}": "final" for i in range(10)}
    assert 1 <= peak[0] <= 2, peak[0]


def test_a_damaged_queued_run_does_not_keep_a_worker_from_the_others(journal_dir: Path) -> None:
    from raw_journal import flip_first_record_byte

    agent = bl.Agent("a", model=bl.ScriptedModel([bl.Final("x")] * 3))
    with bl.Runner(journal_dir) as runner:
        for run_id in ("a-bad", "b1", "b2"):
            runner.enqueue(agent, prompt="go", run_id=run_id)
    flip_first_record_byte(journal_dir, "a-bad")
    worker = bl.Worker(journal_dir, [agent], poll_s=0.02)
    thread = __import__("threading").Thread(target=worker.serve)
    thread.start()
    try:
        t0 = time.monotonic()
        while len(worker.finished) < 2 and time.monotonic() - t0 < 20:
            time.sleep(0.05)
    finally:
        worker.stop()
        thread.join(20)
    assert worker.finished == {"b1": "final", "b2": "final"}
    assert worker.damaged == {"a-bad"}
