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

A canned response may also be a callable ``(request) -> (status, headers, body)``, or a
server-sent-event stream (``fake.stream(events, gap_s=...)``: each event written and
flushed on its own, ``gap_s`` apart, the connection closed after the last; the returned
``StreamLog`` says how many events were written and whether the client closed the
connection before the end). ``anthropic_sse``, ``chat_sse`` and ``responses_sse`` turn a
canned response body into the events the provider streams for it. When
the queue is empty the server answers 500 with a JSON error saying so (the test then fails
on what the SDK raises, and ``fake.unanswered`` counts it). The server runs in a daemon
thread; ``stop()`` (or leaving the ``with`` block) shuts it down and closes its socket.
Use the ``fake_provider()`` generator in a pytest fixture.
"""

from __future__ import annotations

import dataclasses
import json
import select
import socket
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
class StreamLog:
    """What became of one streamed reply."""

    total: int  # the events it had
    sent: int = 0  # the events written before the end, or before the client left
    aborted: bool = False  # the client closed the connection before the last event
    done: threading.Event = dataclasses.field(default_factory=threading.Event)


#: One server-sent event: its ``event:`` name (None: no such line) and its data (a dict,
#: sent as JSON, or a string as it is, e.g. ``[DONE]``).
SSE = tuple[str | None, Any]


@dataclasses.dataclass
class _Stream:
    events: list[SSE]
    gap_s: float
    log: StreamLog
    stall: tuple[int, float] | None = None


@dataclasses.dataclass
class _Reply:
    answer: Canned | Callable[[Recorded], Canned] | _Stream
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

    def stream(self, events: list[SSE], *, gap_s: float = 0.0, delay_s: float = 0.0,
               stall: tuple[int, float] | None = None) -> StreamLog:
        """Queue a ``text/event-stream`` response: ``events`` written one by one, ``gap_s``
        apart (``stall=(n, seconds)``: and a pause of ``seconds`` after the first ``n``).
        The returned log fills in as the stream is served."""
        log = StreamLog(len(events))
        with self._lock:
            self._queue.append(_Reply(_Stream(list(events), gap_s, log, stall), delay_s))
        return log

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
            if isinstance(answer, _Stream):
                self._serve_stream(handler, answer)
                return
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


    def _serve_stream(self, handler: BaseHTTPRequestHandler, stream: _Stream) -> None:
        log = stream.log
        handler.close_connection = True
        try:
            handler.send_response(200)
            handler.send_header("content-type", "text/event-stream")
            handler.send_header("cache-control", "no-cache")
            handler.send_header("connection", "close")
            handler.end_headers()
            handler.wfile.flush()
            for index, (name, data) in enumerate(stream.events):
                pause = stream.gap_s if index else 0.0
                if stream.stall is not None and index == stream.stall[0]:
                    pause += stream.stall[1]
                if pause and self._stopping.wait(pause):
                    return
                if _peer_closed(handler.connection):
                    log.aborted = True
                    return
                text = data if isinstance(data, str) else json.dumps(data)
                chunk = (f"event: {name}\n" if name else "") + f"data: {text}\n\n"
                handler.wfile.write(chunk.encode())
                handler.wfile.flush()
                log.sent = index + 1
        except (BrokenPipeError, ConnectionResetError):
            log.aborted = True
        finally:
            log.done.set()


def _peer_closed(conn: socket.socket) -> bool:
    """Whether the client closed its end (the socket reads as ended or reset)."""
    try:
        readable, _, _ = select.select([conn], [], [], 0)
        if not readable:
            return False
        return conn.recv(1, socket.MSG_PEEK) == b""
    except (OSError, ValueError):
        return True


# --- canned streams: the events a provider sends for a response body ------------------------

def _pieces(text: str, size: int) -> list[str]:
    return [text[i:i + size] for i in range(0, len(text), size)] or [""]


def anthropic_sse(message: dict[str, Any], *, chunk: int = 8) -> list[SSE]:
    """The Messages API stream for the response body ``message``: message_start (its input
    usage), each block's start, deltas of ``chunk`` characters and stop, message_delta
    (stop reason and output usage), message_stop."""
    usage = dict(message.get("usage") or {})
    start_usage = {**usage, "output_tokens": 1}
    events: list[SSE] = [("message_start", {"type": "message_start", "message": {
        **message, "content": [], "stop_reason": None, "stop_sequence": None,
        "usage": start_usage}})]
    for index, block in enumerate(message.get("content") or []):
        kind = block.get("type")
        if kind == "text":
            start, deltas = {**block, "text": ""}, [
                {"type": "text_delta", "text": p} for p in _pieces(block["text"], chunk)]
        elif kind == "tool_use":
            raw = json.dumps(block.get("input"))
            start, deltas = {**block, "input": {}}, [
                {"type": "input_json_delta", "partial_json": p} for p in _pieces(raw, chunk)]
        elif kind == "thinking":
            start = {**block, "thinking": "", "signature": ""}
            deltas = [{"type": "thinking_delta", "thinking": p}
                      for p in _pieces(block["thinking"], chunk)]
            deltas.append({"type": "signature_delta", "signature": block["signature"]})
        else:
            start, deltas = block, []
        events.append(("content_block_start", {"type": "content_block_start", "index": index,
                                               "content_block": start}))
        events += [("content_block_delta", {"type": "content_block_delta", "index": index,
                                            "delta": d}) for d in deltas]
        events.append(("content_block_stop", {"type": "content_block_stop", "index": index}))
    events.append(("message_delta", {
        "type": "message_delta",
        "delta": {"stop_reason": message.get("stop_reason"),
                  "stop_sequence": message.get("stop_sequence")},
        "usage": {"output_tokens": usage.get("output_tokens", 0)}}))
    events.append(("message_stop", {"type": "message_stop"}))
    return events


def chat_sse(completion: dict[str, Any], *, chunk: int = 8, usage: bool = True) -> list[SSE]:
    """The Chat Completions stream (``stream_options.include_usage``) for the response body
    ``completion``: a role chunk, content and tool-call argument deltas of ``chunk``
    characters, a chunk with the finish reason, the usage chunk, ``[DONE]``."""
    head = {k: completion[k] for k in ("id", "created", "model") if k in completion}
    head["object"] = "chat.completion.chunk"

    def piece(delta: dict[str, Any], finish: str | None = None) -> SSE:
        return (None, {**head, "choices": [{"index": 0, "delta": delta,
                                            "finish_reason": finish}]})

    choice = completion["choices"][0]
    message = choice["message"]
    events = [piece({"role": "assistant", "content": ""})]
    if message.get("refusal"):
        events += [piece({"refusal": p}) for p in _pieces(message["refusal"], chunk)]
    if message.get("content"):
        events += [piece({"content": p}) for p in _pieces(message["content"], chunk)]
    for index, call in enumerate(message.get("tool_calls") or []):
        fn = call["function"]
        events.append(piece({"tool_calls": [{"index": index, "id": call["id"],
                                             "type": "function",
                                             "function": {"name": fn["name"],
                                                          "arguments": ""}}]}))
        events += [piece({"tool_calls": [{"index": index, "function": {"arguments": p}}]})
                   for p in _pieces(fn["arguments"], chunk)]
    events.append(piece({}, choice.get("finish_reason")))
    if usage and completion.get("usage") is not None:
        events.append((None, {**head, "choices": [], "usage": completion["usage"]}))
    events.append((None, "[DONE]"))
    return events


def responses_sse(response: dict[str, Any], *, chunk: int = 8) -> list[SSE]:
    """The Responses API stream for the response body ``response``: response.created,
    each output item added, its text / argument deltas of ``chunk`` characters and done,
    then response.completed (or .incomplete / .failed, by the body's status)."""
    seq = iter(range(1, 10_000))
    created = {**response, "status": "in_progress", "output": [], "usage": None}
    events: list[SSE] = [("response.created", {"type": "response.created",
                                               "sequence_number": 0, "response": created})]
    for index, item in enumerate(response.get("output") or []):
        kind = item.get("type")
        if kind == "message":
            added = {**item, "status": "in_progress", "content": []}
        elif kind == "function_call":
            added = {**item, "status": "in_progress", "arguments": ""}
        else:
            added = item
        events.append(("response.output_item.added", {
            "type": "response.output_item.added", "sequence_number": next(seq),
            "output_index": index, "item": added}))
        if kind == "message":
            for part_index, part in enumerate(item.get("content") or []):
                if part.get("type") != "output_text":
                    continue
                for p in _pieces(part["text"], chunk):
                    events.append(("response.output_text.delta", {
                        "type": "response.output_text.delta", "sequence_number": next(seq),
                        "item_id": item.get("id", ""), "output_index": index,
                        "content_index": part_index, "delta": p, "logprobs": []}))
        elif kind == "function_call":
            for p in _pieces(item.get("arguments") or "", chunk):
                events.append(("response.function_call_arguments.delta", {
                    "type": "response.function_call_arguments.delta",
                    "sequence_number": next(seq), "item_id": item.get("id", ""),
                    "output_index": index, "delta": p}))
        events.append(("response.output_item.done", {
            "type": "response.output_item.done", "sequence_number": next(seq),
            "output_index": index, "item": item}))
    status = response.get("status") or "completed"
    name = {"incomplete": "response.incomplete", "failed": "response.failed"}.get(
        status, "response.completed")
    events.append((name, {"type": name, "sequence_number": next(seq), "response": response}))
    return events


def sse_bytes(events: list[SSE]) -> bytes:
    """``events`` as one ``text/event-stream`` body (for a canned reply sent at once)."""
    out = []
    for name, data in events:
        text = data if isinstance(data, str) else json.dumps(data)
        out.append((f"event: {name}\n" if name else "") + f"data: {text}\n\n")
    return "".join(out).encode()


def fake_provider() -> Iterator[FakeProvider]:
    """For a pytest fixture: ``yield from fake_provider()`` starts one and stops it after."""
    fake = FakeProvider().start()
    try:
        yield fake
    finally:
        fake.stop()
