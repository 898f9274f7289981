"""Output that fits where it is printed: tables fitted to the width (rich on a terminal,
plain aligned text when piped), progress bars, and the small formats (times, ages, tokens)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import click

from boundloop._text import money


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


def _mb(size: int) -> str:
    return f"{size / 1e6:.1f} MB"
