"""What telemetry costs a W1 round: durable (fsync on) sequential runs of 5 tool rounds + final.

A W1 round is one round of ``bench/loop.py``'s sequential, fsync-on configuration: a scripted
model asks for one call of a no-op tool per step for ``--rounds`` steps, then answers Final;
``runner.run`` one run at a time. Configurations, each on a runner of its own opened once,
measured interleaved in one process (blocks of ``--runs`` runs, in the order A B C ..., then
... C B A, ``--reps`` times each; every run timed on its own):

    off         no telemetry at all (the supervisors are given none)
    floor       no boundloop telemetry; the bench itself asks the SDK (the same providers as
                ``sdk``) for the very spans and histogram records ``sdk`` makes of a run: the
                same names, kinds, parents, attributes, times and statuses, replayed from a
                recording, each commit's share right after that commit, on the thread that
                committed (where ``sdk-inline`` projects): what the SDK itself costs a round
    api         ``bl.Telemetry()`` on the global providers, no SDK: the API's no-op
    sdk         SDK ``TracerProvider(SimpleSpanProcessor(InMemorySpanExporter))`` and
                ``MeterProvider(InMemoryMetricReader)``, every run traced
    batch       the same with a ``BatchSpanProcessor`` in front of the exporter
    sdk-inline  as ``sdk``, the projection done on the supervisor's thread right after each
                commit (the design before the projector thread, which projects while the
                journal syncs), measured against the shipped one
    metrics     the SDK's MeterProvider only (no tracer provider: no spans)
    sampled     as ``sdk``, spans sampled ``ParentBased(TraceIdRatioBased(0.1))``

The overhead is ``median(config) / median(off) - 1`` over all runs, with a bootstrap interval,
the same of the 10th percentiles (the runs other work on the machine disturbed least) and a
paired figure (each repetition's block against that repetition's ``off`` block); next to it,
the process CPU (all threads) a round. The target (issue #23): boundloop's own share of
``sdk``, its overhead beyond ``floor``'s, under 3 % of a round, both in wall time and in
process CPU (``floor`` pays its SDK calls where they happen, on the committing thread, while
``sdk`` makes most of them on its projector thread as the journal syncs: CPU judges the work
wherever it runs). Every block of the SDK configurations checks that each run's
spans were exported by the time ``run`` returned (12 per run for 5 rounds), and at the end
that every run was counted.

Then where the cost goes, out of the loop: the thread CPU of boundloop's telemetry over the
events of recorded W1 runs (in the chunks the supervisor commits them in), as the runner
drives it, and of the SDK alone replaying those runs' spans and records (the floor), passes
of each in turn, warm and after the idle gap a durable commit leaves between chunks. Counter
additions are not in the floor (boundloop sums them and adds each series once a second: what
that costs counts as boundloop's).

Run: ``python bench/telemetry.py`` (``--help``); about a minute.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

try:
    import boundloop as bl
except ImportError:  # run from a checkout without installing it
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import boundloop as bl

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import NonRecordingSpan, NoOpTracerProvider

from boundloop import events as ev
from boundloop.telemetry import Projection, Telemetry
from boundloop.telemetry import names as n
from boundloop.telemetry._telemetry import WAKE_AT, instruments, meter

sys.path.insert(0, str(Path(__file__).resolve().parent))
from loop import filesystem, make_model, noop  # noqa: E402  (bench/loop.py: the workload)

DEFAULTS = {"runs": 4, "rounds": 5, "reps": 60, "warmup": 10}
CONFIGS = ("off", "floor", "api", "sdk", "batch", "sdk-inline", "metrics", "sampled")
TARGET = 0.03  # issue #23: boundloop's share beyond the SDK's own, < 3 % of a W1 round


class Inline(Telemetry):
    """The projection on the observing thread (the supervisor's), right after each commit:
    the design before the projector thread, measured against it."""

    def observe(self, run_id: str, events: Iterable[ev.Event], *, model: Any = None,
                state: Any = None) -> None:
        super().observe(run_id, events, model=model, state=state)
        with self._lock:
            self._drain()

    def before_sync(self) -> None:
        pass


class Otel:
    """SDK providers with in-memory exporters (not the global ones: ``api`` stays a no-op)."""

    def __init__(self, batch: bool, sampled: bool = False) -> None:
        self.exporter = InMemorySpanExporter()
        self.tracer_provider = TracerProvider(
            sampler=ParentBased(TraceIdRatioBased(0.1)) if sampled else None)
        self.processor = (BatchSpanProcessor(self.exporter) if batch
                          else SimpleSpanProcessor(self.exporter))
        self.tracer_provider.add_span_processor(self.processor)
        self.reader = InMemoryMetricReader()
        self.meter_provider = MeterProvider(metric_readers=[self.reader])

    def telemetry(self, kind: type[Telemetry] = Telemetry, spans: bool = True) -> Telemetry:
        return kind(tracer_provider=self.tracer_provider if spans else NoOpTracerProvider(),
                    meter_provider=self.meter_provider)

    def runs_counted(self) -> float:
        data = self.reader.get_metrics_data()
        return sum(p.value for rm in (data.resource_metrics if data else ())
                   for sm in rm.scope_metrics for m in sm.metrics
                   if m.name == "boundloop.runs" for p in m.data.data_points)


class _Recording:
    """A metric sink that keeps what it is given (the projection's observations)."""

    def __init__(self) -> None:
        self.seen: list[tuple[n.Metric, float, tuple[str, ...]]] = []

    def record(self, metric: n.Metric, value: float, values: tuple[str, ...]) -> None:
        self.seen.append((metric, value, values))


#: One span as the SDK is asked for it: name, parent context, kind, attributes, start, end,
#: status (None: unset)
SpanCall = tuple[str, Context, Any, dict[str, Any], int, int, Any]
#: One histogram record: instrument name, value, attributes (None: recorded without any)
RecordCall = tuple[str, float, dict[str, str] | None]


class Replay:
    """The SDK calls ``sdk`` makes of one W1 run, commit by commit, to make again directly.

    Recorded by projecting a run's events (as the supervisor commits them) with a real
    tracer and a recording sink: per commit, the spans that ended (made here in one go, at
    their end; the SDK's work is the same) and the histogram records, with the attribute
    dicts ``OtelMetrics`` gives the SDK. Counter additions are left out (see the module's
    docstring). ``commit`` replays the next commit's share and records the commit's latency
    and size, as ``Telemetry.journal_commit`` has them recorded."""

    def __init__(self, chunks: list[list[ev.Event]], model: Any) -> None:
        scratch = Otel(batch=False)
        sink = _Recording()
        projection = Projection(sink, scratch.tracer_provider.get_tracer(n.SCOPE))
        self.program: list[tuple[list[SpanCall], list[RecordCall]]] = []
        made = 0
        for chunk in chunks:
            del sink.seen[:]
            projection.project("replayed", chunk, model=model)
            finished = scratch.exporter.get_finished_spans()[made:]
            made += len(finished)
            spans: list[SpanCall] = []
            for sp in finished:
                parent = (trace.set_span_in_context(NonRecordingSpan(sp.parent))
                          if sp.parent is not None else Context())
                status = sp.status if not sp.status.is_unset else None
                assert sp.start_time is not None and sp.end_time is not None
                spans.append((sp.name, parent, sp.kind, dict(sp.attributes or {}),
                              sp.start_time, sp.end_time, status))
            records: list[RecordCall] = [
                (m.name, value, {k: v for k, v in zip(m.attributes, values, strict=True) if v}
                 if m.attributes else None)
                for m, value, values in sink.seen if m.kind == "histogram"]
            self.program.append((spans, records))
        scratch.tracer_provider.shutdown()
        self.spans = sum(len(sp) for sp, _ in self.program)
        self.records = sum(len(r) for _, r in self.program) + 2 * len(self.program)
        self.tracer: Any = None
        self.instruments: dict[str, Any] = {}
        self.at = 0
        self.errors: list[BaseException] = []

    def on(self, otel: Otel) -> Replay:
        """This replay, making its calls on ``otel``'s providers (boundloop's scope and
        instruments, as ``sdk`` makes them)."""
        self.tracer = otel.tracer_provider.get_tracer(n.SCOPE)
        self.instruments = instruments(meter(otel.meter_provider))
        return self

    def play(self, index: int) -> None:
        """Make commit ``index``'s spans and records."""
        spans, records = self.program[index]
        start = self.tracer.start_span
        for name, parent, kind, attrs, t0, t1, status in spans:
            span = start(name, context=parent, kind=kind, attributes=attrs, start_time=t0)
            if status is not None:
                span.set_status(status)
            span.end(end_time=t1)
        made = self.instruments
        for name, value, attrs in records:
            if attrs is None:
                made[name](value)
            else:
                made[name](value, attrs)

    def start_run(self) -> None:
        self.at = 0

    def commit(self, latency_s: float, batch_size: int) -> None:
        """The journal's ``on_commit``: this commit's share (errors kept: the journal drops
        them)."""
        try:
            made = self.instruments
            made[n.COMMIT_LATENCY.name](latency_s)
            made[n.COMMIT_BATCH.name](batch_size)
            self.play(self.at)
            self.at += 1
        except BaseException as exc:  # noqa: BLE001 - reported by end_run
            self.errors.append(exc)

    def end_run(self) -> None:
        if self.errors:
            raise SystemExit(f"floor: replay failed: {self.errors[0]!r}")
        if self.at != len(self.program):
            raise SystemExit(f"floor: a run committed {self.at} times, not "
                             f"{len(self.program)}: the replay does not match the run")


class Config:
    """One configuration: its runner (opened once) and, for the SDK ones, its providers."""

    def __init__(self, name: str, base: Path, rounds: int) -> None:
        self.name = name
        self.rounds = rounds
        self.otel = (Otel(batch=name == "batch", sampled=name == "sampled")
                     if name not in ("off", "api") else None)
        self.spans = name not in ("metrics", "sampled")  # every run's spans to check
        telemetry = (self.otel.telemetry(Inline if name == "sdk-inline" else Telemetry,
                                         spans=name != "metrics")
                     if self.otel is not None and name != "floor" else Telemetry())
        self.runner = bl.Runner(base / name, telemetry=telemetry)
        if name in ("off", "floor"):  # no boundloop telemetry: supervisors, executor, journal
            for ref in (*self.runner._supervisors, self.runner._executor):
                actor = ref._actor_weakref()
                assert actor is not None
                actor.telemetry = None
            journal: Any = self.runner._journal
            journal.on_commit = journal.before_sync = None
        #: ``floor``: the SDK calls of one run, by commit (see ``Replay``), set by ``main``
        self.replay: Replay | None = None
        self.budget = bl.Budget(max_model_steps=rounds + 2, max_tool_calls=max(20, rounds))
        self.count = 0
        self.samples: list[float] = []  # µs per round, one per run
        self.blocks: list[float] = []  # µs per round, the median run of each block
        self.cpu: list[float] = []  # process CPU µs per round (all threads), one per block

    def replaying(self, replay: Replay) -> None:
        """``floor``: after each commit, the SDK makes what ``sdk`` makes of that commit."""
        assert self.otel is not None
        self.replay = replay.on(self.otel)
        journal: Any = self.runner._journal
        journal.on_commit = self.replay.commit

    def run_one(self) -> bl.RunResult:
        self.count += 1
        if self.replay is not None:
            self.replay.start_run()
        result = self.runner.run(make_model(self.rounds), [noop], "go", budget=self.budget,
                                 run_id=f"{self.name}-{self.count}")
        if result.status != "final" or result.tool_calls != self.rounds:
            raise SystemExit(f"{self.name}: run ended {result.status}: {result.explanation}")
        if self.replay is not None:
            self.replay.end_run()
        return result

    def block(self, runs: int) -> None:
        if self.otel is not None:
            if self.name == "batch":
                self.otel.processor.force_flush()
            self.otel.exporter.clear()
        times = []
        cpu0 = time.process_time()
        for _ in range(runs):
            t0 = time.perf_counter()
            self.run_one()
            times.append(1e6 * (time.perf_counter() - t0) / self.rounds)
        self.cpu.append(1e6 * (time.process_time() - cpu0) / (runs * self.rounds))
        self.samples.extend(times)
        self.blocks.append(statistics.median(times))
        if self.otel is not None and self.spans:  # every run's spans, out when run() returned
            if self.name == "batch":
                self.otel.processor.force_flush()
            spans = self.otel.exporter.get_finished_spans()
            want = runs * (1 + (self.rounds + 1) + self.rounds)
            if len(spans) != want:
                raise SystemExit(f"{self.name}: {len(spans)} spans exported, not {want}")

    def close(self) -> None:
        self.runner.close()
        if self.otel is not None:
            self.otel.tracer_provider.shutdown()


# -- where the cost goes ---------------------------------------------------------------------
def commit_chunks(events: list[ev.Event]) -> list[list[ev.Event]]:
    """A run's events in the chunks the supervisor commits them in (a commit ends with
    RunAdmitted, CallDispatched or RunFinished)."""
    chunks: list[list[ev.Event]] = [[]]
    for e in events:
        chunks[-1].append(e)
        if isinstance(e, ev.RunAdmitted | ev.CallDispatched | ev.RunFinished):
            chunks.append([])
    return [c for c in chunks if c]


def costs(recorded: list[tuple[str, list[list[ev.Event]]]], model: Any,
          passes: int = 300) -> dict[str, tuple[float, float]]:
    """Thread CPU µs per run of the recorded runs, (10th percentile, median) over ``passes``
    passes: boundloop's telemetry as the runner drives it (link, each commit's figures and
    events, release) and, alternating with it, the SDK alone replaying the same spans and
    records (``Replay``); warm, then with each commit after the idle gap of a durable commit.
    Thread CPU leaves out the time other work on the machine takes the core."""
    runs = len(recorded)
    clock = time.thread_time
    out: dict[str, tuple[float, float]] = {}
    quiet = Telemetry()  # global providers, no SDK
    otel = Otel(batch=False)
    loud = otel.telemetry()
    # Providers of their own: boundloop's tracer gives span ids (see _links.install)
    alone = Otel(batch=False)
    replays = [Replay(chunks, model).on(alone) for _, chunks in recorded]
    serial = iter(range(10**9))

    def api(idle: float) -> None:
        for run_id, chunks in recorded:
            quiet.link(run_id)
            for chunk in chunks:
                quiet.journal_commit(0.001, 1)
                quiet.observe(run_id, chunk, model=model)
            quiet.release(run_id)

    def sdk(idle: float) -> None:
        for run_id, chunks in recorded:
            rid = f"{run_id}-{next(serial)}"
            loud.link(rid)
            for chunk in chunks:
                if idle:
                    time.sleep(idle)
                loud.journal_commit(0.001, 1)
                loud.observe(rid, chunk, model=model)
                if len(loud._pending) >= WAKE_AT:  # as the projector would, at once
                    with loud._lock:
                        loud._drain()
            loud.release(rid)  # what waits (a W1 run's every commit) is projected here
        otel.exporter.clear()

    def floor(idle: float) -> None:
        for replay in replays:
            replay.start_run()
            for _ in replay.program:
                if idle:
                    time.sleep(idle)
                replay.commit(0.001, 1)
            replay.end_run()
        alone.exporter.clear()

    for gap, idle, count in (("warm", 0.0, passes),
                             ("cold", 0.0005, passes // 5)):
        spent: dict[str, list[float]] = {"no SDK": [], "boundloop + SDK": [],
                                         "SDK alone (the floor)": []}
        for _ in range(count):
            for name, fn in (("no SDK", api), ("boundloop + SDK", sdk),
                             ("SDK alone (the floor)", floor)):
                t0 = clock()
                fn(idle)
                spent[name].append(1e6 * (clock() - t0) / runs)
        for name, times in spent.items():
            out[f"{name}, {gap}"] = (p10(times), statistics.median(times))
        own = [b - f for b, f in zip(spent["boundloop + SDK"], spent["SDK alone (the floor)"],
                                     strict=True)]
        out[f"boundloop's own (the difference), {gap}"] = (p10(own), statistics.median(own))
    otel.tracer_provider.shutdown()
    alone.tracer_provider.shutdown()
    return out


def paired(off: Config, c: Config) -> float:
    """Median over repetitions of ``c``'s block / that repetition's ``off`` block - 1."""
    return statistics.median(b / a for a, b in zip(off.blocks, c.blocks, strict=True)) - 1


def p10(samples: list[float]) -> float:
    return statistics.quantiles(samples, n=10)[0]


def bootstrap(off: list[float], on: list[float], rng: random.Random,
              rounds: int = 400) -> tuple[float, float]:
    """A 95 % bootstrap interval of median(on) / median(off) - 1."""
    ratios = sorted(statistics.median(rng.choices(on, k=len(on)))
                    / statistics.median(rng.choices(off, k=len(off))) - 1
                    for _ in range(rounds))
    return ratios[int(0.025 * rounds)], ratios[int(0.975 * rounds) - 1]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=DEFAULTS["runs"], help="runs per block")
    p.add_argument("--rounds", type=int, default=DEFAULTS["rounds"], help="tool rounds per run")
    p.add_argument("--reps", type=int, default=DEFAULTS["reps"],
                   help="blocks per configuration (at least 3)")
    p.add_argument("--warmup", type=int, default=DEFAULTS["warmup"],
                   help="untimed runs per configuration first")
    p.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()),
                   help="where the temporary journal directories go (default: the temp dir)")
    args = p.parse_args(argv)
    if args.runs < 1 or args.rounds < 1 or args.reps < 3 or args.warmup < 0:
        p.error("--runs and --rounds must be at least 1, --reps at least 3, --warmup >= 0")

    print(f"boundloop telemetry: W1 rounds (sequential, fsync on, {args.rounds} no-op tool "
          f"rounds + final), {args.reps} interleaved blocks of {args.runs} runs per "
          f"configuration", flush=True)
    started = time.perf_counter()
    recorded: list[tuple[str, list[list[ev.Event]]]] = []
    with tempfile.TemporaryDirectory(prefix="boundloop-bench-tel-", dir=args.dir) as tmp:
        configs = [Config(name, Path(tmp), args.rounds) for name in CONFIGS]
        off = configs[0]
        try:
            for c in configs:
                if c.name == "floor":  # the SDK calls of a W1 run, recorded from off's
                    if off.count == 0:
                        off.run_one()
                    model = make_model(args.rounds)
                    c.replaying(Replay(commit_chunks(list(off.runner.journal.events("off-1"))),
                                       model))
                for _ in range(args.warmup):
                    c.run_one()
            for rep in range(args.reps):
                for c in configs if rep % 2 == 0 else configs[::-1]:
                    c.block(args.runs)
            for c in configs:
                if c.otel is not None and c.replay is None:
                    c.runner.telemetry.flush()
                    if c.otel.runs_counted() != c.count:
                        raise SystemExit(f"{c.name}: {c.otel.runs_counted()} runs counted, "
                                         f"not {c.count}")
            for i in range(1, 4):
                rid = f"off-{i}"
                recorded.append((rid, commit_chunks(list(off.runner.journal.events(rid)))))
        finally:
            for c in configs:
                c.close()

    base, base10 = statistics.median(off.samples), p10(off.samples)
    base_cpu = statistics.median(off.cpu)
    rng = random.Random(11)
    header = (f"{'configuration':<12}{'µs/round':>10}{'p10':>8}{'overhead':>10}"
              f"{'95% interval':>18}{'at p10':>8}{'paired':>8}{'CPU µs':>9}{'CPU +':>8}")
    print(header)
    print("-" * len(header))
    by_name = {c.name: c for c in configs}
    for c in configs:
        med = statistics.median(c.samples)
        line = f"{c.name:<12}{med:>10.1f}{p10(c.samples):>8.0f}"
        cpu = statistics.median(c.cpu)
        if c is off:
            line += f"{'':>52}{cpu:>9.0f}"
        else:
            over = med / base - 1
            lo, hi = bootstrap(off.samples, c.samples, rng)
            line += (f"{over:>+10.1%}{f'[{lo:+.1%}, {hi:+.1%}]':>18}"
                     f"{p10(c.samples) / base10 - 1:>+8.1%}{paired(off, c):>+8.1%}"
                     f"{cpu:>9.0f}{cpu - base_cpu:>+8.0f}")
        print(line)
    print(f"({len(off.samples)} runs per configuration; overhead = median run / median run "
          f"off - 1, with its 95% bootstrap interval; at p10 = the same of the 10th "
          f"percentiles; paired = median over repetitions of block median / that "
          f"repetition's off block - 1; CPU = process CPU, all threads, µs a round, the "
          f"median block's, and its excess over off's)")
    sdk, floor_c = by_name["sdk"], by_name["floor"]
    share = (statistics.median(sdk.samples) - statistics.median(floor_c.samples)) / base
    share_paired = statistics.median(
        (b - f) / a for a, b, f in zip(off.blocks, sdk.blocks, floor_c.blocks, strict=True))
    share_cpu = (statistics.median(sdk.cpu) - statistics.median(floor_c.cpu)) / base
    cpu_paired = statistics.median(
        (b - f) / base for b, f in zip(sdk.cpu, floor_c.cpu, strict=True))
    # floor makes its SDK calls on the committing thread, where sdk-inline projects, while
    # sdk projects mostly on its projector as the journal syncs: in wall time floor is the
    # inline price, so the same share is also judged in CPU, which does not depend on where
    # the work runs (the projector's wake-ups and hand-offs are boundloop's CPU too).
    ok_wall, ok_cpu = share < TARGET, share_cpu < TARGET
    ok = ok_wall and ok_cpu
    print(f"boundloop's own share of a round, sdk beyond floor (in off rounds): wall "
          f"{share:+.1%} (paired {share_paired:+.1%}) {'PASS' if ok_wall else 'FAIL'}; "
          f"CPU {share_cpu:+.1%} (paired {cpu_paired:+.1%}) {'PASS' if ok_cpu else 'FAIL'} "
          f"(target < {TARGET:.0%})")
    print()
    events = sum(len(ch) for _, chunks in recorded for ch in chunks)
    replay = Replay(recorded[0][1], make_model(args.rounds))
    print(f"where the cost goes, out of the loop ({events // len(recorded)} events, "
          f"{len(recorded[0][1])} commits, {replay.spans} spans and {replay.records} "
          f"histogram records a W1 run of {args.rounds} rounds; an off run "
          f"{base * args.rounds:.0f} µs):")
    found = costs(recorded, make_model(args.rounds))
    print(f"  {'thread CPU, µs a run (cold: each commit after a 0.5 ms idle gap)':<66}"
          f"{'p10':>8}{'median':>8}{'of an off run':>15}")
    for what, (low, mid) in found.items():
        print(f"  {what:<66}{low:>8.1f}{mid:>8.1f}{mid / (base * args.rounds):>15.1%}")
    print()
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else "?"
    print(f"machine: nproc={affinity} (cpu_count={os.cpu_count()}), {platform.system()} "
          f"{platform.release()} {platform.machine()}, Python {platform.python_version()}, "
          f"journal filesystem {filesystem(args.dir)}")
    print(f"took {time.perf_counter() - started:.0f} s; load average "
          f"{' '.join(f'{x:.1f}' for x in os.getloadavg())} (other work on the machine "
          f"widens the intervals)")
    extra = [f"--{k} {getattr(args, k)}" for k, v in DEFAULTS.items() if getattr(args, k) != v]
    if args.dir != Path(tempfile.gettempdir()):
        extra.append(f"--dir {args.dir}")
    print("reproduce: " + " ".join(["python bench/telemetry.py", *extra]))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
