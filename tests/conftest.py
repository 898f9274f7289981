"""Shared fixtures: a fresh journal directory and a runner on it."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, settings

import boundloop as bl

# The property tests draw the same examples on every run (a CI failure reproduces as it
# is) and are not failed for being slow: CI's two cores are shared with the suite's other
# worker and its subprocesses, and "too slow" there says nothing about the code.
settings.register_profile("boundloop", derandomize=True, database=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("boundloop")


def pytest_configure(config: pytest.Config) -> None:
    """Bytecode is cached for the suite's own subprocesses, whatever $PYTHONDONTWRITEBYTECODE
    says. Hundreds of tests start ``python -m boundloop`` or a worker script (crash, drill,
    CLI and docs tests); with the variable set (as on CI's machines) each of them compiled
    every boundloop module it imports from source again, about 0.25 s of CPU each. The
    bytecode goes where Python puts it by default (``__pycache__``, ignored by git); the
    xdist workers and every subprocess inherit this environment."""
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    sys.dont_write_bytecode = False
    # An xdist worker finds $COLUMNS and $LINES set (GNU readline exports them there, the
    # worker having no terminal): the CLI would then fit its output to 80 columns where a
    # test runs it as piped with no width. The worker gets the controller's values back.
    given = getattr(config, "workerinput", {}).get("terminal_env")
    if given is not None:
        for name, value in given.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    """xdist (controller side): the terminal variables as the suite was started with."""
    node.workerinput["terminal_env"] = {name: os.environ.get(name)
                                        for name in ("COLUMNS", "LINES")}


@pytest.fixture(autouse=True, scope="session")
def _state_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Redaction keys go to a temporary state directory, never the real home (SPEC 9); no
    key file from the environment. Subprocesses inherit both."""
    state = tmp_path_factory.mktemp("xdg-state")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_STATE_HOME", str(state))
        mp.delenv("BOUNDLOOP_REDACTION_KEY_FILE", raising=False)
        yield state


@pytest.fixture(scope="session")
def pg() -> Iterator[Any]:
    """One real PostgreSQL 15 server on loopback for the session (tests/pg_server.py),
    started on first use and stopped at the end; skipped loudly when the binaries are
    missing."""
    from pg_server import Missing, PgServer

    try:
        server = PgServer()
    except Missing as exc:
        pytest.skip(f"PostgreSQL TESTS SKIPPED: {exc}")
    try:
        server.start()
        yield server
    finally:
        server.stop()


@pytest.fixture
def journal_dir(tmp_path: Path) -> Path:
    return tmp_path / "journal"


@pytest.fixture
def runner(journal_dir: Path) -> Iterator[bl.Runner]:
    with bl.Runner(journal_dir) as r:
        yield r


@pytest.fixture
def echo() -> tuple[bl.Tool, list[str]]:
    """A read-only tool that returns its text, and the texts it was called with."""
    ran: list[str] = []

    @bl.tool(read_only=True)
    def echo(text: str) -> str:
        """Echo the text."""
        ran.append(text)
        return text

    return echo, ran
