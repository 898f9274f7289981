"""What every peer script shares: its command line, the run window, the figures, the JSON line.

Standard library only, so each peer's venv can import it (the scripts put this folder on
``sys.path`` by being run from it). A peer script supplies one function that performs run
number ``i`` (sync or async) and returns the run's final answer; this module runs the
warm-up, then times ``--runs`` runs with ``--inflight`` of them in flight at once (a window
refilled as runs end: ``inflight`` workers each taking the next run number), and prints one
JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

FINAL = "done"


def parse_args(description: str,
               extra: Callable[[argparse.ArgumentParser], None] | None = None
               ) -> argparse.Namespace:
    """The shared command line (``--runs --rounds --inflight --dir --warmup``) plus ``extra``."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--runs", type=int, default=200, help="timed runs")
    p.add_argument("--rounds", type=int, default=5, help="tool rounds per run")
    p.add_argument("--inflight", type=int, default=1, help="runs in flight at once")
    p.add_argument("--dir", type=Path, required=True,
                   help="a fresh directory for this measurement's database files")
    p.add_argument("--warmup", type=int, default=5, help="untimed runs before the timed ones")
    if extra is not None:
        extra(p)
    args = p.parse_args()
    if args.runs < 1 or args.rounds < 1 or args.inflight < 1 or args.warmup < 0:
        p.error("--runs, --rounds and --inflight must be at least 1, --warmup at least 0")
    args.dir.mkdir(parents=True, exist_ok=True)
    return args


def fail(message: str) -> NoReturn:
    """Stop with ``message`` on stderr and a non-zero exit status."""
    print(f"FAILED: {message}", file=sys.stderr, flush=True)
    raise SystemExit(1)


class Counter:
    """A thread-safe count of tool executions."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.value = 0

    def hit(self) -> None:
        with self._lock:
            self.value += 1


@dataclass
class Timing:
    """What one timed batch of runs measured."""

    elapsed_s: float
    cpu_s: float
    latencies_s: list[float] = field(default_factory=list)
    answers: list[str] = field(default_factory=list)


def _run_ids(tag: str, n: int) -> list[str]:
    return [f"{tag}-{i}" for i in range(n)]


def drive_sync(run_one: Callable[[str], str], run_ids: list[str], inflight: int) -> Timing:
    """Run ``run_one`` for each id, ``inflight`` at once on threads (in this thread if 1)."""
    latencies: list[float] = [0.0] * len(run_ids)
    answers: list[str] = [""] * len(run_ids)
    errors: list[BaseException] = []
    take = itertools.count()

    def worker() -> None:
        while not errors:
            i = next(take)  # atomic under the GIL
            if i >= len(run_ids):
                return
            t = time.perf_counter()
            try:
                answers[i] = run_one(run_ids[i])
            except BaseException as e:  # re-raised after the join
                errors.append(e)
                return
            latencies[i] = time.perf_counter() - t

    c0, t0 = time.process_time(), time.perf_counter()
    if inflight == 1:
        worker()
    else:
        threads = [threading.Thread(target=worker, daemon=True)
                   for _ in range(min(inflight, len(run_ids)))]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
    if errors:
        raise errors[0]
    return Timing(elapsed, cpu, latencies, answers)


async def drive_async(run_one: Callable[[str], Awaitable[str]], run_ids: list[str],
                      inflight: int) -> Timing:
    """Await ``run_one`` for each id, ``inflight`` at once as asyncio tasks on this loop."""
    latencies: list[float] = [0.0] * len(run_ids)
    answers: list[str] = [""] * len(run_ids)
    take = itertools.count()

    async def worker() -> None:
        while (i := next(take)) < len(run_ids):
            t = time.perf_counter()
            answers[i] = await run_one(run_ids[i])
            latencies[i] = time.perf_counter() - t

    c0, t0 = time.process_time(), time.perf_counter()
    if inflight == 1:
        await worker()
    else:
        async with asyncio.TaskGroup() as tg:
            for _ in range(min(inflight, len(run_ids))):
                tg.create_task(worker())
    return Timing(time.perf_counter() - t0, time.process_time() - c0, latencies, answers)


def warmup_ids(args: argparse.Namespace) -> list[str]:
    """The ids of the untimed warm-up runs."""
    return _run_ids("warmup", args.warmup)


def timed_ids(args: argparse.Namespace) -> list[str]:
    """The ids of the timed runs."""
    return _run_ids("run", args.runs)


def check(args: argparse.Namespace, timing: Timing, tool_calls: int,
          warmup: Timing | None = None) -> None:
    """Fail unless every run answered ``done`` and the tool ran ``rounds`` times per run."""
    answers = timing.answers + (warmup.answers if warmup else [])
    wrong = [a for a in answers if a != FINAL]
    if wrong:
        fail(f"{len(wrong)} of {len(answers)} runs did not answer {FINAL!r}: {wrong[:3]!r}")
    expected = (args.runs + args.warmup) * args.rounds
    if tool_calls != expected:
        fail(f"the tool ran {tool_calls} times, expected {expected} "
             f"(({args.runs} + {args.warmup} warm-up runs) x {args.rounds} rounds)")


def _percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile ``q`` (0..100) of already sorted values."""
    rank = max(1, math.ceil(q / 100 * len(sorted_values)))
    return sorted_values[rank - 1]


def report(args: argparse.Namespace, *, peer: str, version: str, mode: str, timing: Timing,
           **extra: Any) -> None:
    """Print the one JSON line of results on stdout."""
    lat = sorted(timing.latencies_s)
    rounds = args.runs * args.rounds
    line = {
        "peer": peer, "version": version, "mode": mode, "runs": args.runs,
        "rounds": args.rounds, "inflight": args.inflight,
        "elapsed_s": round(timing.elapsed_s, 4),
        "rounds_per_s": round(rounds / timing.elapsed_s, 1),
        "p50_ms": round(1000 * _percentile(lat, 50), 3),
        "p99_ms": round(1000 * _percentile(lat, 99), 3),
        "cpu_s": round(timing.cpu_s, 4),
        **extra,
        "ok": True,
    }
    print(json.dumps(line), flush=True)
