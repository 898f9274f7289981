"""Durable tool rounds per second, one run at a time and many in flight, fsync on and off.

A round is one tool call decided, journaled, dispatched and recorded. Each run is a scripted
model that asks for one call of a no-op tool per step for ``--rounds`` steps, then answers
Final, under ``Budget(max_model_steps=rounds + 2)`` (7 for the default 5 rounds). Four
configurations, each on a fresh journal directory, in one process:

    sequential   one run at a time (runner.run)
    in flight    --inflight runs at once (runner.submit, a window refilled as runs end)
    ... each with the journal's fsync on (the default) and off (Runner(path, sync=False)),

so the cost of durability shows as a ratio. Run: ``python bench/loop.py`` (``--help``).
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, wait
from pathlib import Path

import lmdb

import boundloop as bl

DEFAULTS = {"runs": 200, "rounds": 5, "inflight": 64, "warmup": 5}


@bl.tool(read_only=True, idempotent=True)
def noop() -> None:
    """Does nothing."""


def make_model(rounds: int) -> bl.ScriptedModel:
    return bl.ScriptedModel(
        [bl.CallTools([bl.ToolCall(f"c{i}", "noop", {})]) for i in range(rounds)]
        + [bl.Final("done")])


def check(result: bl.RunResult, rounds: int) -> None:
    if result.status != "final" or result.tool_calls != rounds:
        raise SystemExit(f"run {result.run_id} ended {result.status} with {result.tool_calls} "
                         f"tool calls, not final with {rounds}: {result.explanation}")


def sequential(start: Callable[[int], Future[bl.RunResult]],
               runs: int) -> list[bl.RunResult]:
    return [start(i).result() for i in range(runs)]


def windowed(start: Callable[[int], Future[bl.RunResult]], runs: int,
             inflight: int) -> list[bl.RunResult]:
    results: list[bl.RunResult] = []
    next_run = min(inflight, runs)
    pending = {start(i) for i in range(next_run)}
    while pending:
        done, pending = wait(pending, return_when=FIRST_COMPLETED)
        for f in done:
            results.append(f.result())
            if next_run < runs:
                pending.add(start(next_run))
                next_run += 1
    return results


def measure(base: Path, *, sync: bool, inflight: int, runs: int, rounds: int,
            warmup: int, journal: str | None = None,
            compress: bool = False) -> tuple[float, int]:
    """Seconds for ``runs`` runs and the tool rounds they made, on a fresh LMDB journal
    under ``base`` (or on ``journal``, a path or a postgresql:// URL, when given), its
    records stored compressed when ``compress``."""
    budget = bl.Budget(max_model_steps=rounds + 2, max_tool_calls=max(20, rounds))
    with tempfile.TemporaryDirectory(prefix="boundloop-bench-", dir=base) as tmp, \
            bl.Runner(journal or Path(tmp) / "journal", sync=sync, compress=compress,
                      max_in_flight=max(1000, inflight)) as runner:
        def start(i: int, tag: str = "run") -> Future[bl.RunResult]:
            return runner.submit(make_model(rounds), [noop], "go", budget=budget,
                                 run_id=f"{tag}-{i}")

        for i in range(warmup):  # threads and pages warm, not timed
            check(start(i, "warmup").result(), rounds)
        t0 = time.perf_counter()
        results = sequential(start, runs) if inflight == 1 else windowed(start, runs, inflight)
        elapsed = time.perf_counter() - t0
        for r in results:
            check(r, rounds)
        # The journal holds what the results say: replay one run and compare.
        last = results[-1]
        state = bl.replay(runner.journal.events(last.run_id))
        assert (state.status, state.tool_calls) == (last.status, last.tool_calls)
    return elapsed, sum(r.tool_calls for r in results)


def filesystem(path: Path) -> str:
    """The type of the filesystem holding ``path`` (fsync means little on tmpfs)."""
    best, fstype = "", "unknown"
    try:
        with open("/proc/mounts") as f:
            for line in f:
                _, mount, kind, *_ = line.split()
                if str(path.resolve()).startswith(mount) and len(mount) > len(best):
                    best, fstype = mount, kind
    except OSError:
        pass
    return f"{fstype} ({best or path})"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=DEFAULTS["runs"], help="runs per configuration")
    p.add_argument("--rounds", type=int, default=DEFAULTS["rounds"], help="tool rounds per run")
    p.add_argument("--inflight", type=int, default=DEFAULTS["inflight"],
                   help="runs in flight at once in the concurrent configurations")
    p.add_argument("--warmup", type=int, default=DEFAULTS["warmup"],
                   help="untimed runs before each measurement")
    p.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()),
                   help="where the temporary journal directories go (default: the temp dir)")
    p.add_argument("--compress", action="store_true",
                   help="store the journal's records compressed (Runner(compress=True))")
    args = p.parse_args(argv)
    if args.runs < 1 or args.rounds < 1 or args.inflight < 1 or args.warmup < 0:
        p.error("--runs, --rounds and --inflight must be at least 1, --warmup at least 0")

    print(f"boundloop: durable tool rounds/s, {args.runs} runs x {args.rounds} rounds, "
          f"no-op tool, scripted model{', records compressed' if args.compress else ''}")
    header = (f"{'configuration':<14}{'in flight':>10}{'fsync':>7}{'rounds':>8}"
              f"{'seconds':>9}{'rounds/s':>10}{'ms/round':>10}")
    print(header)
    print("-" * len(header))
    rate: dict[tuple[int, bool], float] = {}
    for sync in (True, False):
        for inflight in (1, args.inflight):
            seconds, made = measure(args.dir, sync=sync, inflight=inflight, runs=args.runs,
                                    rounds=args.rounds, warmup=args.warmup,
                                    compress=args.compress)
            rate[inflight, sync] = made / seconds
            name = "sequential" if inflight == 1 else "in flight"
            print(f"{name:<14}{inflight:>10}{'on' if sync else 'off':>7}{made:>8}"
                  f"{seconds:>9.2f}{made / seconds:>10.0f}{1000 * seconds / made:>10.2f}",
                  flush=True)
    print()
    n = args.inflight
    print(f"cost of durability (rounds/s fsync off / on): sequential "
          f"{rate[1, False] / rate[1, True]:.1f}x, {n} in flight "
          f"{rate[n, False] / rate[n, True]:.1f}x")
    print(f"gain from concurrency ({n} in flight / sequential): fsync on "
          f"{rate[n, True] / rate[1, True]:.1f}x, fsync off {rate[n, False] / rate[1, False]:.1f}x")
    print()
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else "?"
    print(f"machine: nproc={affinity} (cpu_count={os.cpu_count()}), {platform.system()} "
          f"{platform.release()} {platform.machine()}, Python {platform.python_version()}, "
          f"py-lmdb {lmdb.__version__} (LMDB {'.'.join(map(str, lmdb.version()))}), "
          f"journal filesystem {filesystem(args.dir)}")
    extra = [f"--{k} {getattr(args, k)}" for k, v in DEFAULTS.items() if getattr(args, k) != v]
    if args.dir != Path(tempfile.gettempdir()):
        extra.append(f"--dir {shlex.quote(str(args.dir))}")
    if args.compress:
        extra.append("--compress")
    print("reproduce: " + " ".join(["python bench/loop.py", *extra]))


if __name__ == "__main__":
    sys.exit(main())
