"""The ``boundloop`` command: a thin layer over the library (SPEC 10).

Every command reads the journal from ``--journal DIR``, else ``$BOUNDLOOP_JOURNAL``, else
``./.boundloop``. The work is done by :mod:`boundloop.ops` (and the Runner); this module
only parses arguments and prints. ``click`` and ``rich`` are imported here, never by
``import boundloop``.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, NoReturn, TypeVar

import click

from boundloop._text import money
from boundloop._version import __version__
from boundloop.errors import BoundloopError, JournalError, JournalUnavailable, UnknownRun

EXIT_OK = 0
#: ``replay`` found the fold disagreeing with RunFinished, or ``--check`` found a divergence.
EXIT_MISMATCH = 1
#: Bad input: an unknown command or option, a bad duration or limit.
EXIT_USAGE = 2
#: No run with that id in the journal.
EXIT_UNKNOWN_RUN = 3
#: The journal is missing, locked, unreadable or damaged.
EXIT_JOURNAL = 4
#: What to run about runs listed as damaged: the records themselves, or how they follow.
_DAMAGE_HINT = ("`boundloop verify` checks their records, `boundloop replay RUN_ID` how "
                "they follow")
#: A bug in boundloop (the message says how to see the traceback).
EXIT_INTERNAL = 70

EXIT_CODES = (
    "Exit codes: 0 ok; 1 replay found a mismatch, --check a divergence, or verify a damaged "
    "run; 2 bad input; "
    "3 unknown run id; 4 journal missing, locked, unreadable or damaged (stats: after its "
    "figures); 70 internal error."
)

F = TypeVar("F", bound=Callable[..., Any])


def journal_dir(value: str | None) -> str:
    """``--journal`` (the command's, else the group's), else ``$BOUNDLOOP_JOURNAL``, else
    ``./.boundloop``."""
    from boundloop.ops import journal_dir as resolve

    if value is None:
        ctx = click.get_current_context(silent=True)
        root = ctx.find_root() if ctx is not None else None
        if root is not None and isinstance(root.obj, dict):
            value = root.obj.get("journal")
    return resolve(value)


journal_option = click.option(
    "--journal", "journal", default=None, metavar="DIR|URL",
    help="Journal directory, or a postgresql:// URL (default: $BOUNDLOOP_JOURNAL or "
         "./.boundloop).")


def json_option(what: str) -> Callable[[F], F]:
    """``--json``: print ``what`` as JSON instead of a table."""
    return click.option("--json", "as_json", is_flag=True,
                        help=f"Print {what} as JSON.")


if TYPE_CHECKING:
    from boundloop.stats import Stats

    _ParamType = click.ParamType[float]
else:  # click < 8.3: ParamType is not generic
    _ParamType = click.ParamType


class Duration(_ParamType):
    """A duration such as ``30d``, ``12h``, ``1h30m`` or ``90s`` (in seconds)."""

    name = "duration"

    def convert(self, value: Any, param: click.Parameter | None,
                ctx: click.Context | None) -> float:
        if isinstance(value, int | float):
            return float(value)
        from boundloop.ops import parse_duration

        try:
            return parse_duration(str(value))
        except BoundloopError as exc:
            self.fail(str(exc), param, ctx)


DURATION = Duration()


# -- output helpers ------------------------------------------------------------------------
def _echo_json(value: Any) -> None:
    import msgspec

    click.echo(json.dumps(msgspec.to_builtins(value), indent=2, ensure_ascii=False))


#: Cells between two columns of a table.
_GAP = 2
#: Columns with ``Col.drop`` at least this go before the others are cut much.
_EXTRA = 5
#: Spaces at the end of a line, before any escape codes that end it.
_TAIL = re.compile(r"[ \t]+((?:\x1b\[[0-9;?]*[A-Za-z])*)$")


class Col(NamedTuple):
    """A table column. ``shrink``: the fewest cells it may be cut to, with "…" (None: never
    cut); ``drop``: when even that does not fit, columns go highest ``drop`` first (0: never
    dropped; ``_EXTRA`` and more: an extra, dropped rather than cutting the others much);
    ``wrap``: in a terminal, wrap instead of cutting; ``right``: right-aligned."""

    header: str
    shrink: int | None = None
    drop: int = 0
    wrap: bool = False
    right: bool = False


def _columns_env() -> int | None:
    try:
        value = int(os.environ.get("COLUMNS", ""))
    except ValueError:
        return None
    return value if value > 0 else None


def _clip(text: str, width: int) -> str:
    """``text`` cut to ``width`` terminal cells, ending in "…" when it was cut."""
    from rich.cells import cell_len, get_character_cell_size

    if cell_len(text) <= width:
        return text
    if width < 1:
        return ""
    out, used = [], 0
    for ch in text:
        size = get_character_cell_size(ch)
        if used + size > width - 1:
            break
        out.append(ch)
        used += size
    return "".join(out) + "…"


def _cell(value: Any) -> str:
    return "-" if value is None or value == "" else " ".join(str(value).split())


def _fit(cols: Sequence[Col], rows: Sequence[Sequence[str]],
         width: int | None) -> tuple[list[int], list[int]]:
    """Which columns to show, and how wide: natural widths, cut (widest slack first) down
    to ``shrink`` and then dropping columns by ``drop`` until the table fits ``width``."""
    from rich.cells import cell_len

    natural = [max([cell_len(c.header), *(cell_len(r[i]) for r in rows)])
               for i, c in enumerate(cols)]
    least = [natural[i] if c.shrink is None else min(natural[i], c.shrink)
             for i, c in enumerate(cols)]
    shown = list(range(len(cols)))
    if width is None:
        return shown, natural

    def need(widths: Sequence[int]) -> int:
        return sum(widths[i] for i in shown) + _GAP * (len(shown) - 1)

    # Drop when even the cut columns do not fit; drop an extra column (drop >= _EXTRA) as
    # soon as fitting would take more than half of what the columns may be cut by.
    while True:
        droppable = [i for i in shown if cols[i].drop]
        if not droppable:
            break
        victim = max(droppable, key=lambda i: (cols[i].drop, i))
        if not (need(least) > width or (
                cols[victim].drop >= _EXTRA and
                need(natural) - width > sum(natural[i] - least[i] for i in shown) / 2)):
            break
        shown.remove(victim)
    widths = {i: natural[i] for i in shown}
    excess = sum(widths.values()) + _GAP * (len(shown) - 1) - width
    while excess > 0:
        slack = [i for i in shown if widths[i] > least[i]]
        if not slack:
            break
        widest = max(slack, key=lambda i: widths[i] - least[i])
        cut = min(excess, max(1, (widths[widest] - least[widest]) // 4))
        widths[widest] -= cut
        excess -= cut
    return shown, [widths[i] for i in shown]


class _Out:
    """Where a command prints. A terminal gets rich output as wide as the terminal (or
    ``$COLUMNS``); a pipe or a file gets plain text: aligned columns, no escape codes, no
    box-drawing characters, no trailing spaces, and no line wider than ``$COLUMNS`` when it
    is set (long fields are cut with "…", prose is wrapped)."""

    def __init__(self) -> None:
        from rich.console import Console

        self.console = Console(highlight=False)
        self.rich = self.console.is_terminal
        self.width: int | None = self.console.width if self.rich else _columns_env()

    def _emit(self, renderable: Any) -> None:
        with self.console.capture() as captured:
            self.console.print(renderable)
        lines = captured.get().split("\n")
        self.console.file.write("\n".join(_TAIL.sub(r"\1", line) for line in lines))
        self.console.file.flush()

    def line(self, text: str = "", style: str = "", record: bool = False) -> None:
        """A line of prose: wrapped to the width (a pipe without ``$COLUMNS``: as it is). A
        ``record`` (a line scripts read, such as compact's sizes) is never wrapped when
        piped."""
        if self.rich:
            from rich.text import Text

            self._emit(Text(text, style=style))
            return
        if record or self.width is None or _cell_len(text) <= self.width:
            click.echo(text.rstrip())
            return
        import textwrap

        for part in textwrap.wrap(text, self.width, subsequent_indent="  ",
                                  break_on_hyphens=False) or [""]:
            click.echo(part.rstrip())  # only a word wider than the line is split, not cut

    def table(self, cols: Sequence[Col], rows: Sequence[Sequence[Any]], *,
              title: str | None = None, caption: str | None = None,
              caption_of: str | None = None) -> None:
        """A table whose columns fit the width: cut, then dropped (a note says which). The
        ``caption`` is printed after it (only when the column ``caption_of`` is shown)."""
        cells = [[_cell(v) for v in row] for row in rows]
        shown, widths = _fit(cols, cells, self.width)
        if title:
            self.line(title, style="bold")
        if self.width is not None and \
                sum(widths) + _GAP * (len(shown) - 1) > self.width:
            # The columns that are never cut (ids) do not fit side by side: a record per
            # row instead, each value on its own line, none cut.
            self._records(cols, cells)
            if caption:
                self.line(caption, style="dim")
            return
        if self.rich:
            self._emit(self._rich_table(cols, cells, shown, widths))
        else:
            import textwrap

            for row in [[c.header for c in cols], *cells]:
                stacks = [textwrap.wrap(row[i], w, break_on_hyphens=False) or [""]
                          if cols[i].wrap and w > 1 else [_clip(row[i], w)]
                          for i, w in zip(shown, widths, strict=True)]
                for n in range(max(len(s) for s in stacks)):
                    parts = []
                    for i, w, stack in zip(shown, widths, stacks, strict=True):
                        text = _clip(stack[n], w) if n < len(stack) else ""
                        pad = " " * (w - _cell_len(text))
                        parts.append(pad + text if cols[i].right else text + pad)
                    line = (" " * _GAP).join(parts).rstrip()
                    click.echo(line if self.width is None else _clip(line, self.width))
        hidden = [c.header for i, c in enumerate(cols) if i not in shown]
        if hidden:
            self.line(f"(hidden at this width: {', '.join(hidden)}; see --json)",
                      style="dim")
        if caption and caption_of not in hidden:
            self.line(caption, style="dim")

    def _records(self, cols: Sequence[Col], cells: Sequence[Sequence[str]]) -> None:
        for n, row in enumerate(cells):
            if n:
                self.line()
            self.line(f"{cols[0].header}: {row[0]}", style="bold")
            for c, value in zip(cols[1:], row[1:], strict=True):
                self.line(f"  {c.header}: {value}")

    @staticmethod
    def _rich_table(cols: Sequence[Col], cells: Sequence[Sequence[str]], shown: list[int],
                    widths: list[int]) -> Any:
        from rich import box
        from rich.table import Table
        from rich.text import Text

        table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False,
                      padding=(0, _GAP - 1, 0, 0), header_style="bold")
        for i, w in zip(shown, widths, strict=True):
            c = cols[i]
            table.add_column(c.header, width=w, no_wrap=not c.wrap,
                             overflow="fold" if c.wrap else "ellipsis",
                             justify="right" if c.right else "left")
        for row in cells:
            table.add_row(*(Text(row[i]) for i in shown))
        return table


def _cell_len(text: str) -> int:
    from rich.cells import cell_len

    return cell_len(text)


class _Bar:
    """What a command's work tells its progress bar: ``update(done, total)`` as it goes
    (``total`` None while unknown: the bar pulses), and ``echo`` for lines printed meanwhile
    (above the bar). On a pipe both only do what a pipe needs (``echo`` prints the line)."""

    def __init__(self, progress: Any = None, task: Any = None) -> None:
        self._progress = progress
        self._task = task

    def update(self, done: int, total: int | None) -> None:
        """The work has done ``done`` of ``total`` items."""
        if self._progress is not None:
            self._progress.update(self._task, completed=done, total=total)

    def echo(self, text: str) -> None:
        """Print a line of the work's own output."""
        if self._progress is None:
            click.echo(text)
        else:
            self._progress.console.print(text, markup=False, highlight=False,
                                         soft_wrap=True)


@contextlib.contextmanager
def _progress(out: _Out, what: str) -> Iterator[_Bar]:
    """A progress bar (rich.progress) while the work runs, shown once it has taken a second,
    on a terminal only; it is erased when the work ends."""
    if not out.rich:
        yield _Bar()
        return
    import threading

    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        SpinnerColumn,
        TextColumn,
        TimeElapsedColumn,
    )

    progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                        MofNCompleteColumn(), TimeElapsedColumn(), console=out.console,
                        transient=True)
    task = progress.add_task(what, total=None)
    timer = threading.Timer(1.0, progress.start)
    timer.daemon = True
    timer.start()
    try:
        yield _Bar(progress, task)
    finally:
        timer.cancel()
        timer.join()
        progress.stop()


def _when(ts: float | None) -> str:
    return "-" if not ts else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))


def _secs(value: float | None) -> str:
    if value is None:
        return "-"
    if value < 1:
        return f"{value * 1000:.0f}ms"
    if value < 120:
        return f"{value:.1f}s"
    return f"{value / 60:.0f}m"


def _tokens(usage: Any) -> str:
    text = f"{usage.total_tokens} tok"
    text = text if usage.cost is None else f"{text}, cost {money(usage.cost)}"
    unpriced = getattr(usage, "unpriced_steps", 0)
    # A cost that leaves steps out says so (price="auto": a model the catalogue lacks).
    return f"{text} (partial: {unpriced} unpriced)" if unpriced else text


@click.group(context_settings={"help_option_names": ["-h", "--help"]}, epilog=EXIT_CODES)
@click.version_option(__version__, "-V", "--version", prog_name="boundloop",
                      message="%(prog)s %(version)s")
@click.option("--journal", "journal", default=None, metavar="DIR",
              help="Journal directory for every command (default: $BOUNDLOOP_JOURNAL or "
                   "./.boundloop); a command's own --journal wins.")
@click.pass_context
def cli(ctx: click.Context, journal: str | None) -> None:
    """boundloop: LLM tool loops under hard budgets, on a durable event journal.

    A RUN_ID or EXECUTION_ID may be shortened to a unique prefix of it (an exact id always
    wins; a prefix several ids begin is refused, naming a few). Ids are never cut in a
    listing: at a narrow width other columns give way, or each row becomes a record."""
    ctx.obj = {"journal": journal}


@cli.command()
@journal_option
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def demo(journal: str | None, as_json: bool) -> None:
    """Run the built-in scripted scenarios end to end and print their reports: status, the
    limit that stopped each run, its steps and calls, and its completed and unresolved
    actions."""
    from boundloop.demo import completed_text, run_demo
    from boundloop.runner import Runner

    where = journal_dir(journal)
    with Runner(where) as runner:
        scenarios = run_demo(runner)
    rows = [{"scenario": s.name, "run_id": s.result.run_id, "status": s.result.status,
             "limit": s.result.exhausted_limit, "budget_limit": s.limit,
             "model_steps": s.result.model_steps, "tool_calls": s.result.tool_calls,
             "completed": len(s.result.completed),
             "failed": sum(1 for c in s.result.completed if c.status != "ok"),
             "unresolved": len(s.result.unresolved), "parent_run_id": s.parent_run_id,
             "story": s.story, "explanation": s.result.explanation}
            for s in scenarios]
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    out = _Out()
    out.table([Col("scenario", shrink=13), Col("status"), Col("limit", shrink=13, drop=2),
               Col("steps", drop=6, right=True), Col("calls", drop=5, right=True),
               Col("completed", shrink=9, drop=3), Col("unresolved", drop=1, right=True)],
              [(s.name, s.result.status, s.limit, s.result.model_steps, s.result.tool_calls,
                completed_text(s.result), len(s.result.unresolved)) for s in scenarios],
              title="boundloop demo")
    out.line()
    for s in scenarios:
        out.line(f"- {s.name} ({s.result.run_id}): {s.story}")
    out.line()
    default = os.environ.get("BOUNDLOOP_JOURNAL") or ".boundloop"
    if "://" in where:  # a database URL: never its password on the screen
        from boundloop.journal.postgres import _display

        shown = _display(where)
    else:
        shown = os.path.abspath(where)
    flag = "" if where == default else f" --journal {shown if '://' in where else where}"
    review = next((s.result.run_id for s in scenarios if s.result.status == "needs_review"),
                  scenarios[0].result.run_id)
    out.line(f"journal: {shown}")
    out.line("what to run next:")
    for command, what in ((f"show {review}", "a run's timeline, event by event"),
                          ("runs --tree", "every run, child runs under their parents"),
                          ("stats", "the figures: statuses, limits, tokens, latency")):
        out.line(f"  boundloop{flag} {command}")
        out.line(f"      {what}", style="dim")


# -- runs ----------------------------------------------------------------------------------
#: How many runs ``runs`` lists unless given -n N or --all.
RUNS_LIMIT = 50
REJECTED = ("rejected runs are not journaled: admission refuses them before anything is "
            "recorded, so no listing can show them (the caller's RunResult says "
            "`rejected`, and the telemetry counts them)")


def _age(seconds: float) -> str:
    """A duration as it is typed: ``0s``, ``90s``, ``2h``, ``7d``."""
    for unit, size in (("w", 604800), ("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{seconds / size:g}{unit}"
    return f"{seconds:g}s"


def _ago(seconds: float) -> str:
    """A rough age: ``4s``, ``12m``, ``3h``, ``5d``."""
    seconds = max(seconds, 0.0)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size:.0f}{unit}"
    return f"{seconds:.0f}s"


def _plural(n: int, what: str) -> str:
    return f"{n} {what}{'' if n == 1 else 's'}"


@cli.command()
@journal_option
@json_option("the runs")
@click.option("--status", "statuses", multiple=True, metavar="STATUS",
              help="Only runs with this status (repeatable): a SPEC status, or running / "
                   "interrupted for runs that have not finished (owner alive / gone). "
                   "Not rejected: admission refuses those before anything is journaled.")
@click.option("--limit-hit", "limits", multiple=True, metavar="LIMIT",
              help="Only runs stopped by this limit (repeatable; 'any' for every limit).")
@click.option("--since", type=DURATION, default=None, metavar="AGE",
              help="Only runs started within AGE (e.g. 2h, 7d).")
@click.option("--older-than", type=DURATION, default=None, metavar="AGE",
              help="Only runs started more than AGE ago.")
@click.option("-n", "--last", type=click.IntRange(min=1), default=None, metavar="N",
              help=f"At most N runs, the newest (default {RUNS_LIMIT}; with --tree, N "
                   "top-level runs and the runs under them).")
@click.option("--all", "every", is_flag=True, help="Every run that matches (no -n limit).")
@click.option("--tree", is_flag=True,
              help="List each child run under its parent (when the parent is listed too).")
@click.option("--label", "labels", multiple=True, metavar="KEY=VALUE",
              help="Only runs that carry this label (repeatable: every one must match).")
def runs(journal: str | None, as_json: bool, statuses: tuple[str, ...], limits: tuple[str, ...],
         since: float | None, older_than: float | None, last: int | None, every: bool,
         tree: bool, labels: tuple[str, ...]) -> None:
    """List runs, newest first: the newest 50 unless -n N or --all.

    Ids are never cut: at a narrow width other columns are cut or hidden first (--json has
    them all). "took" is the run's time; for a running run, its age (now minus its start).
    Costs are plain decimals ($0.000033)."""
    from boundloop.ops import DAMAGED, LIMITS, STATUSES, find_runs, open_journal

    wanted: dict[str, str] = {}
    for item in labels:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"{item!r} is not KEY=VALUE", param_hint="'--label'")
        wanted[key] = value

    for s in statuses:
        if s == "rejected":
            raise click.BadParameter(REJECTED, param_hint="'--status'")
        if s not in STATUSES:
            listed = ", ".join(x for x in STATUSES if x != "rejected")
            raise click.BadParameter(f"{s!r} is not a status ({listed})",
                                     param_hint="'--status'")
    for lim in limits:
        if lim not in (*LIMITS, "any"):
            raise click.BadParameter(f"{lim!r} is not a limit ({', '.join(LIMITS)}, any)",
                                     param_hint="'--limit-hit'")
    if every and last is not None:
        raise click.UsageError("-n and --all contradict each other")
    limit = None if every else (last or RUNS_LIMIT)
    now = time.time()
    with open_journal(journal_dir(journal), readonly=True) as j:
        found = find_runs(j, status=statuses, limit_hit=limits, since_s=since,
                          older_than_s=older_than, last=limit, tree=tree, now=now,
                          labels=wanted)
    more = f"-n N or --all for more than {limit}" if found.more else ""
    if as_json:
        _echo_json(found.runs)
        if more and last is None:  # the default limit cut the list short: say so
            click.echo(f"boundloop: listed the newest {_plural(limit or 0, 'run')}; {more}",
                       err=True)
    else:
        _runs_text(found, statuses, limits, since, older_than, now, limit, more, tree)
    damaged = [r.run_id for r in found.runs if r.status == DAMAGED]
    if damaged:
        # Listed with the others; the exit says the journal is damaged.
        click.echo(f"boundloop: {_plural(len(damaged), 'damaged run')} listed "
                   f"({', '.join(damaged)}); {_DAMAGE_HINT}", err=True)
        click.get_current_context().exit(EXIT_JOURNAL)


def _runs_text(found: Any, statuses: Sequence[str], limits: Sequence[str],
               since: float | None, older_than: float | None, now: float,
               limit: int | None, more: str, tree: bool) -> None:
    out = _Out()
    if not found.runs:
        out.line(_no_runs(found, statuses, limits, since, older_than, now))
        return
    filtered = bool(statuses or limits or since is not None or older_than is not None)
    what = "top-level runs" if tree else "runs"
    if found.more:
        title = f"the newest {limit} {'matching ' if filtered else ''}{what}"
        title += "" if filtered or tree else f" of {found.total}"
    elif filtered:
        title = f"{len(found.runs)} of {_plural(found.total, 'run')} match"
    else:
        title = _plural(len(found.runs), "run")
    title += ", newest first" + (", child runs under their parents" if tree else "")
    costs = any(r.usage.cost is not None for r in found.runs)
    rows = [(("  " * r.depth + "↳ " if r.depth else "") + r.run_id, r.status,
             r.exhausted_limit, r.model_steps, r.tool_calls, r.unresolved or "",
             _agent_cell(r), r.parent_run_id, _when(r.created_ts), _secs(r.elapsed_s))
            + ((None if r.usage.cost is None else money(r.usage.cost),) if costs else ())
            for r in found.runs]
    out.table([Col("run id"), Col("status"), Col("limit", shrink=8, drop=3),
               Col("steps", drop=6, right=True), Col("calls", drop=5, right=True),
               Col("unresolved", drop=2, right=True), Col("agent", shrink=8, drop=3),
               Col("parent", drop=4),
               Col("started", drop=8), Col("took", drop=7, right=True)]
              + ([Col("cost", drop=9, right=True)] if costs else []), rows,
              title=title, caption=f"({more})" if more else None)
    waiting = sorted({r.agent for r in found.runs
                      if r.status in ("queued", "interrupted") and r.agent})
    if waiting:
        out.line("queued and interrupted runs wait for a worker serving their agent: "
                 + ", ".join(waiting), style="dim")


def _agent_cell(r: Any) -> str | None:
    """An agent's name and version, then the run's labels, for one cell of ``runs``."""
    parts = [r.agent + (f"@{r.agent_version}" if r.agent_version else "")] if r.agent else []
    parts += [f"{k}={v}" for k, v in sorted(r.labels.items())]
    return " ".join(parts) or None


def _no_runs(found: Any, statuses: Sequence[str], limits: Sequence[str], since: float | None,
             older_than: float | None, now: float) -> str:
    """Why ``runs`` lists nothing, in a sentence."""
    if not found.total:
        return "no runs in this journal"
    newest = "" if found.newest_ts is None else \
        f", the newest started {_ago(now - found.newest_ts)} ago"
    held = f"this journal holds {_plural(found.total, 'run')}{newest}"
    others = [f"--status {s}" for s in statuses] + [f"--limit-hit {x}" for x in limits]
    if older_than is not None:
        others.append(f"--older-than {_age(older_than)}")
    if since is not None:
        also = f" matching {' '.join(others)}" if others else ""
        return f"no run started in the last {_age(since)}{also} ({held})"
    return f"no runs match {' '.join(others)} ({held})"


# -- show ----------------------------------------------------------------------------------
def _open_note(word: str) -> str:
    """What ``show`` and ``replay`` add to the state word of a run with no RunFinished."""
    if word == "queued":
        return "no RunFinished event yet; it waits for a worker"
    return "no RunFinished event yet; its runner is " + ("alive" if word == "running" else "gone")


def _run_rows(found: Sequence[Any]) -> list[tuple[Any, ...]]:
    return [(r.run_id, r.status, r.exhausted_limit, r.model_steps, r.tool_calls,
             r.unresolved or "") for r in found]


_RUN_COLS = (Col("run id"), Col("status"), Col("limit", shrink=8, drop=3),
             Col("steps", drop=6, right=True), Col("calls", drop=5, right=True),
             Col("unresolved", drop=2, right=True))


@cli.command()
@journal_option
@json_option("the timeline")
@click.argument("run_id")
def show(journal: str | None, as_json: bool, run_id: str) -> None:
    """Show a run's timeline: what it did, and why it stopped; then its child runs and its
    completed and unresolved actions. RUN_ID may be a unique prefix of the id. Events are
    named by their class (CallDecided), as `boundloop export` names them; costs are plain
    decimals ($0.000033); a running run's elapsed is its age."""
    from boundloop.ops import open_journal, run_timeline

    with open_journal(journal_dir(journal), readonly=True) as j:
        tl = run_timeline(j, run_id)
    if as_json:
        _echo_json(tl)
        return
    b = tl.budget
    rows = []
    for r in tl.rows:
        cost = "" if r.usage.cost is None else f" {money(r.usage.cost)}"
        after = f"{r.model_steps}/{b.max_model_steps} {r.tool_calls}/{b.max_tool_calls} " \
                f"{r.usage.total_tokens}{cost}"
        call = " ".join(x for x in (r.call_id, r.tool) if x)
        rows.append((r.seq, f"+{r.offset_s:.3f}s", r.step, r.event, call,
                     r.decision or r.outcome, _secs(r.latency_s) if r.latency_s else None,
                     r.detail, after))
    out = _Out()
    out.table([Col("seq", right=True), Col("time", drop=5), Col("step", drop=6, right=True),
               Col("event"), Col("call", shrink=8, wrap=True),
               Col("outcome", shrink=8), Col("latency", drop=5, right=True),
               Col("detail", shrink=8, drop=2, wrap=True), Col("budget after", drop=7)],
              rows, title=f"run {tl.run_id}",
              caption="budget after: model steps used/max, tool calls used/max, tokens",
              caption_of="budget after")
    limit = f" ({tl.exhausted_limit})" if tl.exhausted_limit else ""
    status = tl.status if tl.finished else f"{tl.status} ({_open_note(tl.status)})"
    out.line(f"status: {status}{limit}")
    out.line(f"explanation: {tl.explanation or '-'}")
    elapsed = tl.elapsed_s
    if tl.status == "running" and tl.started_ts:  # in flight: its age
        elapsed = max(time.time() - tl.started_ts, elapsed)
    out.line(f"model steps: {tl.model_steps}/{b.max_model_steps}, tool calls: "
             f"{tl.tool_calls}/{b.max_tool_calls}, usage: {_tokens(tl.usage)}, "
             f"elapsed: {_secs(elapsed)}")
    if tl.agent:
        out.line(f"agent: {tl.agent}" + (f" (version {tl.agent_version})"
                                         if tl.agent_version else ""))
    if tl.labels:
        out.line("labels: " + ", ".join(f"{k}={v}" for k, v in sorted(tl.labels.items())))
    if tl.tool_caps:
        # Accepted calls of each capped tool (nested runs' included) against its cap.
        out.line("tool caps: " + ", ".join(f"{name} {tl.tool_counts.get(name, 0)}/{cap}"
                                           for name, cap in sorted(tl.tool_caps.items())))
    if tl.parent_run_id:
        out.line(f"parent run: {tl.parent_run_id}")
    if tl.awaiting:
        out.table([Col("execution id"), Col("tool", shrink=8),
                   Col("arguments", shrink=10, wrap=True)],
                  [(a.execution_id, a.tool, json.dumps(a.arguments, ensure_ascii=False))
                   for a in tl.awaiting], title="calls awaiting approval")
        out.line(f"decide with: boundloop approve|deny {tl.run_id} EXECUTION_ID "
                 "[--by NAME] [--note TEXT]", style="dim")
    if tl.children:
        out.table(_RUN_COLS, _run_rows(tl.children),
                  title=f"child runs ({len(tl.children)}, oldest first)")
    else:
        out.line("child runs: none")
    if tl.completed:
        out.table([Col("call", shrink=8, wrap=True), Col("tool", shrink=8), Col("result", shrink=8),
                   Col("attempts", right=True, drop=1)],
                  [(c.call_id, c.tool, c.status, c.attempts) for c in tl.completed],
                  title="completed actions")
    else:
        out.line("completed actions: none")
    if tl.unresolved:
        out.table([Col("call", shrink=6, wrap=True), Col("tool", shrink=8), Col("execution id"),
                   Col("attempt", right=True, drop=2), Col("phase", drop=1)],
                  [(u.call_id, u.tool, u.execution_id, u.attempt,
                    u.phase + (" (abandoned)" if u.abandoned else "")) for u in tl.unresolved],
                  title="unresolved actions")
    else:
        out.line("unresolved actions: none")


# -- replay --------------------------------------------------------------------------------
_OVERRIDES: list[tuple[str, str, Any, str]] = [
    ("--max-model-steps", "max_model_steps", int, "model steps"),
    ("--max-tool-calls", "max_tool_calls", int, "tool calls"),
    ("--deadline-s", "deadline_s", float, "seconds of run time"),
    ("--max-input-tokens", "max_input_tokens", int, "input tokens"),
    ("--max-output-tokens", "max_output_tokens", int, "output tokens"),
    ("--max-total-tokens", "max_total_tokens", int, "input plus output tokens"),
    ("--max-cost", "max_cost", float, "cost"),
    ("--max-result-bytes", "max_result_bytes", int, "bytes per tool result"),
    ("--malformed-retries", "malformed_retries", int, "malformed responses retried"),
]


def _override_options(fn: F) -> F:
    for flag, field, kind, what in reversed(_OVERRIDES):
        fn = click.option(flag, field, type=kind, default=None, metavar="N",
                          help=f"With --check: check under this limit on {what}.")(fn)
    return fn


@cli.command()
@journal_option
@json_option("the rebuilt state (and the check)")
@click.argument("run_id", required=False)
@click.option("--events", "events_file", type=click.Path(dir_okay=False), default=None,
              metavar="FILE", help="Replay events from a file (`boundloop export` output or a "
                                   "golden .msgpack) instead of the journal.")
@click.option("--check", "do_check", is_flag=True,
              help="Re-run the current policy over the recorded responses and outcomes (no "
                   "model or tool is called) and report the first decision that differs.")
@_override_options
def replay(journal: str | None, as_json: bool, run_id: str | None, events_file: str | None,
           do_check: bool, **limits: Any) -> None:
    """Rebuild a run's state from its events and check it against how the run finished.
    RUN_ID may be a unique prefix of the id."""
    import msgspec

    from boundloop.ops import (
        OPEN_EXPLANATIONS,
        check,
        load_events,
        open_journal,
        read_events,
        rebuild,
        resolve_run_id,
        state_word,
    )

    changes = {k: v for k, v in limits.items() if v is not None}
    if changes and not do_check:
        raise click.UsageError("limit options such as --max-tool-calls need --check")
    if (run_id is None) == (events_file is None):
        raise click.UsageError("give a RUN_ID or --events FILE (one of them)")
    owners: dict[str, Any] = {}
    if events_file is not None:
        try:
            events = load_events(events_file)
        except OSError as exc:
            raise click.BadParameter(f"cannot read {events_file}: {exc.strerror or exc}",
                                     param_hint="'--events'") from None
    else:
        assert run_id is not None
        with open_journal(journal_dir(journal), readonly=True) as j:
            events = read_events(j, resolve_run_id(j, run_id))
            owners = j.owners()
    rebuilt = rebuild(events)
    st = rebuilt.state
    # The same word as `runs` and `show`; a file cannot tell whether its runner is alive.
    word, why = st.status, st.explanation
    if not st.finished:
        word = "unfinished" if events_file is not None else \
            state_word(False, st.status, st.owner, owners)
        why = OPEN_EXPLANATIONS.get(word, "The recording ends before the run finished.")
    report = None
    if do_check:
        budget = None
        if changes:
            budget = msgspec.structs.replace(rebuilt.state.budget, **changes)
        report = check(events, budget)
    failed = bool(rebuilt.mismatches) or (report is not None and not report.ok)
    if as_json:
        out: dict[str, Any] = {
            "run_id": st.run_id, "status": word, "finished": st.finished,
            "exhausted_limit": st.exhausted_limit, "explanation": why,
            "model_steps": st.model_steps, "tool_calls": st.tool_calls, "usage": st.usage,
            "elapsed_s": st.elapsed_s, "events": st.events, "budget": st.budget,
            "transcript": st.transcript, "completed": st.completed,
            "unresolved": st.unresolved, "consistent": rebuilt.consistent,
            "mismatches": rebuilt.mismatches}
        if report is not None:
            out["check"] = report
        _echo_json(out)
    else:
        _print_replay(rebuilt, report, word, why)
    if failed:
        click.get_current_context().exit(EXIT_MISMATCH)


def _print_replay(rebuilt: Any, report: Any, word: str, why: str) -> None:
    import msgspec

    st = rebuilt.state
    limit = f" ({st.exhausted_limit})" if st.exhausted_limit else ""
    note = "" if st.finished else " (" + (
        "not finished: the recording ends before RunFinished; from a file, whether its "
        "runner is alive is not known" if word == "unfinished" else _open_note(word)) + ")"
    lines = [f"run {st.run_id}: {st.events} events folded",
             f"status: {word}{limit}{note}",
             f"explanation: {why or '-'}",
             f"model steps: {st.model_steps}, tool calls: {st.tool_calls}, "
             f"usage: {_tokens(st.usage)}, elapsed: {_secs(st.elapsed_s)}",
             "transcript:"]
    for m in msgspec.to_builtins(st.transcript):
        body = {k: v for k, v in m.items() if k != "kind"}
        lines.append(f"  {m['kind']}: {json.dumps(body, ensure_ascii=False)}")
    lines.append("completed: " + (", ".join(f"{c.call_id} {c.tool} {c.status}"
                                            for c in st.completed) or "none"))
    lines.append("unresolved: " + (", ".join(f"{u.call_id} {u.tool} ({u.phase})"
                                             for u in st.unresolved) or "none"))
    if rebuilt.finished_seq is None:
        lines.append("consistency: the run has not finished; nothing to compare with")
    elif rebuilt.consistent:
        lines.append(f"consistency: ok, the fold agrees with RunFinished (seq "
                     f"{rebuilt.finished_seq})")
    else:
        lines.extend(f"consistency: MISMATCH {m}" for m in rebuilt.mismatches)
    if report is not None:
        if report.ok:
            lines.append(f"check: ok, the current policy makes the same {report.decisions} "
                         "decisions")
        else:
            lines.append(f"check: DIVERGES at {report.divergence}")
        if report.note:
            lines.append(f"check note: {report.note}")
    out = _Out()
    for line in lines:
        out.line(line)


# -- prune ---------------------------------------------------------------------------------
@cli.command()
@journal_option
@json_option("what was pruned")
@click.option("--older-than", type=DURATION, required=True, metavar="AGE",
              help="Remove runs that finished more than AGE ago (e.g. 30d).")
@click.option("--dry-run", is_flag=True, help="Only say what would be removed.")
@click.option("-v", "--verbose", is_flag=True,
              help="Also list the id of every run removed, and of every run kept and why.")
def prune(journal: str | None, as_json: bool, older_than: float, dry_run: bool,
          verbose: bool) -> None:
    """Remove finished runs older than AGE (retention) and print a summary. Open runs and
    runs recovery still needs are kept. `boundloop compact` then gives the space back."""
    from boundloop.ops import open_journal
    from boundloop.ops import prune as do_prune

    out = _Out()
    with open_journal(journal_dir(journal), readonly=dry_run) as j, \
            _progress(out, "pruning" if not dry_run else "looking for runs to prune") as bar:
        report = do_prune(j, older_than, dry_run=dry_run, progress=bar.update)
    if as_json:
        _echo_json(report)
        return
    verb = "would remove" if dry_run else "removed"
    out.line(f"{verb} {_plural(len(report.pruned), 'finished run')} that finished before "
             f"{_when(report.cut_ts)}")
    reasons: dict[str, int] = {}
    for why in report.kept.values():
        reasons[why] = reasons.get(why, 0) + 1
    for why, n in reasons.items():
        out.line(f"kept {_plural(n, 'run')} older than that: {why}")
    if verbose:
        for run_id in report.pruned:
            out.line(f"  {verb} {run_id}")
        for run_id, why in report.kept.items():
            out.line(f"  kept {run_id}: {why}")
    elif report.pruned or report.kept:
        out.line("(--verbose lists their ids)", style="dim")


# -- integrity -----------------------------------------------------------------------------
@cli.command()
@journal_option
@json_option("a list of {run_id, head, ok, error}")
@click.argument("run_ids", nargs=-1, metavar="[RUN_ID]...")
def verify(journal: str | None, as_json: bool, run_ids: tuple[str, ...]) -> None:
    """Check the hash chain of every run (or of RUN_IDs, each an id or a unique prefix of
    one): one line per run with its id, its chain head in hex (keep it to prove the run
    unchanged later) and ok or what is damaged, then a summary line (verified N runs: D
    damaged, K ok). Exits 1 if any run is damaged. Read-only."""
    from boundloop.ops import key_file_warning, verify_journal

    where = journal_dir(journal)
    warning = key_file_warning(where)
    if warning:
        click.echo(f"boundloop: warning: {warning}", err=True)
    # In a child process: LMDB crashing on damaged pages of its own is reported as damage.
    with _progress(_Out(), "verifying the hash chains") as bar:
        reports = verify_journal(where, run_ids, progress=bar.update)
    if as_json:
        _echo_json(reports)
    else:
        if not reports:
            click.echo("boundloop: no runs in this journal", err=True)
        for r in reports:
            click.echo((f"{r.run_id}  {r.head or '-'}  "
                        + ("ok" if r.ok else f"DAMAGED {r.error}")).rstrip())
        if reports:
            bad = sum(1 for r in reports if not r.ok)
            click.echo(f"verified {_plural(len(reports), 'run')}: {bad} damaged, "
                       f"{len(reports) - bad} ok")
    damaged = [r.run_id for r in reports if not r.ok]
    if damaged:
        click.echo(f"boundloop: {len(damaged)} of {len(reports)} runs damaged: "
                   f"{', '.join(damaged)}", err=True)
        click.get_current_context().exit(EXIT_MISMATCH)


@cli.command()
@journal_option
@json_option("the sizes")
def compact(journal: str | None, as_json: bool) -> None:
    """Rewrite the journal to reclaim the space of pruned runs (LMDB files never shrink by
    themselves). Crash-safe: the old journal stays whole until the new one replaces it.
    Refused while a runner or any other process has the journal open."""
    from boundloop.ops import compact as do_compact

    where = journal_dir(journal)
    if "://" in where:
        raise JournalUnavailable(f"compact rewrites an LMDB journal; {where.split('://')[0]} "
                                 "journals reclaim space by themselves (PostgreSQL: VACUUM)")
    out = _Out()
    with _progress(out, "compacting the journal (records copied)") as bar:
        report = do_compact(where, progress=bar.update)
    if as_json:
        _echo_json(report)
        return
    out.line(f"compacted {report.journal}: data.mdb {report.before} bytes before, "
             f"{report.after} bytes after ({_mb(report.before)} -> {_mb(report.after)})",
             record=True)


def _mb(size: int) -> str:
    return f"{size / 1e6:.1f} MB"


# -- export --------------------------------------------------------------------------------
@cli.command()
@journal_option
@click.argument("run_id")
@click.option("--strip-content", is_flag=True,
              help="Also replace texts, arguments, results and error details with digests.")
@click.option("-o", "--output", type=click.Path(dir_okay=False, writable=True), default=None,
              metavar="FILE", help="Write to FILE instead of standard output.")
def export(journal: str | None, run_id: str, strip_content: bool, output: str | None) -> None:
    """Print a run's events as JSON lines, redacted, to attach to a bug report
    (`boundloop replay --events FILE` reads them back). RUN_ID may be a unique prefix of the
    id. Each line's "type" is the event's class name (CallDecided), as `show` names it."""
    from boundloop.ops import export_lines, open_journal, read_events, resolve_run_id

    with open_journal(journal_dir(journal), readonly=True) as j:
        lines = list(export_lines(read_events(j, resolve_run_id(j, run_id)), j.secret_key,
                                  strip_content=strip_content))
    text = "".join(line + "\n" for line in lines)
    if output is None:
        click.echo(text, nl=False)
        return
    _write_private(output, text)


def _write_private(output: str, text: str) -> None:
    """Write ``text`` to the file ``output``, made ``0600`` whatever the umask (SPEC 9); a
    symbolic link is not followed."""
    import errno
    import stat

    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(output, flags, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            if stat.S_ISREG(os.fstat(fd).st_mode):
                os.fchmod(fd, 0o600)  # an existing file too
            f.write(text)
    except OSError as exc:
        why = ("it is a symbolic link, which is not followed; give the file's own path"
               if exc.errno == errno.ELOOP else exc.strerror or str(exc))
        raise click.BadParameter(f"cannot write {output}: {why}",
                                 param_hint="'--output'") from None


# -- recovery ------------------------------------------------------------------------------
OUTCOMES = ["succeeded", "failed", "abandoned"]

def _runner(journal: str | None) -> Any:
    """A Runner on an existing journal (never creates one), and the journal to close."""
    from boundloop.ops import open_journal
    from boundloop.runner import Runner

    j = open_journal(journal_dir(journal))
    return Runner(j, model_threads=1, tool_threads=1, supervisors=1), j


def _ids(j: Any, run_id: str, execution_id: str) -> tuple[str, str]:
    """The full run and execution ids that the (possibly shortened) ids given name."""
    from boundloop.ops import resolve_execution_id, resolve_run_id

    run_id = resolve_run_id(j, run_id)
    return run_id, resolve_execution_id(j, run_id, execution_id)


@cli.command()
@journal_option
@json_option("the recovered runs")
@click.option("--claim", is_flag=True,
              help="Also take the runs over (append OwnerClaimed): their old runners are "
                   "fenced. Without it, nothing is written.")
@click.option("--dry-run", "dry_run", is_flag=True, help="Only report (the default).")
def recover(journal: str | None, as_json: bool, claim: bool, dry_run: bool) -> None:
    """List the runs whose runner is gone and what each left unresolved (read-only): for each
    action its execution id (never cut, whatever the width), call, tool, phase, attempt and
    arguments as the journal holds them (redacted), what to check before resolving it.

    Nothing is executed: resolve actions with `boundloop resolve`, then continue a run from
    your code with runner.resume(run_id, model=..., tools=...), which claims it.
    """
    if claim and dry_run:
        raise click.UsageError("--claim and --dry-run contradict each other")
    damaged: list[str] = []
    if claim:
        runner, j = _runner(journal)
        try:
            found = runner.recover(damaged=damaged)
        finally:
            runner.close()
            j.close()
    else:
        from boundloop.ops import open_journal, recoverable

        with open_journal(journal_dir(journal), readonly=True) as j:
            found = recoverable(j, damaged)
    _recover_report(found, claim, as_json, bool(damaged))
    if damaged:
        # The others are reported all the same, as `runs` does; the exit says the journal is
        # damaged.
        click.echo(f"boundloop: {_plural(len(damaged), 'damaged open run')} left out "
                   f"({', '.join(damaged)}); {_DAMAGE_HINT}", err=True)
        click.get_current_context().exit(EXIT_JOURNAL)


def _arguments(r: Any, u: Any) -> dict[str, Any]:
    """The arguments of ``r``'s unresolved action ``u``, as journaled (redacted)."""
    rec = r.state.calls.get(u.execution_id)
    return dict(rec.arguments) if rec is not None else {}


def _recover_report(found: list[Any], claim: bool, as_json: bool, left_out: bool) -> None:
    import msgspec

    if as_json:
        _echo_json([{"run_id": r.run_id, "model_steps": r.state.model_steps,
                     "tool_calls": r.state.tool_calls,
                     "unresolved": [{**msgspec.to_builtins(u),
                                     "arguments": _arguments(r, u)} for u in r.unresolved]}
                    for r in found])
        return
    out = _Out()
    if not found:
        out.line("no other runs to recover" if left_out else
                 "no runs to recover: every open run has a live runner")
        return
    out.line(f"claimed {_plural(len(found), 'run')}" if claim else
             f"{_plural(len(found), 'run')} to recover (read-only: --claim takes them over)",
             style="bold")
    for r in found:
        out.line()
        out.line(f"run {r.run_id}: {_plural(r.state.model_steps, 'model step')}, "
                 f"{_plural(r.state.tool_calls, 'tool call')}, "
                 f"{_plural(len(r.unresolved), 'unresolved action')}")
        if not r.unresolved:
            continue
        out.table([Col("execution id"), Col("call", shrink=6, drop=4, wrap=True),
                   Col("tool", shrink=8, drop=3), Col("phase", drop=5),
                   Col("attempt", drop=6, right=True),
                   Col("arguments (redacted)", shrink=12, wrap=True)],
                  [(u.execution_id, u.call_id, u.tool, u.phase, u.attempt,
                    json.dumps(_arguments(r, u), ensure_ascii=False, sort_keys=True))
                   for u in r.unresolved])
    if any(r.unresolved for r in found):
        out.line()
        out.line("check each action's effect (its arguments say what it was to do), then "
                 "record it: boundloop resolve RUN_ID EXECUTION_ID --outcome "
                 "succeeded|failed|abandoned --note TEXT (unique prefixes of the ids do)",
                 style="dim")


@cli.command()
@journal_option
@click.argument("run_id")
@click.argument("execution_id")
@click.argument("outcome_arg", metavar="[OUTCOME]", required=False,
                type=click.Choice(OUTCOMES))
@click.option("--outcome", type=click.Choice(OUTCOMES),
              help="succeeded: it took effect; failed: it did not; abandoned: nobody can tell.")
@click.option("--note", default="", help="Why (kept in the journal).")
@click.option("--by", default=None, help="Who decided (default: user@host).")
@click.option("--force", is_flag=True,
              help="Resolve even though a live runner owns the run: it is fenced first (it "
                   "stops driving the run), and the journal records that it was forced.")
def resolve(journal: str | None, run_id: str, execution_id: str, outcome_arg: str | None,
            outcome: str | None, note: str, by: str | None, force: bool) -> None:
    """Record a person's decision on an unresolved action of RUN_ID: OUTCOME (or --outcome)
    is succeeded, failed or abandoned. RUN_ID and EXECUTION_ID may be unique prefixes
    (`boundloop recover` lists them, with each action's arguments). A run that a live
    runner still drives is refused unless --force."""
    if outcome_arg and outcome and outcome_arg != outcome:
        raise click.UsageError(f"two outcomes given: {outcome_arg} and --outcome {outcome}")
    outcome = outcome or outcome_arg
    if outcome is None:
        raise click.UsageError("give the outcome: succeeded, failed or abandoned")
    runner, j = _runner(journal)
    try:
        run_id, execution_id = _ids(j, run_id, execution_id)
        state = runner.resolve(run_id, execution_id, outcome, note, by=by, force=force)
    finally:
        runner.close()
        j.close()
    left = len(state.open_actions)
    flagged = sum(1 for u in state.unresolved if u.abandoned)
    click.echo(f"recorded: {execution_id} {outcome}; {left} unresolved action(s) left open in "
               f"{run_id}" + (f", {flagged} abandoned (closed, still flagged)" if flagged else ""))


def _decide(journal: str | None, run_id: str, execution_id: str, approved: bool,
            by: str | None, note: str) -> None:
    runner, j = _runner(journal)
    try:
        run_id, execution_id = _ids(j, run_id, execution_id)
        decide = runner.approve if approved else runner.deny
        state = decide(run_id, execution_id, by=by, note=note)
    finally:
        runner.close()
        j.close()
    word = "approved" if approved else "denied"
    left = len(state.awaiting)
    then = f"{left} more call(s) of {run_id} wait for a decision" if left else \
        f"{run_id} is queued: a worker serving agent {state.agent!r} continues it" \
        if state.agent else f"{run_id} is queued: resume it with runner.resume(...)"
    click.echo(f"{word}: {execution_id}; {then}")


_BY = click.option("--by", default=None, help="Who decided (default: user@host).")
_NOTE = click.option("--note", default="", help="Why (kept in the journal).")


@cli.command()
@journal_option
@click.argument("run_id")
@click.argument("execution_id")
@_BY
@_NOTE
def approve(journal: str | None, run_id: str, execution_id: str, by: str | None,
            note: str) -> None:
    """Approve a call of RUN_ID that waits for a person (`boundloop show RUN_ID` lists
    them): a worker then dispatches it. A call that does not wait is refused. RUN_ID and
    EXECUTION_ID may be unique prefixes."""
    _decide(journal, run_id, execution_id, True, by, note)


@cli.command()
@journal_option
@click.argument("run_id")
@click.argument("execution_id")
@_BY
@_NOTE
def deny(journal: str | None, run_id: str, execution_id: str, by: str | None,
         note: str) -> None:
    """Deny a call of RUN_ID that waits for a person: it is recorded denied, never runs,
    and the model sees it when a worker continues the run. RUN_ID and EXECUTION_ID may be
    unique prefixes."""
    _decide(journal, run_id, execution_id, False, by, note)


@cli.command()
@journal_option
@click.argument("target", metavar="MODULE:AGENTS")
@click.option("--concurrency", type=click.IntRange(min=1), default=8, show_default=True,
              help="Runs this worker drives at once.")
@click.option("--grace", "grace_s", type=click.FloatRange(min=0), default=30.0,
              show_default=True, help="Seconds running attempts get to end on SIGTERM.")
@click.option("--lease", "lease_s", type=click.FloatRange(min=0.1, max=86_400), default=30.0,
              show_default=True, help="The worker's lease_s, in seconds.")
def worker(journal: str | None, target: str, concurrency: int, grace_s: float,
           lease_s: float) -> None:
    """Serve agents until SIGTERM or SIGINT: MODULE:AGENTS names a bl.Agent, a list of them,
    or a function returning them (e.g. myapp.agents:AGENTS). Takes queued runs and runs
    whose runner is gone; a second signal stops at once."""
    import importlib

    from boundloop.agent import Agent
    from boundloop.worker import Worker

    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise click.BadParameter("give MODULE:AGENTS, e.g. myapp.agents:AGENTS",
                                 param_hint="'MODULE:AGENTS'")
    hint = "'MODULE:AGENTS'"
    sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - the user's module: its error, in one line
        raise click.BadParameter(f"cannot import {module_name!r}: {type(exc).__name__}: "
                                 f"{exc}", param_hint=hint) from None
    if not hasattr(module, attr):
        raise click.BadParameter(f"module {module_name!r} has no {attr!r}", param_hint=hint)
    found = getattr(module, attr)
    if callable(found) and not isinstance(found, Agent):
        try:
            found = found()
        except Exception as exc:  # noqa: BLE001 - the user's factory
            raise click.BadParameter(f"{target} raised {type(exc).__name__}: {exc}",
                                     param_hint=hint) from None
    if isinstance(found, Agent):
        agents = [found]
    elif isinstance(found, list | tuple) and found \
            and all(isinstance(a, Agent) for a in found):
        agents = list(found)
    else:
        raise click.BadParameter(f"{target} is {type(found).__name__} {found!r:.60}, not a "
                                 "bl.Agent or a non-empty list of them", param_hint=hint)
    w = Worker(journal_dir(journal), agents, concurrency=concurrency, grace_s=grace_s,
               lease_s=lease_s)
    names = ", ".join(a.name for a in agents)
    click.echo(f"boundloop worker: serving {names} (concurrency {concurrency}); "
               "SIGTERM or Ctrl-C stops it", err=True)
    w.serve()
    click.echo(f"boundloop worker: stopped after {_plural(len(w.finished), 'run turn')}",
               err=True)


@cli.command()
@click.option("--runs", type=click.IntRange(min=1), default=200, show_default=True)
@click.option("--kills", type=click.IntRange(min=0), default=50, show_default=True,
              help="Faults to inject at most: SIGKILLs, and with --pause SIGSTOPs too. "
                   "They are spread over the work as it goes, so none comes once the work "
                   "is done: the report says how many were injected.")
@click.option("--seed", type=int, default=1, show_default=True)
@click.option("--workers", type=click.IntRange(min=1, max=16), default=2, show_default=True,
              help="Worker processes sharing the journal.")
@click.option("--pause", is_flag=True, default=False,
              help="Also freeze workers past their lease (SIGSTOP), let the others take "
                   "their runs over, then wake them (SIGCONT) as zombies.")
@click.option("--lease", "lease_s", type=click.FloatRange(min=0.1, max=86_400), default=1.0,
              show_default=True, help="The workers' lease_s, in seconds.")
@click.option("--pidns/--no-pidns", default=None,
              help="Run each worker in its own pid namespace (unshare, as root), so a "
                   "paused worker is judged by its lease (default: with --pause, when "
                   "available).")
@click.option("--dir", "where", type=click.Path(file_okay=False), default=None,
              help="Where to keep the drill's journal and ledger (default: a temp dir).")
@click.option("--journal", "journal", default=None, metavar="URL",
              help="Run on PostgreSQL: a postgresql:// URL of a role that may create "
                   "databases; the drill creates a fresh database drill_<random> on that "
                   "server for its run, and keeps it (default: LMDB, in --dir).")
@click.option("--pgdata", type=click.Path(file_okay=False, exists=True), default=None,
              help="With --journal: the server's data directory; the drill crash-restarts "
                   "the server (pg_ctl restart -m immediate, as the directory's owner) as some "
                   "of its faults. Without it (or --pg-restart-cmd) the server is not "
                   "restarted.")
@click.option("--pg-restart-cmd", "restart_cmd", default=None, metavar="CMD",
              help="With --journal: a shell command that crash-restarts the server and "
                   "returns (instead of --pgdata).")
@click.option("--pg-restarts", "restarts", type=click.IntRange(min=0), default=None,
              help="How many of the faults are server restarts (default: one in 50, at "
                   "least one).")
@click.option("--compress", is_flag=True, default=False,
              help="The workers store the journal's records compressed "
                   "(Runner(compress=True)).")
@click.option("--queue", is_flag=True, default=False,
              help="Enqueue every run up front; the workers are bl.Worker processes serving "
                   "the drill's agent (they take queued and orphaned runs themselves), one "
                   "run in five calls a tool that needs approval, which a person thread "
                   "approves or denies; some faults are SIGTERMs (exit code 0 expected).")
@json_option("the report")
def drill(runs: int, kills: int, seed: int, workers: int, pause: bool, lease_s: float,
          pidns: bool | None, where: str | None, journal: str | None, pgdata: str | None,
          restart_cmd: str | None, restarts: int | None, compress: bool, queue: bool,
          as_json: bool) -> None:
    """Crash-recovery and ownership drill: SIGKILL (and with --pause, SIGSTOP past the
    lease) workers at random moments while the others take their runs over; check the
    journal against a ledger of real side effects. Exits 1 if any invariant fails.
    With --journal postgresql://..., the workers share a PostgreSQL database, and with
    --pgdata (or --pg-restart-cmd) the server is crash-restarted too."""
    import tempfile
    from pathlib import Path

    from boundloop.drill import DrillReport, can_unshare, command, format_report, run_drill
    from boundloop.journal.postgres import is_url

    if pidns and not can_unshare():
        raise click.UsageError("--pidns needs root and a working unshare(1)")
    if journal is not None and not is_url(journal):
        raise click.UsageError("--journal takes a postgresql:// URL (the LMDB drill keeps "
                               "its journal in --dir)")
    if journal is None and (pgdata or restart_cmd or restarts):
        raise click.UsageError("--pgdata, --pg-restart-cmd and --pg-restarts need --journal "
                               "postgresql://...")
    if pgdata and restart_cmd:
        raise click.UsageError("give --pgdata or --pg-restart-cmd, not both")
    if queue and (pgdata or restart_cmd or restarts):
        raise click.UsageError("--queue does not restart the server yet: leave out "
                               "--pgdata, --pg-restart-cmd and --pg-restarts")
    base = Path(where) if where else Path(tempfile.mkdtemp(prefix="boundloop-drill-"))
    report: DrillReport
    with _progress(_Out(), "drill (faults injected)") as bar:
        if queue:
            from boundloop.drill import run_queue_drill

            report = run_queue_drill(base, runs, kills, seed, workers,
                                     out=(lambda s: None) if as_json else bar.echo,
                                     pause=pause, lease_s=lease_s, pidns=pidns,
                                     journal=journal, progress=bar.update, compress=compress)
        else:
            report = run_drill(base, runs, kills, seed, workers,
                               out=(lambda s: None) if as_json else bar.echo, pause=pause,
                               lease_s=lease_s, pidns=pidns, journal=journal, pgdata=pgdata,
                               restart_cmd=restart_cmd, restarts=restarts,
                               progress=bar.update, compress=compress)
    if as_json:
        import msgspec

        _echo_json({**msgspec.to_builtins(report), "ok": report.ok, "dir": str(base)})
    else:
        text = format_report(report, command(runs, kills, seed, workers, pause, lease_s,
                                             pidns, journal, pgdata, restart_cmd, restarts,
                                             compress, queue))
        click.echo("\n".join(line.rstrip() for line in text.splitlines()))
    if not report.ok:
        click.get_current_context().exit(EXIT_MISMATCH)


# -- stats ---------------------------------------------------------------------------------
@cli.command()
@journal_option
@json_option("the figures")
@click.option("--since", type=DURATION, default=None, metavar="AGE",
              help="Only what happened within AGE (e.g. 24h, 7d); default: everything.")
@click.option("--by", "by", type=click.Choice(["tool", "status", "limit", "label", "agent"]),
              default=None, help="Also group the figures by tool, run status, limit hit, "
                                 "label (each key=value a run carries) or agent.")
def stats(journal: str | None, as_json: bool, since: float | None, by: str | None) -> None:
    """The telemetry's figures computed from the journal alone (SPEC 11): runs by status,
    limit hits, unknown outcomes, retries, reconciliations, reviews, tokens by kind, cost per
    finished run, run duration and model and tool latency."""
    from boundloop.ops import open_journal
    from boundloop.stats import from_journal

    with open_journal(journal_dir(journal), readonly=True) as j:
        figures = from_journal(j, since_s=since, by=by)  # type: ignore[arg-type]
    if as_json:
        _echo_json(figures)
    else:
        _stats_text(figures, by)
    if figures.damaged:
        # The figures leave those runs out: the journal is damaged, and the exit says so.
        click.get_current_context().exit(EXIT_JOURNAL)


def _stats_text(figures: Stats, by: str | None) -> None:
    from boundloop.stats import damage, group_table, summary

    out = _Out()
    for line in summary(figures):
        out.line(line)
    table = group_table(figures)
    if table is not None:
        header, rows = table
        out.line()
        # The group's name may be cut; the figures go last-first when even that does not
        # fit (--json has them all).
        out.table([Col(header[0], shrink=8)] + [
            Col(h, drop=i, right=True) for i, h in enumerate(header[1:], 1)],
            rows)
    elif figures.groups is not None:
        out.line()
        out.line(f"by {by}: nothing to show")
    for line in damage(figures):
        out.line(line)


# -- entry point ---------------------------------------------------------------------------
def _fail(message: str, code: int) -> NoReturn:
    click.echo("boundloop: " + " ".join(str(message).split()), err=True)
    sys.exit(code)


def main(argv: list[str] | None = None) -> NoReturn:
    """Entry point: bad input exits non-zero with a one-line message, never a traceback."""
    try:
        code = cli.main(args=argv, prog_name="boundloop", standalone_mode=False)
    except click.exceptions.NoArgsIsHelpError as exc:
        click.echo(exc.ctx.get_help() if exc.ctx else str(exc))
        code = EXIT_OK
    except click.ClickException as exc:
        hint = ""
        if isinstance(exc, click.UsageError) and exc.ctx is not None:
            hint = f" (see `{exc.ctx.command_path} --help`)"
        _fail(exc.format_message() + hint, EXIT_USAGE if exc.exit_code == 2 else exc.exit_code)
    except click.exceptions.Abort:
        _fail("aborted", 130)
    except UnknownRun as exc:
        _fail(str(exc), EXIT_UNKNOWN_RUN)
    except JournalError as exc:
        _fail(str(exc), EXIT_JOURNAL)
    except OSError as exc:  # permissions, a missing or odd file: the journal cannot be used
        where = f" ({exc.filename})" if exc.filename else ""
        _fail(f"cannot use the journal{where}: {exc.strerror or exc}; check the path and "
              "its permissions", EXIT_JOURNAL)
    except BoundloopError as exc:
        from boundloop.policy.replay import ReplayError  # imported when needed: fast startup

        if isinstance(exc, ReplayError):
            _fail(f"the journal does not replay: {exc}", EXIT_JOURNAL)
        _fail(str(exc), EXIT_USAGE)
    except Exception as exc:  # noqa: BLE001 - the contract: never a traceback
        if os.environ.get("BOUNDLOOP_DEBUG"):
            raise
        journal_failure = type(exc).__module__.split(".")[0] == "lmdb"
        _fail(f"{'journal error' if journal_failure else 'internal error'}: "
              f"{type(exc).__name__}: {exc}" +
              ("" if journal_failure else " (set BOUNDLOOP_DEBUG=1 to see the traceback)"),
              EXIT_JOURNAL if journal_failure else EXIT_INTERNAL)
    sys.exit(code if isinstance(code, int) else EXIT_OK)
