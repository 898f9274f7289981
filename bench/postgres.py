"""The PostgreSQL journal (SPEC 12) against LMDB, in one run, and workers sharing a database.

W1 is bench/loop.py's sequential workload (``--runs`` runs one at a time, each ``--rounds``
rounds of one no-op tool call and then Final), W2 the same with ``--inflight`` runs in
flight; both durable (LMDB fsync on; PostgreSQL ``synchronous_commit=on``, server fsync on).
Each is measured on PostgreSQL and on LMDB interleaved (A B A B, ``--reps`` times, each on
a fresh database or journal directory), and the medians and their ratio are printed. Then
1, 2 and 4 worker processes share one fresh database, each running its share of ``--mp-runs``
runs with Runner.submit (``--mp-inflight`` in flight in each): the rounds/s of them all,
timed from one start signal (given once every process has its Runner open and warm) to the
last run's end.

The script starts its own PostgreSQL server on loopback (``tests/pg_server.py``: initdb into
a temporary directory, ``fsync=on``, ``synchronous_commit=on``), next to the LMDB journals
(both in ``--dir``'s filesystem, the temp dir by default), and stops it at the end; without
the server binaries it says which is missing and exits 2. ``figures()`` returns the rows for
bench/run.py. Run: ``python bench/postgres.py`` (``--help``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))

import loop  # noqa: E402  (bench/loop.py: the W1/W2 workload)
from pg_server import Missing, PgServer  # noqa: E402  (tests/pg_server.py)

import boundloop as bl  # noqa: E402

DEFAULTS: dict[str, Any] = {"runs": 200, "rounds": 5, "inflight": 64, "reps": 3, "warmup": 5,
                            "mp_runs": 384, "mp_inflight": 16, "procs": "1,2,4"}


def _measure(journal: str, *, inflight: int, runs: int, rounds: int,
             warmup: int) -> tuple[float, int]:
    """bench/loop.py's measurement, durable, on ``journal`` (a URL or a directory)."""
    with tempfile.TemporaryDirectory(prefix="boundloop-bench-pg-") as tmp:
        return loop.measure(Path(tmp), sync=True, inflight=inflight, runs=runs, rounds=rounds,
                            warmup=warmup, journal=journal)


def _fresh(server: PgServer) -> str:
    return server.create_database("bench_" + uuid.uuid4().hex[:12])


def _drop(server: PgServer, url: str) -> None:
    import psycopg

    name = url.rsplit("/", 1)[1]
    with psycopg.connect(server.url(), autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def workloads(server: PgServer, base: Path, *, runs: int, rounds: int, inflight: int,
              reps: int, warmup: int,
              out: Callable[[str], None] = print) -> dict[tuple[str, str], float]:
    """Median rounds/s of W1 and W2 on each backend: {(workload, backend): rounds/s}."""
    rates: dict[tuple[str, str], list[float]] = {}
    for name, n in (("W1", 1), ("W2", inflight)):
        for rep in range(reps):
            for backend in ("postgresql", "lmdb"):  # interleaved: A B A B
                if backend == "postgresql":
                    url = _fresh(server)
                    try:
                        seconds, made = _measure(url, inflight=n, runs=runs, rounds=rounds,
                                                 warmup=warmup)
                    finally:
                        _drop(server, url)
                else:
                    with tempfile.TemporaryDirectory(prefix="boundloop-bench-",
                                                     dir=base) as tmp:
                        seconds, made = _measure(str(Path(tmp) / "journal"), inflight=n,
                                                 runs=runs, rounds=rounds, warmup=warmup)
                rates.setdefault((name, backend), []).append(made / seconds)
                out(f"  {name} rep {rep + 1}/{reps} {backend:<10} {made / seconds:8.0f} "
                    "rounds/s")
    return {k: statistics.median(v) for k, v in rates.items()}


# -- worker processes sharing one database ------------------------------------------------
def _worker(url: str, runs: int, prefix: str, inflight: int, rounds: int) -> None:
    """One process of the shared-database measurement: open, warm up, say ready, wait for
    "go" on stdin, run its share, print its rounds."""
    budget = bl.Budget(max_model_steps=rounds + 2, max_tool_calls=max(20, rounds))
    with bl.Runner(url, max_in_flight=max(1000, inflight)) as runner:
        def start(i: int, tag: str = prefix) -> Future[bl.RunResult]:
            return runner.submit(loop.make_model(rounds), [loop.noop], "go", budget=budget,
                                 run_id=f"{tag}-{i}")

        for i in range(3):
            loop.check(start(i, prefix + "-warmup").result(), rounds)
        print("ready", flush=True)
        if sys.stdin.readline().strip() != "go":
            return
        results = loop.windowed(start, runs, inflight)
        for r in results:
            loop.check(r, rounds)
        print(json.dumps({"rounds": sum(r.tool_calls for r in results)}), flush=True)


def shared(server: PgServer, procs: int, *, runs: int, inflight: int,
           rounds: int) -> tuple[float, int]:
    """Seconds and rounds for ``procs`` processes sharing one fresh database, ``runs`` runs
    in all."""
    url = _fresh(server)
    shares = [runs // procs + (i < runs % procs) for i in range(procs)]
    children = [subprocess.Popen([sys.executable, __file__, "--worker", url, str(n), f"p{i}",
                                  str(inflight), str(rounds)],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                for i, n in enumerate(shares)]
    try:
        for child in children:
            assert child.stdout is not None
            if child.stdout.readline().strip() != "ready":
                raise RuntimeError("a bench worker process failed to start")
        t0 = time.perf_counter()
        for child in children:
            assert child.stdin is not None
            child.stdin.write("go\n")
            child.stdin.flush()
        made = 0
        for child in children:
            assert child.stdout is not None
            made += json.loads(child.stdout.readline())["rounds"]
        elapsed = time.perf_counter() - t0
        for child in children:
            child.wait(timeout=60)
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
                child.wait()
        _drop(server, url)
    return elapsed, made


def command(args: dict[str, Any]) -> str:
    extra = [f"--{k.replace('_', '-')} {v}" for k, v in args.items()
             if k in DEFAULTS and v != DEFAULTS[k]]
    return " ".join(["python bench/postgres.py", *extra])


def figures(runs: int = DEFAULTS["runs"], rounds: int = DEFAULTS["rounds"],
            inflight: int = DEFAULTS["inflight"], reps: int = DEFAULTS["reps"],
            warmup: int = DEFAULTS["warmup"], mp_runs: int = DEFAULTS["mp_runs"],
            mp_inflight: int = DEFAULTS["mp_inflight"], procs: str = DEFAULTS["procs"],
            base: Path | None = None,
            out: Callable[[str], None] = lambda s: None) -> list[dict[str, Any]]:
    """The figures, one dict per row: ``name``, ``value``, ``unit``, ``command`` (the line
    that reproduces it). Starts and stops its own PostgreSQL server.

    Raises:
        pg_server.Missing: a PostgreSQL server binary is not installed (the message names it).
    """
    settings = {"runs": runs, "rounds": rounds, "inflight": inflight, "reps": reps,
                "warmup": warmup, "mp_runs": mp_runs, "mp_inflight": mp_inflight,
                "procs": procs}
    cmd = command(settings)
    base = base or Path(tempfile.gettempdir())
    server = PgServer().start()
    rows: list[dict[str, Any]] = []
    try:
        rates = workloads(server, base, runs=runs, rounds=rounds, inflight=inflight,
                          reps=reps, warmup=warmup, out=out)
        for name, what in (("W1", "sequential"), ("W2", f"{inflight} in flight")):
            pg, lm = rates[name, "postgresql"], rates[name, "lmdb"]
            rows += [
                {"name": f"{name} ({what}, durable), PostgreSQL", "value": round(pg),
                 "unit": "rounds/s", "command": cmd},
                {"name": f"{name} ({what}, durable), LMDB, same run", "value": round(lm),
                 "unit": "rounds/s", "command": cmd},
                {"name": f"{name} PostgreSQL / LMDB", "value": round(pg / lm, 2),
                 "unit": "x", "command": cmd}]
        for n in (int(p) for p in procs.split(",")):
            got = []
            for rep in range(reps):
                seconds, made = shared(server, n, runs=mp_runs, inflight=mp_inflight,
                                       rounds=rounds)
                got.append(made / seconds)
                out(f"  {n} process(es) rep {rep + 1}/{reps} {made / seconds:8.0f} rounds/s")
            rows.append({"name": f"PostgreSQL, {n} worker process(es) sharing one database "
                                 f"({mp_inflight} in flight each)",
                         "value": round(statistics.median(got)), "unit": "rounds/s",
                         "command": cmd})
    finally:
        server.stop()
    return rows


def machine(base: Path) -> str:
    import psycopg
    from pg_server import find_binaries

    version = subprocess.run([find_binaries()["postgres"], "--version"], capture_output=True,
                             text=True).stdout.strip()
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else "?"
    return (f"machine: nproc={affinity} (cpu_count={os.cpu_count()}), {platform.system()} "
            f"{platform.release()}, Python {platform.python_version()}, psycopg "
            f"{psycopg.__version__}, {version} on loopback, journals and server data on "
            f"{loop.filesystem(base)}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        url, runs, prefix, inflight, rounds = argv[1:6]
        _worker(url, int(runs), prefix, int(inflight), int(rounds))
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=DEFAULTS["runs"],
                   help="runs per W1/W2 measure")
    p.add_argument("--rounds", type=int, default=DEFAULTS["rounds"],
                   help="tool rounds per run")
    p.add_argument("--inflight", type=int, default=DEFAULTS["inflight"],
                   help="W2's runs in flight")
    p.add_argument("--reps", type=int, default=DEFAULTS["reps"], help="repetitions (medians)")
    p.add_argument("--warmup", type=int, default=DEFAULTS["warmup"], help="untimed runs first")
    p.add_argument("--mp-runs", type=int, default=DEFAULTS["mp_runs"],
                   help="runs in all, shared by the worker processes")
    p.add_argument("--mp-inflight", type=int, default=DEFAULTS["mp_inflight"],
                   help="runs in flight in each worker process")
    p.add_argument("--procs", default=DEFAULTS["procs"], help="worker process counts")
    p.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()),
                   help="where the LMDB journals go (default: the temp dir)")
    a = p.parse_args(argv)
    settings = {k: getattr(a, k) for k in DEFAULTS}
    try:
        info = machine(a.dir)
        rows = figures(**settings, base=a.dir, out=print)
    except Missing as exc:
        print(f"bench/postgres.py: {exc}", file=sys.stderr)
        return 2
    width = max(len(r["name"]) for r in rows)
    print()
    for r in rows:
        print(f"{r['name']:<{width}}  {r['value']:>8} {r['unit']}")
    print()
    print(info)
    extra = f" --dir {shlex.quote(str(a.dir))}" if a.dir != Path(tempfile.gettempdir()) else ""
    print("reproduce: " + command(settings) + extra)
    return 0


if __name__ == "__main__":
    sys.exit(main())
