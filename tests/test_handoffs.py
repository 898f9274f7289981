"""The hand-offs of a W1 round (bench/run.py's count: pykka tells and asks across threads,
pool submits, journal submits, each result handed to its caller) stay what issue #21 made
them: a plain tool attempt goes from the supervisor to the thread that runs it and back,
never through the executor's inbox; a run's admission costs one tell there and one on.
A count, not a timing: it does not depend on speed."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench" / "run.py"


def _bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("boundloop_bench_run", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(120)
def test_a_w1_round_takes_no_hop_through_the_executor(tmp_path: Path) -> None:
    bench = _bench()
    got = bench.boundloop_loop(tmp_path, sync=False, inflight=1, runs=20, warmup=2,
                               count=True)
    # Per run of 5 rounds: 6 model calls there and back (12), 5 tool attempts there and
    # back (10), the Admit told to admission, the StartRun it hands on, and the result (3).
    # Admission is not asked (the caller waits on the Future anyway) and a run's end frees
    # its slot without a message.
    assert got["handoffs_per_round"] <= (12 + 10 + 3) / 5, got


def test_a_finished_call_is_not_kept_alive_by_its_timers(tmp_path: Path) -> None:
    """The fast path's timers (the attempt's timeout, the run's deadline) are never
    cancelled: once a call is done they must not hold its batch, or a worker would keep
    every result of the last ``timeout_s`` in memory (found by an attack: 100 MB kept)."""
    import gc

    import boundloop as bl
    from boundloop.actors import executor

    @bl.tool(timeout_s=600.0)
    def big(n: int) -> str:
        return "y" * 100_000

    with bl.Runner(tmp_path / "j") as runner:
        model = bl.ScriptedModel([bl.CallTools([bl.ToolCall(f"c{k}", "big", {"n": k})])
                                  for k in range(5)] + [bl.Final("ok")])
        result = runner.run(model=model, tools=[big], prompt="go",
                            budget=bl.Budget(max_model_steps=7, max_tool_calls=5,
                                             deadline_s=600.0))
        assert (result.status, result.tool_calls) == ("final", 5)
        assert [m.status for m in result.transcript if m.kind == "tool_result"] == ["ok"] * 5
        del result, model
        gc.collect()
        kept = [o for o in gc.get_objects() if isinstance(o, executor._Batch)]
        assert kept == [], f"{len(kept)} finished batches still alive"
