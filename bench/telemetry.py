"""What telemetry costs a W1 round: durable (fsync on) sequential runs of 5 tool rounds + final.

A W1 round is one round of ``bench/loop.py``'s sequential, fsync-on configuration: a scripted
model asks for one call of a no-op tool per step for ``--rounds`` steps, then answers Final;
``runner.run`` one run at a time. Configurations, each on a runner of its own opened once,
measured interleaved in one process (blocks of ``--runs`` runs, in the order A B C ..., then
... C B A, ``--reps`` times each; every run timed on its own):

    off         no telemetry at all (the supervisors are given none)
    api         ``bl.Telemetry()`` on the global providers, no SDK: the API's no-op
    sdk         SDK ``TracerProvider(SimpleSpanProcessor(InMemorySpanExporter))`` and
                ``MeterProvider(InMemoryMetricReader)``, every run traced
    batch       the same with a ``BatchSpanProcessor`` in front of the exporter
    sdk-inline  as ``sdk``, the projection done on the supervisor's thread right after each
                commit (the design before the projector thread, which projects while the
                journal syncs), measured against the shipped one
    metrics     the SDK's MeterProvider only (no tracer provider: no spans)
    sampled     as ``sdk``, spans sampled ``ParentBased(TraceIdRatioBased(0.1))``

The overhead is ``median(config) / median(off) - 1`` over all runs (target: under 3 % for
``sdk``), with a bootstrap interval, the same of the 10th percentiles (the runs other work on
the machine disturbed least) and a paired figure (each repetition's block against that
repetition's ``off`` block). Every block of the SDK configurations checks that each run's
spans were exported by the time ``run`` returned (12 per run for 5 rounds), and at the end
that every run was counted.

Then where the cost goes: the projection's CPU per event over the events of recorded W1 runs
(in the chunks the supervisor commits them in), warm and after the idle gap a durable commit
leaves between chunks, and the SDK's own price of one span and one histogram record.

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
from collections.abc import Callable, Iterable
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
from opentelemetry.trace import NoOpTracerProvider

from boundloop import events as ev
from boundloop.telemetry import Projection, Telemetry

sys.path.insert(0, str(Path(__file__).resolve().parent))
from loop import filesystem, make_model, noop  # noqa: E402  (bench/loop.py: the workload)

DEFAULTS = {"runs": 4, "rounds": 5, "reps": 60, "warmup": 10}
CONFIGS = ("off", "api", "sdk", "batch", "sdk-inline", "metrics", "sampled")
TARGET = 0.03  # issue #11: < 3 % of a W1 round with the SDK's in-memory exporter


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
                     if self.otel is not None else Telemetry())
        self.runner = bl.Runner(base / name, telemetry=telemetry)
        if name == "off":  # no telemetry at all: the supervisors and the journal get none
            for ref in self.runner._supervisors:
                actor = ref._actor_weakref()
                assert actor is not None
                actor.telemetry = None
            self.runner._journal.on_commit = None  # type: ignore[attr-defined]
        self.budget = bl.Budget(max_model_steps=rounds + 2, max_tool_calls=max(20, rounds))
        self.count = 0
        self.samples: list[float] = []  # µs per round, one per run
        self.blocks: list[float] = []  # µs per round, the median run of each block

    def run_one(self) -> bl.RunResult:
        self.count += 1
        result = self.runner.run(make_model(self.rounds), [noop], "go", budget=self.budget,
                                 run_id=f"{self.name}-{self.count}")
        if result.status != "final" or result.tool_calls != self.rounds:
            raise SystemExit(f"{self.name}: run ended {result.status}: {result.explanation}")
        return result

    def block(self, runs: int) -> None:
        if self.otel is not None:
            if self.name == "batch":
                self.otel.processor.force_flush()
            self.otel.exporter.clear()
        times = []
        for _ in range(runs):
            t0 = time.perf_counter()
            self.run_one()
            times.append(1e6 * (time.perf_counter() - t0) / self.rounds)
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


def per_call(fn: Callable[[], int], seconds: float = 1.0) -> float:
    """µs per item of ``fn`` (which returns the items it handled), best of 5 slices."""
    best = float("inf")
    for _ in range(5):
        handled, t0 = 0, time.perf_counter()
        deadline = t0 + seconds / 5
        while time.perf_counter() < deadline:
            handled += fn()
        best = min(best, 1e6 * (time.perf_counter() - t0) / handled)
    return best


def costs(recorded: list[tuple[str, list[list[ev.Event]]]]) -> dict[str, float]:
    total = sum(len(c) for _, chunks in recorded for c in chunks)
    out: dict[str, float] = {}
    quiet = Telemetry()  # global providers, no SDK

    def api() -> int:
        for run_id, chunks in recorded:
            for chunk in chunks:
                quiet.observe(run_id, chunk, model="scripted")
            quiet.release(run_id)
        return total

    out["no SDK: Telemetry.observe + release, per event"] = per_call(api)
    otel = Otel(batch=False)
    loud = otel.telemetry()
    serial = iter(range(10**9))

    def sdk(idle: float = 0.0) -> int:
        spent = 0.0
        for run_id, chunks in recorded:
            rid = f"{run_id}-{next(serial)}"
            for i, chunk in enumerate(chunks):
                if idle:
                    time.sleep(idle)
                t0 = time.perf_counter()
                loud.observe(rid, chunk, model="scripted")
                with loud._lock:  # as the projector or a run's release would, at once
                    loud._drain()
                if i == len(chunks) - 1:
                    loud.release(rid)
                spent += time.perf_counter() - t0
        otel.exporter.clear()
        timed.append(spent)
        return total

    timed: list[float] = []
    out["SDK: the projection (spans + metrics), per event, warm"] = per_call(sdk)
    timed.clear()
    for _ in range(20):
        sdk(0.0005)
    out["SDK: the same, each commit after a 0.5 ms idle gap"] = 1e6 * min(timed) / total

    tracer = otel.tracer_provider.get_tracer("bench")
    ctx = trace.set_span_in_context(tracer.start_span("root", context=Context()))
    attrs = {"gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": "noop",
             "gen_ai.tool.call.id": "c1", "boundloop.execution.id": "r:1:0",
             "boundloop.attempt": 1, "boundloop.run.id": "r", "boundloop.tool.outcome": "ok"}

    def span() -> int:
        for _ in range(100):
            tracer.start_span("execute_tool noop", context=ctx, attributes=attrs,
                              start_time=1).end(end_time=2)
        otel.exporter.clear()
        return 100

    out["SDK alone: one span, 7 attributes, start + end"] = per_call(span)
    hist = otel.meter_provider.get_meter("bench").create_histogram("bench")
    series = {"gen_ai.tool.name": "noop", "boundloop.tool.outcome": "ok"}

    def record() -> int:
        for _ in range(100):
            hist.record(0.001, series)
        return 100

    out["SDK alone: one histogram record, 2 attributes"] = per_call(record)
    otel.tracer_provider.shutdown()
    return out


def sdk_calls(recorded: list[tuple[str, list[list[ev.Event]]]]) -> tuple[float, float]:
    """(spans, histogram records) the projection makes of a recorded run, on average: what
    the SDK is asked to do for one W1 run whatever boundloop does around it."""
    otel = Otel(batch=False)
    telemetry = otel.telemetry()
    records = 0

    class Counting:
        def record(self, metric: Any, value: float, values: tuple[str, ...]) -> None:
            nonlocal records
            records += metric.kind == "histogram"

    projection = Projection(Counting(), otel.tracer_provider.get_tracer("bench"))
    for run_id, chunks in recorded:
        for chunk in chunks:
            projection.project(run_id, chunk, model="scripted")
        records += 2 * len(chunks)  # each commit: its latency and its batch size
    spans = len(otel.exporter.get_finished_spans())
    del telemetry
    otel.tracer_provider.shutdown()
    return spans / len(recorded), records / len(recorded)


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
        try:
            for c in configs:
                for _ in range(args.warmup):
                    c.run_one()
            for rep in range(args.reps):
                for c in configs if rep % 2 == 0 else configs[::-1]:
                    c.block(args.runs)
            for c in configs:
                if c.otel is not None:
                    c.runner.telemetry.flush()
                    if c.otel.runs_counted() != c.count:
                        raise SystemExit(f"{c.name}: {c.otel.runs_counted()} runs counted, "
                                         f"not {c.count}")
            off = configs[0]
            for i in range(1, 4):
                rid = f"off-{i}"
                recorded.append((rid, commit_chunks(list(off.runner.journal.events(rid)))))
        finally:
            for c in configs:
                c.close()

    off = configs[0]
    base, base10 = statistics.median(off.samples), p10(off.samples)
    rng = random.Random(11)
    header = (f"{'configuration':<12}{'µs/round':>10}{'p10':>8}{'overhead':>10}"
              f"{'95% interval':>18}{'at p10':>8}{'paired':>8}  verdict")
    print(header)
    print("-" * len(header))
    failed = False
    for c in configs:
        med = statistics.median(c.samples)
        line = f"{c.name:<12}{med:>10.1f}{p10(c.samples):>8.0f}"
        if c is not off:
            over = med / base - 1
            lo, hi = bootstrap(off.samples, c.samples, rng)
            paired = statistics.median(b / a for a, b in zip(off.blocks, c.blocks,
                                                              strict=True)) - 1
            line += (f"{over:>+10.1%}{f'[{lo:+.1%}, {hi:+.1%}]':>18}"
                     f"{p10(c.samples) / base10 - 1:>+8.1%}{paired:>+8.1%}")
            if c.otel is not None and c.name != "sdk-inline":
                ok = over < TARGET
                failed |= c.name == "sdk" and not ok
                line += f"  {'PASS' if ok else 'FAIL'} (< {TARGET:.0%})"
        print(line)
    print(f"({len(off.samples)} runs per configuration; overhead = median run / median run "
          f"off - 1, with its 95% bootstrap interval; at p10 = the same of the 10th "
          f"percentiles; paired = median over repetitions of block median / that "
          f"repetition's off block - 1)")
    print()
    events = sum(len(ch) for _, chunks in recorded for ch in chunks)
    print(f"where the cost goes ({events // len(recorded)} events and "
          f"{len(recorded[0][1])} commits a W1 run of {args.rounds} rounds):")
    found = costs(recorded)
    for what, us in found.items():
        print(f"  {what:<58}{us:>8.2f} µs")
    spans, records = sdk_calls(recorded)
    floor = (spans * found["SDK alone: one span, 7 attributes, start + end"]
             + records * found["SDK alone: one histogram record, 2 attributes"])
    print(f"  the SDK's own floor: {spans:.0f} spans + {records:.0f} histogram records a run "
          f"= {floor:.0f} µs = {floor / (base * args.rounds):.1%} of an off run")
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
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
