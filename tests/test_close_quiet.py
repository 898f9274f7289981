"""Closing a runner with timed-out async calls still pending prints nothing (issue 11: it
printed a CancelledError traceback per call and "Task was destroyed but it is pending!")."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path


def test_close_with_timed_out_async_calls_is_quiet(tmp_path: Path) -> None:
    script = textwrap.dedent("""
        import asyncio, sys
        import boundloop as bl

        @bl.tool(timeout_s=0.05)
        async def hang() -> str:
            await asyncio.sleep(30)
            return "late"

        import threading
        entered = threading.Event()

        async def model(history, ctx):
            entered.set()
            await asyncio.sleep(30)

        r = bl.Runner(sys.argv[1])
        res = r.run(model=bl.ScriptedModel([bl.CallTools([bl.ToolCall("a", "hang", {}),
                                                          bl.ToolCall("b", "hang", {})]),
                                            bl.Final("d")]), tools=[hang], prompt="p")
        f = r.submit(model=model, prompt="p")
        entered.wait(10)
        r.close(timeout=0.5)
        print(res.status, type(f.exception()).__name__)
    """)
    proc = subprocess.run([sys.executable, "-c", script, str(tmp_path / "j")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["final", "RunnerClosed"]
    assert proc.stderr == ""
