"""A real PostgreSQL server on loopback for the tests (SPEC 12), started and stopped here.

``PgServer.start()`` runs ``initdb`` into a new temporary directory and ``pg_ctl start`` on
127.0.0.1 and a free port, with ``fsync`` and ``synchronous_commit`` on and data checksums,
trust authentication for the superuser ``boundloop`` on loopback only (a test server, never
a production setting), and no Unix socket. PostgreSQL refuses to run as root, so when the
tests run as root the server runs as the system user ``postgres`` (or ``nobody`` when there
is none) through ``runuser``, and its directory is given to that user.

When a server binary is missing, ``find_binaries`` raises ``Missing`` naming it, and the
tests skip with that reason (loudly: never silently).
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

#: Where Debian and Ubuntu install the server binaries, tried after $PATH.
_DIRS = [f"/usr/lib/postgresql/{v}/bin" for v in (17, 16, 15, 14, 13)]
_NEEDED = ("initdb", "pg_ctl", "postgres")
#: The superuser the tests connect as.
USER = "boundloop"


class Missing(RuntimeError):
    """A PostgreSQL server binary (or a way to run it) is not installed here."""


def find_binaries() -> dict[str, str]:
    """Paths of initdb, pg_ctl and postgres, all from one installation.

    Raises:
        Missing: one of them is not found (the message names it).
    """
    env_dir = os.environ.get("BOUNDLOOP_TEST_PG_BIN")
    dirs = [env_dir] if env_dir else []
    which = shutil.which("pg_ctl")
    if which:
        dirs.append(str(Path(os.path.realpath(which)).parent))
    dirs += _DIRS
    for d in dirs:
        found = {name: str(Path(d) / name) for name in _NEEDED}
        if all(os.access(p, os.X_OK) for p in found.values()):
            return found
    for name in _NEEDED:
        if not any(os.access(Path(d) / name, os.X_OK) for d in dirs) and not shutil.which(name):
            where = "$PATH" + "".join(f", {d}" for d in dirs)
            raise Missing(f"PostgreSQL server binary {name!r} not found (looked in {where}); "
                          "install postgresql-15 or set $BOUNDLOOP_TEST_PG_BIN to its bin "
                          "directory")
    raise Missing("PostgreSQL binaries initdb, pg_ctl and postgres are not in one directory; "
                  "set $BOUNDLOOP_TEST_PG_BIN")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _server_user() -> str | None:
    """The user to run the server as: None (ourselves) unless we are root."""
    if os.geteuid() != 0:
        return None
    for name in ("postgres", "nobody"):
        with contextlib.suppress(KeyError):
            pwd.getpwnam(name)
            if not shutil.which("runuser"):
                raise Missing("running as root, and `runuser` (util-linux) is not installed "
                              f"to start PostgreSQL as {name!r}")
            return name
    raise Missing("running as root, and there is no 'postgres' or 'nobody' user to run "
                  "PostgreSQL as (it refuses to run as root)")


class PgServer:
    """One PostgreSQL cluster in a temporary directory."""

    def __init__(self) -> None:
        self.bins = find_binaries()
        self.user = _server_user()
        self.port = 0
        self.root = Path(tempfile.mkdtemp(prefix="boundloop-pg-"))
        self.data = self.root / "data"
        self.log = self.root / "server.log"
        self.started = False

    # -- running commands as the server's user --------------------------------------------
    def _run(self, *argv: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        cmd = list(argv)
        if self.user is not None:
            cmd = ["runuser", "-u", self.user, "--", *cmd]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                              cwd=self.root, env={**os.environ, "LC_ALL": "C"})
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(argv[:2])} failed ({proc.returncode}): "
                               f"{proc.stderr.strip()[-2000:]}\n{self._log_tail()}")
        return proc

    def _log_tail(self) -> str:
        try:
            return "server log:\n" + self.log.read_text(errors="replace")[-2000:]
        except OSError:
            return ""

    # -- lifecycle -----------------------------------------------------------------------
    def start(self) -> PgServer:
        """initdb, then start the server; returns self."""
        if self.user is not None:
            info = pwd.getpwnam(self.user)
            os.chmod(self.root, 0o755)
            os.chown(self.root, info.pw_uid, info.pw_gid)
        self._run(self.bins["initdb"], "-D", str(self.data), "-U", USER, "--auth=trust",
                  "-E", "UTF8", "--no-locale", "--data-checksums", "--no-sync")
        with open(self.data / "postgresql.conf", "a") as f:
            f.write("\n# boundloop tests\n"
                    "listen_addresses = '127.0.0.1'\n"
                    "unix_socket_directories = ''\n"
                    "fsync = on\n"
                    "synchronous_commit = on\n"
                    "full_page_writes = on\n"
                    "shared_buffers = 32MB\n"
                    "max_connections = 200\n"
                    "max_wal_size = 256MB\n"
                    "log_min_messages = warning\n")
        with open(self.data / "pg_hba.conf", "w") as f:
            f.write("host all all 127.0.0.1/32 trust\n")
        for attempt in range(5):
            self.port = _free_port()
            try:
                self._start()
                break
            except RuntimeError:
                if attempt == 4:
                    raise
        self.started = True
        return self

    def _start(self) -> None:
        self._run(self.bins["pg_ctl"], "-D", str(self.data), "-l", str(self.log), "-w",
                  "-t", "60", "-o", f"-p {self.port}", "start")

    def restart_immediate(self) -> None:
        """Stop the server as a crash would (``pg_ctl -m immediate``: no checkpoint, WAL
        replay at the next start), then start it again on the same port."""
        self.crash()
        self.start_again()

    def crash(self) -> None:
        """Stop the server as a crash would (``pg_ctl -m immediate``), and leave it down."""
        self._run(self.bins["pg_ctl"], "-D", str(self.data), "-m", "immediate", "-w", "stop")

    def start_again(self) -> None:
        """Start the server (stopped by ``crash``) again, on the same port."""
        deadline = time.monotonic() + 30
        while True:
            try:
                self._start()
                return
            except RuntimeError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def stop(self) -> None:
        """Stop the server (fast) and remove its directory."""
        if self.started:
            with contextlib.suppress(Exception):
                self._run(self.bins["pg_ctl"], "-D", str(self.data), "-m", "fast", "-w",
                          "stop")
            self.started = False
        shutil.rmtree(self.root, ignore_errors=True)

    # -- addresses -----------------------------------------------------------------------
    def url(self, dbname: str = "postgres") -> str:
        return f"postgresql://{USER}@127.0.0.1:{self.port}/{dbname}"

    def create_database(self, name: str) -> str:
        """``CREATE DATABASE name`` and return its URL."""
        import psycopg

        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)
