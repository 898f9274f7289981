"""Every ```python block of README.md and docs/ runs, as shown, in a fresh directory.

Each block is written to a file in a fresh temporary directory and run with a subprocess
(``python block.py``), bounded in time, with ``$XDG_STATE_HOME`` in that directory (the
redaction keys go there) and a fake provider on loopback for the official SDKs
(``ANTHROPIC_BASE_URL``, ``OPENAI_BASE_URL`` and test keys point at it), so the blocks that
use Claude or GPT run without the network. A block fails the test when it exits non-zero.

An HTML comment on the line just before a block's fence says how to run it:

- ``<!-- test: skip -->``: a fragment; not run (keep these few).
- ``<!-- test: file=NAME -->``: the block is also saved as ``NAME``; every later block of
  the same page finds ``NAME`` in its directory (a module the page's other blocks import).
- ``<!-- test: sigterm=N -->``: a program that serves until SIGTERM: it gets SIGTERM after
  N seconds and must then exit 0.
- ``<!-- test: timeout=N -->``: a bound other than the default 60 s.
- ``<!-- test: postgres -->``: needs PostgreSQL: the block gets a fresh database on the
  suite's own server (tests/pg_server.py, the ``pg`` fixture), its URL in
  ``$BOUNDLOOP_JOURNAL``; skipped, as the suite's other PostgreSQL tests are, without one.

Options combine: ``<!-- test: file=app.py, sigterm=3 -->``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.fake_provider import (
    FakeProvider,
    Recorded,
    anthropic_sse,
    chat_sse,
    responses_sse,
    sse_bytes,
)

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
DEFAULT_TIMEOUT_S = 60.0

FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<lang>[\w+-]*)[^\n]*$")
DIRECTIVE = re.compile(r"^\s*<!--\s*test:\s*(?P<options>.*?)\s*-->\s*$")


@dataclasses.dataclass
class Block:
    page: Path
    line: int  # 1-based line of the opening fence
    source: str
    options: dict[str, str]
    files: dict[str, str]  # NAME -> source of the page's earlier file= blocks

    @property
    def id(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def _options(text: str) -> dict[str, str]:
    options: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, _, value = part.partition("=")
        options[key.strip()] = value.strip()
    unknown = set(options) - {"skip", "file", "sigterm", "timeout", "postgres"}
    assert not unknown, f"unknown test options {sorted(unknown)}"
    return options


def blocks_of(page: Path) -> list[Block]:
    lines = page.read_text(encoding="utf-8").splitlines()
    found: list[Block] = []
    files: dict[str, str] = {}
    i = 0
    while i < len(lines):
        match = FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        indent, lang = match["indent"], match["lang"]
        end = i + 1
        while end < len(lines) and lines[end].strip() != "```":
            end += 1
        body = [line[len(indent):] if line.startswith(indent) else line.lstrip()
                for line in lines[i + 1:end]]
        if lang in ("python", "py"):
            prev = i - 1
            while prev >= 0 and not lines[prev].strip():
                prev -= 1
            directive = DIRECTIVE.match(lines[prev]) if prev >= 0 else None
            options = _options(directive["options"]) if directive else {}
            source = "\n".join(body) + "\n"
            found.append(Block(page, i + 1, source, options, dict(files)))
            if "file" in options:
                files[options["file"]] = source
        i = end + 1
    return found


ALL = [block for page in PAGES for block in blocks_of(page)]


def test_blocks_found() -> None:
    """The collection works: README and the docs have runnable blocks, few skipped."""
    assert len(ALL) >= 20, [b.id for b in ALL]
    skipped = [b.id for b in ALL if "skip" in b.options]
    assert len(skipped) <= len(ALL) // 4, skipped


# --- the fake provider's answers ---------------------------------------------------------

def _answer(request: Recorded) -> tuple[int, dict[str, str], object]:
    """A final answer in the shape of whichever API was called; as the provider's event
    stream when the request asks for one (``"stream": true``)."""
    status, headers, answer = _whole_answer(request)
    body = request.body if isinstance(request.body, dict) else {}
    if status != 200 or not body.get("stream") or not isinstance(answer, dict):
        return status, headers, answer
    path = request.path.split("?")[0]
    events = anthropic_sse(answer) if path.endswith("/messages") else \
        chat_sse(answer) if path.endswith("/chat/completions") else responses_sse(answer)
    return 200, {"content-type": "text/event-stream"}, sse_bytes(events)


def _whole_answer(request: Recorded) -> tuple[int, dict[str, str], object]:
    path = request.path.split("?")[0]
    body = request.body if isinstance(request.body, dict) else {}
    model = body.get("model", "fake-model")
    if path.endswith("/messages"):  # Anthropic Messages
        return 200, {}, {
            "id": "msg_docs", "type": "message", "role": "assistant", "model": model,
            "content": [{"type": "text", "text": "It is sunny in Paris."}],
            "stop_reason": "end_turn", "stop_sequence": None,
            "usage": {"input_tokens": 20, "output_tokens": 7}}
    if path.endswith("/chat/completions"):  # OpenAI Chat Completions
        return 200, {}, {
            "id": "chatcmpl-docs", "object": "chat.completion", "created": int(time.time()),
            "model": model,
            "choices": [{"index": 0, "finish_reason": "stop", "message": {
                "role": "assistant", "content": "It is sunny in Paris."}}],
            "usage": {"prompt_tokens": 20, "completion_tokens": 7, "total_tokens": 27}}
    if path.endswith("/responses"):  # OpenAI Responses
        return 200, {}, {
            "id": "resp_docs", "object": "response", "created_at": int(time.time()),
            "model": model, "status": "completed", "output": [{
                "type": "message", "id": "msg_docs", "role": "assistant",
                "status": "completed", "content": [{
                    "type": "output_text", "text": "It is sunny in Paris.",
                    "annotations": []}]}],
            "parallel_tool_calls": True, "tool_choice": "auto", "tools": [],
            "usage": {"input_tokens": 20, "output_tokens": 7, "total_tokens": 27,
                      "input_tokens_details": {"cached_tokens": 0},
                      "output_tokens_details": {"reasoning_tokens": 0}}}
    return 404, {}, {"error": {"message": f"the docs' fake provider has no {path}"}}


# --- running a block ---------------------------------------------------------------------

@pytest.mark.timeout(180)
@pytest.mark.parametrize("block", [pytest.param(b, id=b.id) for b in ALL])
def test_block_runs(block: Block, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    if "skip" in block.options:
        pytest.skip("a fragment (marked <!-- test: skip -->)")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("BOUNDLOOP_", "ANTHROPIC_", "OPENAI_", "OTEL_"))}
    if "postgres" in block.options:
        pg = request.getfixturevalue("pg")
        env["BOUNDLOOP_JOURNAL"] = pg.create_database(f"docs_{uuid.uuid4().hex[:12]}")
    for name, source in block.files.items():
        (tmp_path / name).write_text(source, encoding="utf-8")
    script = tmp_path / block.options.get("file", "block.py")
    script.write_text(block.source, encoding="utf-8")
    with FakeProvider() as fake:
        for _ in range(200):
            fake.reply_with(_answer)
        env.update({
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])),
            "XDG_STATE_HOME": str(tmp_path / "state"),
            "ANTHROPIC_API_KEY": "sk-ant-docs-test", "ANTHROPIC_BASE_URL": fake.url,
            "OPENAI_API_KEY": "sk-docs-test", "OPENAI_BASE_URL": f"{fake.url}/v1",
            "PYTHONUNBUFFERED": "1",
        })
        timeout = float(block.options.get("timeout") or DEFAULT_TIMEOUT_S)
        proc = subprocess.Popen([sys.executable, script.name], cwd=tmp_path, env=env,
                                stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            if "sigterm" in block.options:
                try:
                    out, _ = proc.communicate(timeout=float(block.options["sigterm"]))
                    pytest.fail(f"{block.id} ended before SIGTERM:\n{out}")
                except subprocess.TimeoutExpired:
                    proc.send_signal(signal.SIGTERM)
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
            pytest.fail(f"{block.id} took more than {timeout:.0f} s:\n{out}")
    assert proc.returncode == 0, f"{block.id} exited {proc.returncode}:\n{out}"
    assert "Traceback" not in out, f"{block.id}:\n{out}"


def test_fake_answers_are_json() -> None:
    for path in ("/v1/messages", "/v1/chat/completions", "/v1/responses"):
        status, _, body = _answer(Recorded("POST", path, {}, b"", {"model": "m"}, 0.0))
        assert status == 200 and json.dumps(body)


def test_readme_set_up_commands_are_what_ci_runs() -> None:
    """README's first code block is the two set-up commands, the second one verbatim what
    .ci/run runs; the README stays a short first read (the rest is in docs/)."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    first = re.search(r"```(\w*)\n(.*?)```", readme, re.S)
    assert first is not None and first[1] == "sh"
    commands = first[2].strip().splitlines()
    assert commands[0] == "pip install . && boundloop demo"
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8").strip().splitlines()[-1]
    assert commands == [commands[0], ci]
    assert "mkdocs build --strict" in ci
    assert len(readme.splitlines()) <= 210
    assert "SPEC" not in readme
    for page in (ROOT / "docs").rglob("*.md"):
        assert "SPEC" not in page.read_text(encoding="utf-8"), page
