"""A PostgreSQL server under the drill: a fresh database for it, and crash-restarts."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import threading
import time
from pathlib import Path


def fresh_database(url: str) -> tuple[str, str]:
    """``CREATE DATABASE drill_<random>`` on the server of ``url`` (a ``postgresql://`` URL
    whose role may create databases); returns its name and its URL."""
    import secrets
    from urllib.parse import urlsplit, urlunsplit

    import psycopg

    name = "drill_" + secrets.token_hex(6)
    with psycopg.connect(url, autocommit=True, connect_timeout=10) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    return name, urlunsplit(urlsplit(url)._replace(path="/" + name))


def pg_restart_argv(pgdata: str | os.PathLike[str]) -> list[str]:
    """The command that crash-restarts the server of data directory ``pgdata``:
    ``pg_ctl restart -m immediate -w`` (no checkpoint: WAL replay at the start; the server's
    own options from its ``postmaster.opts``), as the directory's owner (``runuser``) when
    this process is root, logging to ``<pgdata>/boundloop-drill.log``."""
    import pwd
    import shlex

    data = Path(pgdata).resolve()
    pg_ctl = None
    with contextlib.suppress(OSError, ValueError, IndexError):
        postgres = shlex.split((data / "postmaster.opts").read_text())[0]
        pg_ctl = str(Path(postgres).with_name("pg_ctl"))
    if pg_ctl is None or not os.access(pg_ctl, os.X_OK):
        with contextlib.suppress(OSError):
            version = (data / "PG_VERSION").read_text().strip()
            pg_ctl = f"/usr/lib/postgresql/{version}/bin/pg_ctl"
    if pg_ctl is None or not os.access(pg_ctl, os.X_OK):
        pg_ctl = shutil.which("pg_ctl")
    if pg_ctl is None:
        raise RuntimeError(f"no pg_ctl found for the server of {data} (not next to the "
                           "postgres of its postmaster.opts, nor on $PATH)")
    owner = data.stat().st_uid
    prefix: list[str] = []
    if os.geteuid() == 0 and owner != 0:
        prefix = ["runuser", "-u", pwd.getpwuid(owner).pw_name, "--"]
    elif os.geteuid() != owner:
        raise RuntimeError(f"{data} belongs to uid {owner}: run the drill as that user (or "
                           "as root) to restart its server")
    return [*prefix, pg_ctl, "-D", str(data), "-m", "immediate", "-w", "-t", "60",
            "-l", str(data / "boundloop-drill.log"), "restart"]


class _Server:
    """The PostgreSQL server under the drill, crash-restarted in a thread of its own (the
    drill goes on killing and freezing workers meanwhile); ``down`` holds, per restart, when
    the restart began and when the server accepted a connection again."""

    def __init__(self, url: str, restart: list[str] | str, log: Path) -> None:
        self.url, self.restart_cmd, self.log = url, restart, log
        self.down: list[list[float]] = []
        self.error = ""
        self._thread: threading.Thread | None = None

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def restart(self) -> None:
        self.down.append([time.time(), 0.0])
        self._thread = threading.Thread(target=self._restart, name="drill-pg-restart",
                                        daemon=True)
        self._thread.start()

    def _restart(self) -> None:
        import psycopg

        cmd = self.restart_cmd
        try:
            with open(self.log, "ab") as log:
                code = subprocess.run(cmd, shell=isinstance(cmd, str), stdin=subprocess.DEVNULL,
                                      stdout=log, stderr=log, timeout=180).returncode
        except (OSError, subprocess.SubprocessError) as exc:
            self.error = f"the server's restart command failed: {exc}"
            return
        if code != 0:
            self.error = f"the server's restart command exited {code} (see {self.log})"
        give_up = time.monotonic() + 60
        while True:  # back up: the first connection it accepts
            try:
                psycopg.connect(self.url, connect_timeout=2).close()
                break
            except psycopg.Error as exc:
                if time.monotonic() > give_up:
                    self.error = self.error or f"the server is not back after its restart: {exc}"
                    return
                time.sleep(0.01)
        self.down[-1][1] = time.time()

    def join(self) -> None:
        if self._thread is not None:
            self._thread.join()
