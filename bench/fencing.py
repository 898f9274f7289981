"""What ownership fencing (SPEC 6) costs: fenced against unfenced appends, in one run.

Every append of a run carries a ``Fence(owner, epoch)`` that the journal checks against the
run's index record in the same write transaction as the sequence. This benchmark appends the
same events to the same kind of journal with and without the fence, interleaved (A B A B,
``--reps`` times, medians), with fsync on and off, and prices the self-fencing check a runner
makes before each model call and attempt (``Runner.lease_ok``) against a whole W1 round
measured in the same run (bench/loop.py's sequential workload). Run:
``python bench/fencing.py`` (``--help``).
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import boundloop as bl  # noqa: E402
from boundloop import events as ev  # noqa: E402
from boundloop.journal.base import Fence  # noqa: E402
from boundloop.journal.lmdb import LmdbJournal  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import loop  # noqa: E402  (bench/loop.py: the W1 workload)


def appends(base: Path, *, fenced: bool, sync: bool, runs: int, per_run: int) -> float:
    """Seconds per append of one small event, on a fresh journal."""
    with tempfile.TemporaryDirectory(dir=base) as tmp:
        journal = LmdbJournal(Path(tmp) / "j", sync=sync)
        try:
            owner = "bench-owner"
            t0 = time.perf_counter()
            for r in range(runs):
                run_id = f"r{r}"
                journal.append(run_id, 0, [ev.RunAdmitted(
                    run_id=run_id, ts=0.0, budget=bl.Budget(), history=[], tools=[],
                    owner=owner)])
                fence = Fence(owner, 1) if fenced else None
                for seq in range(1, per_run + 1):
                    journal.append(run_id, seq, [ev.UsageCharged(
                        run_id=run_id, ts=float(seq), step=seq, usage=bl.Usage())], fence)
            return (time.perf_counter() - t0) / (runs * (per_run + 1))
        finally:
            journal.close()


def lease_checks(n: int) -> float:
    """Seconds per ``Runner.lease_ok`` call (the self-fencing check)."""
    with tempfile.TemporaryDirectory() as tmp, bl.Runner(Path(tmp) / "j") as runner:
        since = 0
        t0 = time.perf_counter()
        for _ in range(n):
            runner.lease_ok(since)
        return (time.perf_counter() - t0) / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--runs", type=int, default=40)
    ap.add_argument("--per-run", type=int, default=20)
    ap.add_argument("--dir", default=None, help="where the journals go (default: a temp dir)")
    a = ap.parse_args()
    base = Path(a.dir or tempfile.mkdtemp(prefix="boundloop-fencing-"))
    base.mkdir(parents=True, exist_ok=True)
    print(f"filesystem of {base}: {loop.filesystem(base)}")
    rows = []
    for sync in (True, False):
        on: list[float] = []
        off: list[float] = []
        for _ in range(a.reps):  # interleaved: A B A B
            off.append(appends(base, fenced=False, sync=sync, runs=a.runs, per_run=a.per_run))
            on.append(appends(base, fenced=True, sync=sync, runs=a.runs, per_run=a.per_run))
        f, u = statistics.median(on), statistics.median(off)
        rows.append((f"append, fsync {'on' if sync else 'off'}", u * 1e6, f * 1e6, f / u))
    check = lease_checks(200_000)
    elapsed, rounds = loop.measure(base, sync=True, inflight=1, runs=100, rounds=5, warmup=3)
    round_s = elapsed / rounds
    print(f"{'':28} {'unfenced µs':>12} {'fenced µs':>10} {'ratio':>7}")
    for name, u, f, ratio in rows:
        print(f"{name:28} {u:12.1f} {f:10.1f} {ratio:7.3f}")
    # Each round checks the lease before its model call and before its attempt.
    share = 2 * check / round_s
    print(f"self-fencing check: {check * 1e9:.0f} ns per call, 2 per round = "
          f"{share * 100:.4f} % of a W1 round ({round_s * 1e6:.0f} µs, fsync on, same run)")
    print("reproduce: python bench/fencing.py " + shlex.join(
        [f"--reps={a.reps}", f"--runs={a.runs}", f"--per-run={a.per_run}"]))


if __name__ == "__main__":
    main()
