"""Connections to the PostgreSQL server: URLs, the readers' pool, keepalives, names."""

from __future__ import annotations

import contextlib
import hashlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from boundloop.errors import ConfigError, JournalUnavailable

try:
    import psycopg as psycopg
    from psycopg import conninfo as _conninfo
except ImportError:  # pragma: no cover - reported when a journal is opened
    psycopg = None  # type: ignore[assignment]

#: URL schemes that name a PostgreSQL journal.
SCHEMES = ("postgresql", "postgres")


def is_url(value: object) -> bool:
    """True when ``value`` is a ``postgresql://`` or ``postgres://`` URL."""
    return url_scheme(value) in SCHEMES


def url_scheme(value: object) -> str | None:
    """The scheme of ``value`` when it is a URL (``scheme://...``), else None (a path)."""
    if not isinstance(value, str):
        return None
    head, sep, _ = value.partition("://")
    if not sep or not head or not head[0].isalpha() \
            or not all(c.isalnum() or c in "+.-" for c in head):
        return None
    return head.lower()



def _keepalives(url: str, lease_s: float) -> dict[str, Any]:
    """TCP keepalives and ``tcp_user_timeout`` from the lease (a dead server is noticed
    within about the lease), for the parameters the URL does not set itself."""
    try:
        given = _conninfo.conninfo_to_dict(url)
    except Exception:  # noqa: BLE001 - a bad URL is reported when connecting
        given = {}
    lease = max(float(lease_s), 1.0)
    wanted: dict[str, Any] = {"keepalives": 1, "keepalives_idle": max(1, int(lease / 2)),
              "keepalives_interval": 1, "keepalives_count": 3,
              "tcp_user_timeout": int(lease * 2000)}
    return {k: v for k, v in wanted.items() if k not in given}


class _Conns:
    """The readers' connections: at most ``size`` at once, made when one is needed (never
    in the background, so never after a backoff), an idle one reused when there is one.
    A connection that was lost, or that is left inside a transaction, is closed, not
    reused; ``discard_idle`` closes every idle one (after a server restart broke them)."""

    def __init__(self, connect: Callable[[], Any], size: int, wait_s: float) -> None:
        self._new = connect
        self._size = max(1, size)
        self._wait_s = wait_s
        self._idle: list[Any] = []
        self._busy = 0
        self._cond = threading.Condition()
        self._closed = False

    @contextlib.contextmanager
    def connection(self) -> Iterator[Any]:
        conn = self._get()
        try:
            yield conn
        finally:
            self._put(conn)

    def _get(self) -> Any:
        deadline = time.monotonic() + self._wait_s
        stale: list[Any] = []
        try:
            with self._cond:
                while True:
                    if self._closed:
                        raise JournalUnavailable("the journal is closed; open it again")
                    while self._idle:
                        conn = self._idle.pop()
                        if _lost(conn):
                            stale.append(conn)
                            continue
                        self._busy += 1
                        return conn
                    if self._busy < self._size:
                        self._busy += 1
                        break
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise JournalUnavailable(f"no free connection within {self._wait_s:g}s "
                                                 f"({self._size} in use)")
                    self._cond.wait(left)
        finally:
            for conn in stale:
                _close(conn)
        try:
            return self._new()
        except BaseException:
            with self._cond:
                self._busy -= 1
                self._cond.notify()
            raise

    def _put(self, conn: Any) -> None:
        keep = not _lost(conn) and conn.info.transaction_status == _IDLE
        with self._cond:
            self._busy -= 1
            if keep and not self._closed:
                self._idle.append(conn)
                conn = None
            self._cond.notify()
        if conn is not None:
            _close(conn)

    def discard_idle(self) -> None:
        with self._cond:
            idle, self._idle = self._idle, []
        for conn in idle:
            _close(conn)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self.discard_idle()


def _close(conn: Any) -> None:
    with contextlib.suppress(Exception):
        conn.close()


_IDLE = psycopg.pq.TransactionStatus.IDLE if psycopg is not None else None


def _need_psycopg() -> None:
    if psycopg is None:
        raise ConfigError("a PostgreSQL journal needs psycopg 3: pip install "
                          "'boundloop[postgres]'")


def _quote_ident(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def _lock_key(schema: str) -> int:
    """The advisory lock taken while the schema is created or migrated."""
    digest = hashlib.blake2b(b"boundloop schema\x00" + schema.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big", signed=True)


def _display(url: str) -> str:
    """The URL without its password, for messages."""
    try:
        params = _conninfo.conninfo_to_dict(url)
    except Exception:  # noqa: BLE001 - a bad URL is reported when connecting
        return "a PostgreSQL journal"
    user = str(params.get("user", ""))
    host = str(params.get("host", ""))
    port = str(params.get("port", ""))
    where = f"{host}:{port}" if port else host
    return f"postgresql://{user + '@' if user else ''}{where}/{params.get('dbname', '')}"


def _lost(conn: Any) -> bool:
    """True when the connection can no longer be used (it was lost or broken)."""
    return bool(conn is None or conn.closed or conn.broken)

