"""A fake HTTP provider on 127.0.0.1 for adapter tests: the official SDKs talk to it.

It records every request (method, path, headers, JSON body, arrival time) and answers each
from a queue of canned responses, in order::

    with FakeProvider() as fake:
        fake.reply(200, {"id": "msg_1", ...})                 # a JSON body
        fake.reply(429, {"error": ...}, headers={"retry-after": "1"})
        fake.reply(200, {...}, delay_s=2.0)                   # answer slowly
        client = anthropic.Anthropic(api_key="test", base_url=fake.url)
        ...
        fake.requests[0].body["messages"]

A canned response may also be a callable ``(request) -> (status, headers, body)``. When
the queue is empty the server answers 500 with a JSON error saying so (the test then fails
on what the SDK raises, and ``fake.unanswered`` counts it). The server runs in a daemon
thread; ``stop()`` (or leaving the ``with`` block) shuts it down and closes its socket.
Use the ``fake_provider()`` generator in a pytest fixture.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

Canned = tuple[int, dict[str, str], Any]


@dataclasses.dataclass
class Recorded:
    """One request the fake received."""

    method: str
    path: str
    headers: dict[str, str]  # lower-case names
    raw: bytes
    body: Any  # the decoded JSON body, or None when it was not JSON
    at: float  # time.monotonic() on arrival


@dataclasses.dataclass
class _Reply:
    answer: Canned | Callable[[Recorded], Canned]
    delay_s: float = 0.0


class FakeProvider:
    """A canned-response HTTP server on loopback (see the module docstring)."""

    def __init__(self) -> None:
        self.requests: list[Recorded] = []
        self.unanswered = 0
        self._queue: deque[_Reply] = deque()
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # --- life -------------------------------------------------------------------------

    @property
    def url(self) -> str:
        """The base URL, ``http://127.0.0.1:PORT``."""
        assert self._server is not None, "start() the FakeProvider first"
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def start(self) -> FakeProvider:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
                pass  # quiet

            def _handle(self) -> None:
                fake._serve(self)

            do_POST = do_GET = do_PUT = do_DELETE = do_PATCH = _handle  # noqa: N815

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        kwargs={"poll_interval": 0.05},
                                        name="fake-provider", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopping.set()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        if self._thread is not None:
            self._thread.join(5)

    def __enter__(self) -> FakeProvider:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- canned responses --------------------------------------------------------------

    def reply(self, status: int = 200, body: Any = None, *,
              headers: dict[str, str] | None = None, delay_s: float = 0.0) -> None:
        """Queue a response: ``body`` is sent as JSON (a ``bytes`` body as it is)."""
        with self._lock:
            self._queue.append(_Reply((status, dict(headers or {}), body), delay_s))

    def reply_with(self, fn: Callable[[Recorded], Canned], *, delay_s: float = 0.0) -> None:
        """Queue a response computed from the request: ``fn(request) -> (status, headers,
        body)``."""
        with self._lock:
            self._queue.append(_Reply(fn, delay_s))

    @property
    def pending(self) -> int:
        """Canned responses not yet used."""
        with self._lock:
            return len(self._queue)

    # --- serving -----------------------------------------------------------------------

    def _serve(self, handler: BaseHTTPRequestHandler) -> None:
        length = int(handler.headers.get("content-length") or 0)
        raw = handler.rfile.read(length) if length else b""
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = None
        request = Recorded(handler.command, handler.path,
                           {k.lower(): v for k, v in handler.headers.items()}, raw, body,
                           time.monotonic())
        with self._lock:
            self.requests.append(request)
            reply = self._queue.popleft() if self._queue else None
        if reply is None:
            with self._lock:
                self.unanswered += 1
            status, headers, payload = 500, {}, {
                "type": "error",
                "error": {"type": "api_error", "message": "fake provider: no canned response"}}
        else:
            if reply.delay_s and self._stopping.wait(reply.delay_s):
                return
            answer = reply.answer
            status, headers, payload = answer(request) if callable(answer) else answer
        data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        try:
            handler.send_response(status)
            lower = {k.lower() for k in headers}
            if "content-type" not in lower:
                handler.send_header("content-type", "application/json")
            for name, value in headers.items():
                handler.send_header(name, value)
            handler.send_header("content-length", str(len(data)))
            handler.end_headers()
            handler.wfile.write(data)
            handler.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client gave up (a timeout): nothing to answer


def fake_provider() -> Iterator[FakeProvider]:
    """For a pytest fixture: ``yield from fake_provider()`` starts one and stops it after."""
    fake = FakeProvider().start()
    try:
        yield fake
    finally:
        fake.stop()
