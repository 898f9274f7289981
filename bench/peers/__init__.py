"""Peer frameworks on boundloop's benchmark workload, each in its own virtualenv.

Each peer has a script ``bench/peers/<peer>_w.py`` run by the python of its venv
(``bench/.venvs/<peer>``, see :mod:`envs`); it prints one JSON line of figures.
:func:`measure` runs one measurement and never raises for a broken peer: it returns
``{"peer": ..., "ok": False, "error": ...}`` instead, so one peer cannot sink a whole run.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from . import envs

HERE = Path(__file__).resolve().parent

#: The peers, in the order a report lists them.
PEERS: tuple[str, ...] = ("langgraph", "pydantic_ai", "openai_agents", "dbos")


def script(peer: str) -> Path:
    """The measurement script of ``peer``."""
    if peer not in PEERS:
        raise KeyError(f"unknown peer {peer!r}; known: {', '.join(PEERS)}")
    return HERE / f"{peer}_w.py"


def measure(peer: str, *, runs: int, rounds: int, inflight: int, workdir: Path,
            timeout_s: float = 300, warmup: int = 5,
            options: Sequence[str] = ()) -> dict[str, Any]:
    """One measurement of ``peer``: its script in its venv, on a fresh temp dir under workdir.

    Returns the script's JSON line as a dict (``ok`` true), or ``{"peer", "ok": False,
    "error"}`` if the venv cannot be made, the script fails, times out or prints no JSON.
    ``options`` are extra arguments for the script (e.g. ``["--concurrency", "async"]``).
    """
    try:
        python = envs.python_for(peer)
        cmd = [str(python), str(script(peer)), "--runs", str(runs), "--rounds", str(rounds),
               "--inflight", str(inflight), "--warmup", str(warmup), *options]
        workdir.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f"peer-{peer}-", dir=workdir))
    except Exception as e:  # a broken peer is reported, not raised
        return {"peer": peer, "ok": False, "error": f"setup failed: {type(e).__name__}: {e}"}
    try:
        proc = subprocess.run([*cmd, "--dir", str(tmp)], capture_output=True, text=True,
                              timeout=timeout_s, cwd=tmp)
    except subprocess.TimeoutExpired:
        return {"peer": peer, "ok": False, "error": f"timed out after {timeout_s:g} s"}
    except OSError as e:
        return {"peer": peer, "ok": False, "error": f"could not run {cmd[0]}: {e}"}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    stderr = proc.stderr.strip()
    if proc.returncode != 0:
        tail = "\n".join(stderr.splitlines()[-5:])
        return {"peer": peer, "ok": False, "error": f"exit {proc.returncode}: {tail}"}
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    try:
        result = json.loads(lines[-1])
        if not isinstance(result, dict) or result.get("ok") is not True:
            raise ValueError("not an ok result")
    except (IndexError, ValueError) as e:
        return {"peer": peer, "ok": False,
                "error": f"no JSON result ({e}): {proc.stdout[-300:]!r} {stderr[-300:]!r}"}
    return result
