"""boundloop against its targets and its peers, in one run: ``python bench/run.py``.

Every figure here is measured in this one process run (peers in their own virtualenvs, see
bench/peers/), so ratios compare like with like on a shared, noisy machine. Configurations
are interleaved (A B A B ...) and each figure is the median of ``--reps`` repetitions.

Workloads (bench/loop.py has the same): a run is a scripted model asking for one call of a
no-op tool per step for 5 steps, then a final answer. **W1**: 200 runs one after the other,
durable. **W2**: the same with 64 runs in flight. A *round* is one tool call decided,
journaled, dispatched and recorded.

It prints one table of figures (each with the command that reproduces it), the issue's
targets with pass/fail, writes ``bench/RESULTS.md`` and draws ``bench/results.svg``
(rounds/s against runs in flight, for boundloop and every peer; needs matplotlib, the
``bench`` extra). ``--quick`` is a smoke run (few runs, one repetition, no peers).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import platform
import resource
import shutil
import statistics
import sys
import tempfile
import threading
import time
import tracemalloc
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, wait
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import lmdb  # noqa: E402
import loop as w  # noqa: E402  (bench/loop.py: the workload)
import peers  # noqa: E402
import pykka  # noqa: E402

import boundloop as bl  # noqa: E402
from boundloop import events as ev  # noqa: E402
from boundloop._runner import starting as bl_starting  # noqa: E402
from boundloop.actors import workers as bl_workers  # noqa: E402
from boundloop.journal import chain, codec  # noqa: E402
from boundloop.journal import lmdb as bl_lmdb  # noqa: E402

SWEEP = (1, 4, 16, 64, 256)


# -- figures --------------------------------------------------------------------------------
@dataclass
class Figure:
    """One measured figure: median of its samples."""

    name: str
    unit: str
    command: str
    samples: list[float] = field(default_factory=list)
    note: str = ""

    @property
    def value(self) -> float:
        return statistics.median(self.samples) if self.samples else float("nan")


@dataclass
class Target:
    """One target of issue #12: ``value op bound``."""

    name: str
    value: float
    bound: float
    at_least: bool
    unit: str = ""
    #: The best value this machine allows, measured in the same run (see ``judge``).
    floor: float | None = None

    @property
    def ok(self) -> bool:
        return self.value >= self.bound if self.at_least else self.value <= self.bound


# -- the floor: what the disk allows ---------------------------------------------------------
def raw_fsync(base: Path, n: int) -> float:
    """fsyncs/s of a 64-byte append to one file."""
    path = base / "fsync.bin"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        t0 = time.perf_counter()
        for _ in range(n):
            os.write(fd, b"x" * 64)
            os.fsync(fd)
        return n / (time.perf_counter() - t0)
    finally:
        os.close(fd)
        path.unlink()


def lmdb_commits(base: Path, n: int, *, metasync: bool = True) -> float:
    """Sync commits/s of one small put per LMDB transaction (the ceiling of a journal)."""
    with tempfile.TemporaryDirectory(dir=base) as tmp:
        env = lmdb.open(tmp, map_size=1 << 28, sync=True, metasync=metasync)
        try:
            t0 = time.perf_counter()
            for i in range(n):
                with env.begin(write=True) as txn:
                    txn.put(i.to_bytes(8, "big"), b"x" * 200)
            return n / (time.perf_counter() - t0)
        finally:
            env.close()


def lmdb_round_commits(base: Path, n: int, records: list[int], index: int) -> float:
    """Sync commits/s of what one commit of a W1 run writes: ``records`` values of those
    sizes appended to one table, and an ``index``-byte record rewritten in another (the
    floor of a journal commit of that size, with no CPU of boundloop's around it)."""
    with tempfile.TemporaryDirectory(dir=base) as tmp:
        env = lmdb.open(tmp, map_size=1 << 28, sync=True, max_dbs=4)
        try:
            events, runs = env.open_db(b"events"), env.open_db(b"runs")
            payload = [os.urandom(size) for size in records]
            seq = 0
            t0 = time.perf_counter()
            for _ in range(n):
                with env.begin(write=True) as txn:
                    for value in payload:
                        seq += 1
                        txn.put(b"run\0" + seq.to_bytes(8, "big"), value, db=events,
                                append=True)
                    txn.put(b"run", os.urandom(index), db=runs)
            return n / (time.perf_counter() - t0)
        finally:
            env.close()


def w1_commit_shape(base: Path, rounds: int = 5) -> tuple[float, list[int], int]:
    """Of one W1 run as boundloop journals it: (commits per round, the sizes of the records
    one commit appends on average, the size of the run's index record)."""
    commits = 0
    with tempfile.TemporaryDirectory(dir=base) as tmp:
        with bl.Runner(Path(tmp) / "journal", sync=False) as runner:
            def counted(latency: float, appends: int) -> None:
                nonlocal commits
                commits += 1

            runner.run(model=w.make_model(rounds), tools=[w.noop], prompt="go",
                       budget=bl.Budget(max_model_steps=rounds + 2))
            runner.journal.on_commit = counted  # type: ignore[attr-defined]
            result = runner.run(model=w.make_model(rounds), tools=[w.noop], prompt="go",
                                budget=bl.Budget(max_model_steps=rounds + 2))
        env = lmdb.open(str(Path(tmp) / "journal"), readonly=True, lock=False, max_dbs=16)
        try:
            with env.begin() as txn:
                db = env.open_db(b"events", txn=txn, create=False)
                prefix = result.run_id.encode()
                sizes = [len(v) for k, v in txn.cursor(db=db) if k.startswith(prefix)]
                index = len(txn.get(prefix, db=env.open_db(b"runs", txn=txn, create=False))
                            or b"")
        finally:
            env.close()
    per_commit = max(1, round(len(sizes) / commits))
    mean = sum(sizes) // len(sizes)
    return commits / rounds, [mean] * per_commit, index


def hop_cpu_us(n: int) -> float:
    """CPU µs of one message between two pykka actors on their own threads (a tell and the
    receiver's wake-up), by ping-pong: the cost of any thread hand-off, before any work."""
    finished = threading.Event()

    class Pong(pykka.ThreadingActor):
        def __init__(self) -> None:
            super().__init__()
            self.peer: Any = None

        def on_receive(self, message: Any) -> None:
            if isinstance(message, pykka.ActorRef):
                self.peer = message
            elif message is None:
                return
            elif message == 0:
                finished.set()
            else:
                self.peer.tell(message - 1)

    a, b = Pong.start(), Pong.start()
    try:
        a.tell(b)
        b.tell(a)
        a.ask(None)  # both have their peer before the clock starts
        b.ask(None)
        cpu0 = time.process_time()
        a.tell(n)
        if not finished.wait(60):
            raise RuntimeError("the ping-pong of two actors did not finish in 60 s")
        return (time.process_time() - cpu0) / n * 1e6
    finally:
        a.stop()
        b.stop()


# -- counting hand-offs -----------------------------------------------------------------------
class HandOffs:
    """Counts messages that cross threads while installed: a tell/ask to an actor from
    another thread, a call handed to a model or tool pool, an append handed to the journal's
    writer thread, a caller waiting for admission (submit's backpressure), and a run's
    result handed back to the caller."""

    def __init__(self) -> None:
        self.count = 0
        self._homes: dict[str, int] = {}
        self._lock = threading.Lock()

    def _bump(self, n: int = 1) -> None:
        with self._lock:
            self.count += n

    @contextmanager
    def installed(self) -> Iterator[HandOffs]:
        ref = pykka.ActorRef
        actor = pykka.Actor
        pool = bl_workers.Pool
        journal = bl_lmdb.LmdbJournal
        runner = bl_starting.Starting
        saved = (ref.tell, ref.ask, actor._handle_receive, pool.submit, journal.submit,
                 runner._admit_slot)
        tell, ask, handle, submit, jsubmit, slot = saved
        homes, bump = self._homes, self._bump

        def counted_handle(self_: Any, message: Any) -> Any:
            homes[self_.actor_urn] = threading.get_ident()
            return handle(self_, message)

        def counted_tell(self_: Any, message: Any) -> None:
            if homes.get(self_.actor_urn) != threading.get_ident():
                bump()
            tell(self_, message)

        def counted_ask(self_: Any, message: Any, **kw: Any) -> Any:
            bump(2)  # there and back
            return ask(self_, message, **kw)

        def counted_submit(self_: Any, *a: Any, **kw: Any) -> Any:
            bump()
            return submit(self_, *a, **kw)

        def counted_jsubmit(self_: Any, *a: Any, **kw: Any) -> Any:
            bump()
            return jsubmit(self_, *a, **kw)

        def counted_slot(self_: Any) -> bool:
            # A caller that must wait for admission (submit's backpressure) is woken by it.
            if self_._admitting.acquire(blocking=False):
                return True  # a slot taken: _admitted gives it back
            bump()
            return slot(self_)

        ref.tell, ref.ask = counted_tell, counted_ask  # type: ignore[method-assign]
        runner._admit_slot = counted_slot  # type: ignore[method-assign]
        actor._handle_receive = counted_handle  # type: ignore[method-assign]
        pool.submit = counted_submit  # type: ignore[method-assign]
        journal.submit = counted_jsubmit  # type: ignore[method-assign]
        try:
            yield self
        finally:
            (ref.tell, ref.ask, actor._handle_receive, pool.submit, journal.submit,  # type: ignore[method-assign]
             runner._admit_slot) = saved  # type: ignore[method-assign]


# -- boundloop's loop --------------------------------------------------------------------------
def journal_bytes(path: Path) -> int:
    """Bytes of B-tree pages (branch, leaf, overflow) in every table of a journal."""
    env = lmdb.open(str(path), readonly=True, lock=False, max_dbs=16, subdir=True)
    try:
        total = 0
        with env.begin() as txn:
            for name, _ in txn.cursor():
                st = txn.stat(env.open_db(name, txn=txn, create=False))
                total += st["psize"] * (st["branch_pages"] + st["leaf_pages"]
                                        + st["overflow_pages"])
        return total
    finally:
        env.close()


def boundloop_loop(base: Path, *, sync: bool, inflight: int, runs: int, rounds: int = 5,
                   warmup: int = 5, keep: Path | None = None, count: bool = False,
                   compress: bool = False) -> dict[str, float]:
    """One measurement of W1 (inflight 1) or W2: rounds/s, CPU µs/round, p50/p99 run
    latency, hand-offs and voluntary context switches per round, page bytes per round."""
    budget = bl.Budget(max_model_steps=rounds + 2, max_tool_calls=max(20, rounds))
    tmp = Path(tempfile.mkdtemp(prefix="bl-", dir=base))
    path = keep or tmp / "journal"
    latencies: list[float] = []
    counter = HandOffs()
    try:
        with bl.Runner(path, sync=sync, max_in_flight=max(1000, inflight),
                       compress=compress) as runner:
            def start(i: int, tag: str = "run") -> Future[bl.RunResult]:
                # Run ids as the runner makes them (time-ordered), as an application would.
                return runner.submit(w.make_model(rounds), [w.noop], "go", budget=budget)

            for i in range(warmup):
                w.check(start(i, "warmup").result(), rounds)
            gc.collect()
            ru0 = resource.getrusage(resource.RUSAGE_SELF)
            cpu0, t0 = time.process_time(), time.perf_counter()
            with counter.installed() if count else _nothing():
                results = _drive(start, runs, inflight, latencies)
            elapsed = time.perf_counter() - t0
            cpu = time.process_time() - cpu0
            ru1 = resource.getrusage(resource.RUSAGE_SELF)
            for r in results:
                w.check(r, rounds)
        made = runs * rounds
        out = {"rounds_per_s": made / elapsed, "cpu_us_per_round": cpu / made * 1e6,
               "p50_ms": statistics.median(latencies) * 1e3,
               "p99_ms": _pct(latencies, 0.99) * 1e3,
               "vcsw_per_round": (ru1.ru_nvcsw - ru0.ru_nvcsw) / made,
               "bytes_per_round": journal_bytes(path) / ((runs + warmup) * rounds)}
        if count:
            out["handoffs_per_round"] = (counter.count + runs) / made  # + each result's
        return out
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@contextmanager
def _nothing() -> Iterator[None]:
    yield


def _drive(start: Callable[[int], Future[bl.RunResult]], runs: int, inflight: int,
           latencies: list[float]) -> list[bl.RunResult]:
    results: list[bl.RunResult] = []
    begun: dict[Future[bl.RunResult], float] = {}

    def go(i: int) -> Future[bl.RunResult]:
        f = start(i)
        begun[f] = time.perf_counter()
        return f

    if inflight == 1:
        for i in range(runs):
            f = go(i)
            results.append(f.result())
            latencies.append(time.perf_counter() - begun[f])
        return results
    nxt = min(inflight, runs)
    pending = {go(i) for i in range(nxt)}
    while pending:
        done, pending = wait(pending, return_when=FIRST_COMPLETED)
        now = time.perf_counter()
        for f in done:
            results.append(f.result())
            latencies.append(now - begun[f])
            if nxt < runs:
                pending.add(go(nxt))
                nxt += 1
    return results


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


# -- replay, recovery, memory ------------------------------------------------------------------
def _fold_nothing(state: Any, event: Any) -> Any:
    return state


def replay_ratio(path: Path) -> tuple[float, float, float]:
    """(events/s through bl.replay(journal.events(run)) for every run, events/s of a raw
    scan + decode of the same records, events/s of that scan + decode + the chain check
    every read makes (SPEC 6) + one empty Python call per event: the fastest a Python fold
    of checked records can be)."""
    env = lmdb.open(str(path), readonly=True, lock=False, max_dbs=16, subdir=True)
    try:
        with env.begin() as txn:
            db = env.open_db(b"events", txn=txn, create=False)
            t0 = time.perf_counter()
            n = 0
            for key, value in txn.cursor(db=db):
                codec.decode(bytes(value[chain.LINK_SIZE:]), key[:-9].decode())
                n += 1
            scan = n / (time.perf_counter() - t0)
            size, link = chain.LINK_SIZE, chain.link
            t0 = time.perf_counter()
            prev, state = b"", None
            for key, value in txn.cursor(db=db):
                body = bytes(value[size:])
                if link(prev, body) == value[:size]:  # never equal here: the cost is the point
                    prev = value[:size]
                state = _fold_nothing(state, codec.decode(body, key[:-9].decode()))
            floor = n / (time.perf_counter() - t0)
    finally:
        env.close()
    with bl.Runner(path, sync=False) as runner:
        ids = list(runner.journal.runs())
        t0 = time.perf_counter()
        m = 0
        for run_id in ids:
            events = list(runner.journal.events(run_id))
            bl.replay(events)
            m += len(events)
        folded = m / (time.perf_counter() - t0)
    return folded, scan, floor


def recovery_ms(base: Path, finished: int, open_runs: int) -> float:
    """Milliseconds of runner.recover() on a journal of ``finished`` finished runs and
    ``open_runs`` open ones whose owner is gone."""
    with tempfile.TemporaryDirectory(dir=base) as tmp:
        path = Path(tmp) / "journal"
        budget = bl.Budget()
        with bl.Runner(path, sync=False) as runner:
            journal = runner.journal
            batch: list[Any] = []
            waiting: list[threading.Event] = []

            def flush() -> None:
                flag = threading.Event()
                left = [len(batch)]

                def done(err: BaseException | None, flag: threading.Event = flag) -> None:
                    if err is not None:
                        raise SystemExit(f"building the recovery journal failed: {err}")
                    left[0] -= 1
                    if left[0] == 0:
                        flag.set()

                for r, evs in batch:
                    journal.submit(r, 0, evs, done)
                waiting.append(flag)
                batch.clear()

            for i in range(finished + open_runs):
                run_id = f"rec-{i:07d}"
                evs: list[ev.Event] = [ev.RunAdmitted(run_id=run_id, ts=1.0, budget=budget,
                                                      history=[], tools=[],
                                                      owner="gone-owner")]
                if i < finished:
                    evs.append(ev.RunFinished(run_id=run_id, ts=2.0, status="final",
                                              exhausted_limit=None, explanation="done",
                                              model_steps=1, tool_calls=0))
                batch.append((run_id, evs))
                if len(batch) == 1000:
                    flush()
            if batch:
                flush()
            for flag in waiting:
                flag.wait()
        with bl.Runner(path, sync=False) as runner:
            t0 = time.perf_counter()
            found = runner.recover()
            ms = (time.perf_counter() - t0) * 1e3
        if len(found) != open_runs:
            raise SystemExit(f"recover() found {len(found)} runs, not {open_runs}")
        return ms


def in_flight_memory(base: Path, n: int) -> tuple[float, int]:
    """(bytes of Python memory per run, threads added) with ``n`` runs of ``arun`` all
    waiting inside one async tool."""
    release = asyncio.Event()
    entered = [0]

    async def wait_here() -> str:
        """Waits until released."""
        entered[0] += 1
        await release.wait()
        return "ok"

    tool = bl.Tool("wait_here", wait_here, read_only=True)

    async def main() -> tuple[float, int]:
        with tempfile.TemporaryDirectory(dir=base) as tmp:
            async with bl.Runner(Path(tmp) / "journal", sync=False,
                                 max_in_flight=n + 10) as runner:
                model = bl.ScriptedModel([bl.CallTools([bl.ToolCall("c1", "wait_here", {})]),
                                          bl.Final("done")])
                await runner.arun(model=model, tools=[tool], prompt="warm", run_id="warm")
                release.clear()
                entered[0] = 0
                gc.collect()
                threads0 = threading.active_count()
                tracemalloc.start()
                before = tracemalloc.get_traced_memory()[0]
                tasks = [asyncio.ensure_future(runner.arun(
                    model=bl.ScriptedModel([bl.CallTools([bl.ToolCall("c1", "wait_here", {})]),
                                            bl.Final("done")]),
                    tools=[tool], prompt="go", run_id=f"m{i}")) for i in range(n)]
                deadline = time.monotonic() + 120
                while entered[0] < n and time.monotonic() < deadline:
                    await asyncio.sleep(0.01)
                gc.collect()
                during = tracemalloc.get_traced_memory()[0]
                threads = threading.active_count() - threads0
                tracemalloc.stop()
                release.set()
                results = await asyncio.gather(*tasks)
                if entered[0] < n or any(r.status != "final" for r in results):
                    raise SystemExit(f"only {entered[0]} of {n} runs reached the tool")
                return (during - before) / n, threads

    return asyncio.run(main())


# -- the whole run -------------------------------------------------------------------------------
def machine() -> str:
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return (f"{platform.node()}: nproc={cpus}, {platform.system()} {platform.release()} "
            f"{platform.machine()}, Python {platform.python_version()}, py-lmdb "
            f"{lmdb.__version__} (LMDB {'.'.join(map(str, lmdb.version()))}), journal "
            f"filesystem {w.filesystem(Path(tempfile.gettempdir()))}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=3, help="repetitions of each figure (median)")
    p.add_argument("--runs", type=int, default=200, help="runs per W1/W2 measurement")
    p.add_argument("--peer-runs", type=int, default=100,
                   help="runs per peer measurement (rounds/s is what is compared; peers "
                        "start in ~1-2 s and run at ~100-400 rounds/s here)")
    p.add_argument("--peers", default=",".join(peers.PEERS),
                   help="comma-separated peers to measure, or 'none'")
    p.add_argument("--no-sweep", action="store_true", help="skip the runs-in-flight sweep")
    p.add_argument("--recovery-runs", type=int, default=100_000)
    p.add_argument("--quick", action="store_true",
                   help="a smoke run: 20 runs, 1 repetition, no peers, small recovery")
    p.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    p.add_argument("--out", type=Path, default=HERE,
                   help="where RESULTS.md and results.svg go (default: bench/)")
    argv = sys.argv[1:] if argv is None else argv
    a = p.parse_args(argv)
    if a.quick:
        a.reps, a.runs, a.peers, a.no_sweep, a.recovery_runs = 1, 20, "none", True, 2000
        a.peer_runs = 20
    names = [] if a.peers == "none" else [x for x in a.peers.split(",") if x]
    base = Path(tempfile.mkdtemp(prefix="boundloop-bench-", dir=a.dir))
    started = time.monotonic()
    me = "python bench/run.py"
    figs: dict[str, Figure] = {}

    def fig(key: str, name: str, unit: str, command: str) -> Figure:
        return figs.setdefault(key, Figure(name, unit, command))

    def say(text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    try:
        commits_per_round, records, index = w1_commit_shape(base)
        figs["w1_commits"] = Figure("W1: journal commits per round", "", me,
                                    [commits_per_round])
        # The floor, then W1/W2 of boundloop and the peers, interleaved rep by rep.
        for rep in range(a.reps):
            say(f"repetition {rep + 1}/{a.reps}")
            fig("fsync", "raw fsync (64 B append)", "fsyncs/s",
                me).samples.append(raw_fsync(base, 300))
            fig("lmdb", "LMDB sync commit, one small put", "commits/s",
                me).samples.append(lmdb_commits(base, 300))
            fig("lmdb_nometa", "LMDB sync commit, metasync off", "commits/s",
                me).samples.append(lmdb_commits(base, 300, metasync=False))
            fig("lmdb_round", f"LMDB sync commit of a W1 commit's records ({len(records)} "
                f"of {records[0]} B, and a {index} B index record)", "commits/s",
                me).samples.append(lmdb_round_commits(base, 300, records, index))
            fig("hop", "CPU of one thread hand-off (a pykka tell between two actors' "
                "threads)", "µs", me).samples.append(hop_cpu_us(5000))
            for sync in (True, False):
                for inflight in (1, 64):
                    label = f"{'W1' if inflight == 1 else 'W2'} fsync {'on' if sync else 'off'}"
                    cmd = f"python bench/loop.py --runs {a.runs}"
                    r = boundloop_loop(base, sync=sync, inflight=inflight, runs=a.runs,
                                       count=(rep == 0))
                    key = f"bl_{inflight}_{sync}"
                    fig(key, f"boundloop {label}", "rounds/s", cmd).samples.append(
                        r["rounds_per_s"])
                    fig(key + "_cpu", f"boundloop {label}: CPU per round", "µs",
                        cmd).samples.append(r["cpu_us_per_round"])
                    fig(key + "_p50", f"boundloop {label}: run latency p50", "ms",
                        cmd).samples.append(r["p50_ms"])
                    fig(key + "_p99", f"boundloop {label}: run latency p99", "ms",
                        cmd).samples.append(r["p99_ms"])
                    fig(key + "_vcsw", f"boundloop {label}: thread wake-ups per round "
                        "(voluntary context switches)", "", cmd).samples.append(
                        r["vcsw_per_round"])
                    fig(key + "_bytes", f"boundloop {label}: journal pages per round", "B",
                        cmd).samples.append(r["bytes_per_round"])
                    if "handoffs_per_round" in r:
                        fig(key + "_hand", f"boundloop {label}: thread hand-offs per round",
                            "", cmd).samples.append(r["handoffs_per_round"])
                    # A peer right after boundloop, same workload (A B A B).
                    if sync:
                        for peer in names:
                            got = peers.measure(peer, runs=a.peer_runs, rounds=5,
                                                inflight=inflight, workdir=base)
                            f = fig(f"{peer}_{inflight}", f"{peer} {label[:2]}", "rounds/s",
                                    f"python bench/peers/{peer}_w.py --runs {a.peer_runs} "
                                    f"--inflight {inflight} --dir DIR (in its venv, see "
                                    "bench/peers/envs.py)")
                            if got.get("ok"):
                                f.samples.append(float(got["rounds_per_s"]))
                                f.note = str(got.get("mode", ""))
                                figs.setdefault(f"{peer}_{inflight}_cpu", Figure(
                                    f"{peer} {label[:2]}: CPU per round", "µs", f.command)
                                ).samples.append(float(got["cpu_s"]) / (a.peer_runs * 5) * 1e6)
                            else:
                                f.note = f"failed: {got.get('error')}"
            # The same W1 with the records stored compressed (Runner(compress=True)).
            cmd = f"python bench/loop.py --runs {a.runs} --compress"
            r = boundloop_loop(base, sync=True, inflight=1, runs=a.runs, compress=True)
            for suffix, what, unit, key in (("", "", "rounds/s", "rounds_per_s"),
                                            ("_cpu", ": CPU per round", "µs",
                                             "cpu_us_per_round"),
                                            ("_bytes", ": journal pages per round", "B",
                                             "bytes_per_round")):
                fig("bl_1_True_z" + suffix, f"boundloop W1 fsync on, compress=True{what}",
                    unit, cmd).samples.append(r[key])
        say("replay and recovery")
        keep = base / "replay-journal"
        boundloop_loop(base, sync=False, inflight=64, runs=max(a.runs, 200), keep=keep)
        for _ in range(a.reps):
            folded, scan, floor = replay_ratio(keep)
            fig("replay", "replay: bl.replay(journal.events(run)), every run", "events/s",
                me).samples.append(folded)
            fig("scan", "raw scan + decode of the same records", "events/s",
                me).samples.append(scan)
            fig("scan_floor", "... + the chain check of each record + an empty Python call "
                "per event", "events/s", me).samples.append(floor)
        n_open = 100
        fig("recover", f"recover() on {a.recovery_runs:,} finished + {n_open} open runs",
            "ms", me).samples.append(recovery_ms(base, a.recovery_runs, n_open))
        say("1,000 runs in flight in an async tool")
        per_run, threads = in_flight_memory(base, 1000)
        fig("mem", "1,000 runs in flight in an async tool: memory per run", "KB",
            me).samples.append(per_run / 1024)
        fig("threads", "... threads added for them", "", me).samples.append(threads)
        sweep: dict[str, dict[int, float]] = {}
        if not a.no_sweep:
            say("runs in flight sweep")
            for inflight in SWEEP:  # once each; every run ever in flight at once
                r = boundloop_loop(base, sync=True, inflight=inflight,
                                   runs=max(100, inflight))
                sweep.setdefault("boundloop", {})[inflight] = r["rounds_per_s"]
                for peer in names:
                    got = peers.measure(peer, runs=max(50, inflight), rounds=5,
                                        inflight=inflight, workdir=base)
                    if got.get("ok"):
                        sweep.setdefault(peer, {})[inflight] = float(got["rounds_per_s"])
        pg_rows = postgres_figures(a, say)
    finally:
        shutil.rmtree(base, ignore_errors=True)

    targets = judge(figs, names)
    text = report(figs, targets, pg_rows, time.monotonic() - started, a, argv)
    print(text)
    if not a.quick:
        (a.out / "RESULTS.md").write_text(text + "\n")
    if sweep:
        draw(sweep, a.out / "results.svg", say)
    return 0


def postgres_figures(a: argparse.Namespace, say: Callable[[str], None]) -> list[str]:
    """bench/postgres.py's figures (W1/W2 on PostgreSQL, ratio to LMDB, 1/2/4 workers),
    when it exists and PostgreSQL's server binaries are installed."""
    if a.quick:
        return ["PostgreSQL: skipped (--quick)"]
    try:
        import postgres as pg_bench  # bench/postgres.py
    except ImportError as exc:
        return [f"PostgreSQL: skipped (bench/postgres.py: {exc})"]
    say("PostgreSQL")
    try:
        rows = pg_bench.figures(reps=a.reps)
    except Exception as exc:  # noqa: BLE001 - a missing server is reported, not fatal
        return [f"PostgreSQL: skipped ({type(exc).__name__}: {exc})"]
    return [f"| {r['name']} | {r['value']:,.3g} {r.get('unit', '')} | `{r.get('command', '')}` |"
            for r in rows]


def judge(figs: dict[str, Figure], names: list[str]) -> list[Target]:
    def v(key: str) -> float:
        return figs[key].value if key in figs and figs[key].samples else float("nan")

    # Rounds/s of W1 if boundloop cost no CPU at all: its commits per round, each as fast as
    # LMDB commits the same records.
    zero_cpu = v("lmdb_round") / v("w1_commits")
    out = [Target("W1 / LMDB ceiling (sync commits/s)", v("bl_1_True") / v("lmdb"), 0.5, True,
                  floor=zero_cpu / v("lmdb")),
           Target("W1 fsync off: CPU per round", v("bl_1_False_cpu"), 120, False, "µs",
                  floor=4 * v("hop")),
           Target("W1: thread hand-offs per round", v("bl_1_False_hand"), 4, False),
           Target("W2 fsync on: CPU per round", v("bl_64_True_cpu"), 100, False, "µs"),
           Target("replay / raw scan + decode", v("replay") / v("scan"), 0.7, True,
                  floor=v("scan_floor") / v("scan")),
           Target("journal pages per round (W1)", v("bl_1_True_bytes"), 1500, False, "B"),
           Target("journal pages per round (W1, compress=True)", v("bl_1_True_z_bytes"), 1500,
                  False, "B"),
           Target("recover() on 100,000 + 100 runs", v("recover"), 100, False, "ms"),
           Target("1,000 in flight: memory per run", v("mem"), 30, False, "KB"),
           Target("1,000 in flight: threads added", v("threads"), 10, False)]
    if "langgraph" in names:
        out.insert(0, Target("W1 / LangGraph + SqliteSaver W1", v("bl_1_True") /
                             v("langgraph_1"), 3.0, True, "×",
                             floor=zero_cpu / v("langgraph_1")))
        out.insert(3, Target("W2 / LangGraph best concurrent W2", v("bl_64_True") /
                             v("langgraph_64"), 15.0, True, "×"))
    return out


def report(figs: dict[str, Figure], targets: list[Target], pg_rows: list[str],
           elapsed: float, a: argparse.Namespace, argv: list[str] | None) -> str:
    cmd = "python bench/run.py" + ("" if not argv else " " + " ".join(argv))
    lines = ["# boundloop benchmark results", "",
             f"Measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} in one run of "
             f"`{cmd}` ({elapsed:.0f} s), medians of {a.reps} interleaved repetitions.",
             f"Machine: {machine()}.", "",
             "## Targets (issue #12)", "",
             "*best possible*: the value if boundloop cost nothing but what the machine "
             "charges for the same work, measured in this run: for W1 rounds/s, its commits "
             "per round each as fast as LMDB commits the same records with no CPU around "
             "them; for CPU per round, four thread hand-offs and no work at all; for replay, "
             "the scan + decode with the chain check every read makes and a fold that does "
             "nothing.", "",
             "| target | measured | bound | best possible | |", "|---|---|---|---|---|"]
    for t in targets:
        op = "≥" if t.at_least else "≤"
        best = "" if t.floor is None else f"{t.floor:,.3g} {t.unit}"
        lines.append(f"| {t.name} | {t.value:,.3g} {t.unit} | {op} {t.bound:g} {t.unit} | "
                     f"{best} | {'pass' if t.ok else 'FAIL'} |")
    lines += ["", "## Figures", "", "| figure | median | samples | command | note |",
              "|---|---|---|---|---|"]
    for f in figs.values():
        samples = ", ".join(f"{s:,.4g}" for s in f.samples)
        lines.append(f"| {f.name} | {f.value:,.4g} {f.unit} | {samples} | `{f.command}` | "
                     f"{f.note} |")
    ratio = [("boundloop W1 / " + k.rsplit("_", 1)[0], figs["bl_1_True"].value / f.value)
             for k, f in figs.items() if k.endswith("_1") and f.samples and "bl_1_True" in figs]
    ratio += [("boundloop W2 / " + k.rsplit("_", 1)[0], figs["bl_64_True"].value / f.value)
              for k, f in figs.items() if k.endswith("_64") and f.samples
              and "bl_64_True" in figs]
    if ratio:
        lines += ["", "## Ratios (same run)", "", "| ratio | value |", "|---|---|"]
        lines += [f"| {name} | {value:.2f}× |" for name, value in ratio]
    lines += ["", "## PostgreSQL (bench/postgres.py)", ""]
    if pg_rows and pg_rows[0].startswith("|"):
        lines += ["| figure | value | command |", "|---|---|---|", *pg_rows]
    else:
        lines += pg_rows
    lines += ["", f"reproduce: `{cmd}`"]
    return "\n".join(lines)


def draw(sweep: dict[str, dict[int, float]], out: Path, say: Callable[[str], None]) -> None:
    try:
        import matplotlib
        matplotlib.use("svg")
        import matplotlib.pyplot as plt
    except ImportError:
        say("results.svg not drawn: matplotlib is missing (pip install '.[bench]')")
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, points in sweep.items():
        xs = sorted(points)
        ax.plot(xs, [points[x] for x in xs], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(list(SWEEP), [str(x) for x in SWEEP])
    ax.set_xlabel("runs in flight")
    ax.set_ylabel("durable tool rounds per second")
    ax.set_title("W1/W2 workload, fsync on (bench/run.py)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out)
    say(f"wrote {out}")


if __name__ == "__main__":
    sys.exit(main())
