"""SPEC 9, "a value redacted anywhere in a run": secrets redacted before a resume, in a
parent run, or cut short in a long text are never journaled in clear afterwards."""

from __future__ import annotations

import time
from pathlib import Path

import msgspec

import boundloop as bl

KEY = bytes(range(7, 39))
#: With spaces: a fresh runner cannot learn it back from its digest, the same runner can.
PHRASE = "correct horse battery staple 42"
TOKEN = "hunter2-SECRET-xyz"


def journal_text(runner: bl.Runner) -> str:
    return "\n".join(msgspec.json.encode(e).decode()
                     for run_id in runner.journal.runs() for e in runner.journal.events(run_id))


def tools(secret: str) -> list[bl.Tool]:
    @bl.tool()
    def login(user: str, password: str) -> str:
        """Log in."""
        return "ok"

    @bl.tool(irreversible=True, timeout_s=0.2)
    def transfer(amount: int) -> str:
        """Move money (hangs: its outcome stays unknown)."""
        time.sleep(1.0)
        return "sent"

    @bl.tool(read_only=True)
    def whoami() -> str:
        """Say who is logged in."""
        return f"bob, whose password is {secret}"

    return [login, transfer, whoami]


def review_run(runner: bl.Runner, secret: str) -> bl.RunResult:
    """A run that redacts ``secret`` (a password argument), then needs review."""
    model = bl.ScriptedModel([
        bl.CallTools([bl.ToolCall("c1", "login", {"user": "bob", "password": secret})]),
        bl.CallTools([bl.ToolCall("c2", "transfer", {"amount": 5})])])
    result = runner.run(model=model, tools=tools(secret), prompt="pay", run_id="R")
    assert result.status == "needs_review", result
    assert secret not in journal_text(runner)
    return result


def resume(runner: bl.Runner, result: bl.RunResult,
           secret: str) -> tuple[bl.RunResult, list[bl.events.Event]]:
    """Resolve and resume the run; the result and the run's events, checked to hold no
    clear ``secret``."""
    runner.resolve("R", result.unresolved[0].execution_id, "failed",
                   note=f"bob's password {secret} had expired", by=f"ops {secret}")
    model = bl.ScriptedModel([bl.CallTools([bl.ToolCall("c3", "whoami", {})]),
                              bl.Final(f"retried with {secret}")])
    again = runner.resume("R", model=model, tools=tools(secret))
    assert again.status == "final", again
    assert secret not in journal_text(runner)
    return again, list(runner.journal.events("R"))


def test_a_resume_on_the_same_runner_remembers_every_secret_the_run_redacted(
        tmp_path: Path) -> None:
    with bl.Runner(tmp_path / "j", redaction_key=KEY) as runner:
        again, events = resume(runner, review_run(runner, PHRASE), PHRASE)
        resolved = next(e for e in events if isinstance(e, bl.events.CallResolved))
        assert resolved.by.startswith("ops hmac-sha256:")
        assert "hmac-sha256:" in resolved.note and "expired" in resolved.note
        final = [e for e in events if isinstance(e, bl.events.ModelStepCompleted)][-1]
        assert isinstance(final.response, bl.Final)
        assert final.response.text.startswith("retried with hmac-sha256:")
        # The result's transcript is the journal's (SPEC 6): the same, redacted.
        assert again.transcript == bl.replay(events).transcript
        assert PHRASE not in msgspec.json.encode(again.transcript).decode()


def test_a_resume_on_a_fresh_runner_learns_the_secrets_from_the_journals_digests(
        tmp_path: Path) -> None:
    with bl.Runner(tmp_path / "j", redaction_key=KEY) as runner:
        first = review_run(runner, TOKEN)
    with bl.Runner(tmp_path / "j", redaction_key=KEY) as runner:
        _, events = resume(runner, first, TOKEN)
        decided = next(e for e in events if isinstance(e, bl.events.CallDecided))
        password = decided.arguments["password"]
        assert password.startswith("hmac-sha256:")
        # The same digest as the password argument's: one secret, one digest.
        result = [e for e in events if isinstance(e, bl.events.CallSucceeded)][-1]
        assert result.content == f"bob, whose password is {password}"
        resolved = next(e for e in events if isinstance(e, bl.events.CallResolved))
        assert resolved.note == f"bob's password {password} had expired"
        assert resolved.by == f"ops {password}"


def test_a_child_run_never_journals_a_secret_its_parent_redacted(tmp_path: Path) -> None:
    @bl.tool(read_only=True)
    def echo(text: str) -> str:
        """Echo."""
        return text

    @bl.tool()
    def delegate(task: str, api_key: str, ctx: bl.ToolContext) -> str:
        """Hand the task to a child run."""
        child = bl.ScriptedModel([
            bl.CallTools([bl.ToolCall("k1", "echo", {"text": f"using {api_key}"})]),
            bl.Final(f"child done with {api_key}")])
        return ctx.run_child(model=child, tools=[echo],
                             prompt=f"{task}; the key is {api_key}").status

    model = bl.ScriptedModel([
        bl.CallTools([bl.ToolCall("c1", "delegate", {"task": "do it", "api_key": PHRASE})]),
        bl.Final("ok")])
    with bl.Runner(tmp_path / "j", redaction_key=KEY) as runner:
        result = runner.run(model=model, tools=[delegate, echo], prompt="go")
        assert result.status == "final", result
        assert result.completed[0].status == "ok"
        children = [r for r in runner.journal.runs() if r != result.run_id]
        assert len(children) == 1
        child_events = list(runner.journal.events(children[0]))
        admitted = child_events[0]
        assert isinstance(admitted, bl.events.RunAdmitted)
        assert admitted.parent_run_id == result.run_id
        assert "the key is hmac-sha256:" in admitted.history[0].text
        assert bl.replay(child_events).status == "final"
        assert PHRASE not in journal_text(runner)


def test_an_exception_text_cut_short_inside_a_secret_keeps_no_part_of_it(
        tmp_path: Path) -> None:
    secret = "s3cr3t-" + "k" * 60

    @bl.tool()
    def login(user: str, password: str) -> str:
        """Log in."""
        return "ok"

    @bl.tool(read_only=True)
    def fetch() -> str:
        """Fails with a long message that quotes the secret near the cut."""
        raise RuntimeError("x" * 1970 + f" {secret} tail")

    model = bl.ScriptedModel([
        bl.CallTools([bl.ToolCall("c1", "login", {"user": "bob", "password": secret})]),
        bl.CallTools([bl.ToolCall("c2", "fetch", {})]), bl.Final("done")])
    with bl.Runner(tmp_path / "j", redaction_key=KEY) as runner:
        result = runner.run(model=model, tools=[login, fetch], prompt="go")
        assert result.status == "final", result
        assert [c.status for c in result.completed] == ["ok", "error"]
        failed = [e for e in runner.journal.events(result.run_id)
                  if isinstance(e, bl.events.CallFailed)]
        assert len(failed) == 1 and failed[0].content.endswith("\u2026")
        assert "hmac-sha256:" in failed[0].content[-80:]
        assert secret[:12] not in journal_text(runner)


def test_a_quoted_credential_value_is_redacted_past_an_escaped_quote() -> None:
    from boundloop.policy.redact import Scrubber

    scrubber = Scrubber(KEY)
    out = scrubber.text('{"password": "ab\\"SECRET-after-quote", "user": "bob"}')
    assert "SECRET" not in out and '"user": "bob"' in out
    assert out.startswith('{"password": "hmac-sha256:')
    assert "after-quote" not in scrubber.text("password='it\\'s after-quote' ok")


def test_credential_keys_in_provider_content_are_redacted(tmp_path: Path) -> None:
    @bl.tool(read_only=True)
    def note(text: str) -> str:
        """Take a note."""
        return "ok"

    block = {"type": "mcp_tool_use", "id": "m1", "name": "fetch", "input": {"api_key": TOKEN}}
    thinking = {"type": "thinking", "thinking": "let me see", "signature": "c2lnbmVk"}
    model = bl.ScriptedModel([
        bl.CallTools([bl.ToolCall("c1", "note", {"text": "a"})], content=[block, thinking]),
        bl.Final("done")])
    history = [{"kind": "user", "text": "hi"},
               {"kind": "assistant", "step": 1, "text": "ok",
                "content": [{"type": "x", "input": {"password": PHRASE}}]},
               {"kind": "user", "text": "go on"}]
    with bl.Runner(tmp_path / "j", redaction_key=KEY) as runner:
        result = runner.run(model=model, tools=[note], history=history)
        assert result.status == "final", result
        text = journal_text(runner)
        assert TOKEN not in text and PHRASE not in text
        events = list(runner.journal.events(result.run_id))
        completed = next(e for e in events if isinstance(e, bl.events.ModelStepCompleted))
        assert isinstance(completed.response, bl.CallTools)
        kept_block, kept_thinking = completed.response.content
        assert kept_block["input"]["api_key"].startswith("hmac-sha256:")
        assert kept_block["name"] == "fetch" and kept_thinking == thinking  # sent back as is
        admitted = events[0]
        assert isinstance(admitted, bl.events.RunAdmitted)
        assert admitted.history[1].content[0]["input"]["password"].startswith("hmac-sha256:")


def test_a_resumed_scrubber_learns_a_secret_back_from_its_digest_in_any_word_form() -> None:
    from boundloop.policy.redact import Scrubber, digest

    pin, token = 98765432, "tok-1234567890abcdef"
    scrubber = Scrubber(KEY, digests={digest(KEY, pin), digest(KEY, token)})
    out = scrubber.text(f"retry with pin {pin}, then token={token}.")
    assert out == f"retry with pin {digest(KEY, pin)}, then token={digest(KEY, token)}."
    assert scrubber.remembered == 2
    # Learned once, replaced everywhere after; other words are left as they were.
    assert scrubber.text(f"({token})") == f"({digest(KEY, token)})"
    assert scrubber.text("order 12345678 shipped") == "order 12345678 shipped"


def test_scrubbed_names_and_keys_replay_to_the_result_and_a_resume_keeps_them_scrubbed(
        tmp_path: Path) -> None:
    """A tool name, an exception class's name and a result key holding a redacted value are
    journaled scrubbed, the same in the RunResult and in ``replay`` of the journal, and they
    stay scrubbed in the history a resume on a fresh runner hands the model."""
    c = bl.ToolCall

    @bl.tool()
    def keyed() -> dict[str, int]:
        return {TOKEN: 1, "n": 2}

    @bl.tool()
    def boom() -> str:
        raise type("Err" + TOKEN.replace("-", ""), (RuntimeError,), {})("no")

    @bl.tool(irreversible=True, timeout_s=0.2)
    def transfer(amount: int) -> str:
        time.sleep(1.0)
        return "sent"

    quiet = TOKEN.replace("-", "")
    model = bl.ScriptedModel([
        bl.CallTools([c("c1", "login", {"user": "bob", "password": TOKEN}),
                      c("c1b", "login", {"user": "bob", "password": quiet})]),
        bl.CallTools([c("c2", TOKEN, {}), c("c3", "keyed", {}), c("c4", "boom", {})]),
        bl.CallTools([c("c5", "transfer", {"amount": 5})])])
    everything = [*tools(TOKEN)[:1], keyed, boom, transfer]
    with bl.Runner(tmp_path / "j", redaction_key=KEY) as runner:
        result = runner.run(model=model, tools=everything, prompt="go", run_id="R")
        assert result.status == "needs_review", result.explanation
        replayed = bl.replay(runner.journal.events("R"))
        assert msgspec.json.encode(replayed.transcript) == msgspec.json.encode(result.transcript)
        assert [a.tool for a in result.completed][2] == bl.policy.redact.digest(KEY, TOKEN)
        text = journal_text(runner) + msgspec.json.encode(result).decode()
        assert TOKEN not in text and quiet not in text
        unresolved = result.unresolved[0].execution_id
    seen: list[str] = []

    def look(history: list[bl.messages.Message], ctx: bl.ModelContext) -> bl.Final:
        seen.append(msgspec.json.encode(history).decode())
        return bl.Final("done")

    with bl.Runner(tmp_path / "j", redaction_key=KEY) as fresh:
        fresh.resolve("R", unresolved, "failed")
        again = fresh.resume("R", model=look, tools=everything)
        assert again.status == "final", again.explanation
        assert seen and TOKEN not in seen[0] and quiet not in seen[0]
        assert TOKEN not in journal_text(fresh) and quiet not in journal_text(fresh)
