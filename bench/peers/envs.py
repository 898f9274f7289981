"""One virtualenv per peer framework, with pinned versions, so clashing dependencies never meet.

Each peer gets ``bench/.venvs/<peer>`` (git-ignored), made with the running interpreter's
``venv`` module and filled by ``pip`` from the package registry. A venv is reused when it
exists and its stamp file records the same pins; otherwise it is made again from scratch.

Run ``python bench/peers/envs.py [peer...]`` to create them all (or the named ones) ahead of
a benchmark; :func:`python_for` creates one on first use.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

VENVS = Path(__file__).resolve().parent.parent / ".venvs"

#: The packages each peer's venv installs, pinned (``name==version``). The first entry's
#: version is the one the peer script reports.
PINS: dict[str, tuple[str, ...]] = {
    "langgraph": ("langgraph==1.2.24", "langgraph-checkpoint-sqlite==3.1.2"),
    "pydantic_ai": ("pydantic-ai-slim==2.68.0",),
    "openai_agents": ("openai-agents==0.24.0",),
    "dbos": ("dbos==3.4.0",),
}

STAMP = "boundloop-bench-pins.json"


def _log(msg: str) -> None:
    print(f"[bench/peers/envs] {msg}", file=sys.stderr, flush=True)


def venv_dir(peer: str) -> Path:
    """Where ``peer``'s virtualenv lives (it may not exist yet)."""
    if peer not in PINS:
        raise KeyError(f"unknown peer {peer!r}; known: {', '.join(PINS)}")
    return VENVS / peer


def _python(venv: Path) -> Path:
    return venv / ("Scripts/python.exe" if sys.platform == "win32" else "bin/python")


def is_ready(peer: str) -> bool:
    """Whether ``peer``'s venv exists with exactly the pinned packages installed."""
    venv = venv_dir(peer)
    try:
        stamp = json.loads((venv / STAMP).read_text())
    except (OSError, ValueError):
        return False
    return _python(venv).exists() and stamp.get("pins") == list(PINS[peer])


def create(peer: str, *, force: bool = False) -> Path:
    """Make (or reuse) ``peer``'s venv and return its python; progress goes to stderr."""
    venv = venv_dir(peer)
    if not force and is_ready(peer):
        return _python(venv)
    t0 = time.perf_counter()
    if venv.exists():
        why = "--force" if force else "stale or incomplete"
        _log(f"{peer}: venv at {venv} is {why}, making it again")
        shutil.rmtree(venv)
    _log(f"{peer}: creating venv at {venv} with {' '.join(PINS[peer])}")
    venv.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = _python(venv)
    pip = [str(py), "-m", "pip", "--disable-pip-version-check", "--no-input"]
    try:
        subprocess.run([*pip, "install", "-q", *PINS[peer]], check=True,
                       stdout=sys.stderr)
        frozen = subprocess.run([*pip, "freeze"], check=True, capture_output=True,
                                text=True).stdout.split()
    except subprocess.CalledProcessError:
        shutil.rmtree(venv, ignore_errors=True)  # never leave a half-made venv to reuse
        raise
    (venv / STAMP).write_text(json.dumps({"pins": list(PINS[peer]), "freeze": frozen},
                                         indent=1))
    _log(f"{peer}: ready in {time.perf_counter() - t0:.1f} s ({len(frozen)} packages)")
    return py


def python_for(peer: str) -> Path:
    """The python of ``peer``'s venv, creating the venv on first use."""
    return create(peer)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Create the peers' virtualenvs under bench/.venvs.")
    p.add_argument("peers", nargs="*", metavar="peer",
                   help=f"peers to set up (default: all of {', '.join(PINS)})")
    p.add_argument("--force", action="store_true", help="make the venvs again even if ready")
    args = p.parse_args(argv)
    unknown = [peer for peer in args.peers if peer not in PINS]
    if unknown:
        p.error(f"unknown peer(s) {', '.join(unknown)}; known: {', '.join(PINS)}")
    t0 = time.perf_counter()
    for peer in args.peers or PINS:
        print(f"{peer}: {create(peer, force=args.force)}")
    _log(f"all done in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
