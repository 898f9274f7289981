"""``python -m boundloop.drill``: a drill (``--help`` lists its few options; ``boundloop
drill`` has them all). ``worker ...`` and ``queue-worker ...`` start the drill's own worker
processes (``boundloop drill`` and ``boundloop drill --queue`` spawn them)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main(argv: list[str]) -> None:
    """Run what ``argv`` (``sys.argv[1:]``) asks for."""
    if argv[:1] == ["worker"]:
        from boundloop.drill._worker import _worker_main

        _worker_main(argv[1:])
        return
    if argv[:1] == ["queue-worker"]:
        from boundloop.drill._queue_worker import _serve_main

        _serve_main(argv[1:])
        return
    from boundloop.drill._chaos import run_drill
    from boundloop.drill._report import command, format_report

    ap = argparse.ArgumentParser(prog="python -m boundloop.drill")
    ap.add_argument("--runs", type=int, default=200)
    ap.add_argument("--kills", type=int, default=50)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--pause", action="store_true")
    ap.add_argument("--lease", type=float, default=1.0)
    ap.add_argument("--dir", default=None)
    a = ap.parse_args(argv)
    import tempfile

    d = Path(a.dir) if a.dir else Path(tempfile.mkdtemp(prefix="boundloop-drill-"))
    rep = run_drill(d, a.runs, a.kills, a.seed, a.workers, pause=a.pause, lease_s=a.lease)
    print(format_report(rep, command(a.runs, a.kills, a.seed, a.workers, a.pause, a.lease)))
    sys.exit(0 if rep.ok else 1)


if __name__ == "__main__":
    main(sys.argv[1:])
