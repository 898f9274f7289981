"""Secrets never reach the journal in clear (SPEC 9).

First the pure parts: which keys name credentials (a test per word and per false positive),
the credential-shaped patterns (a test per pattern), and the per-run ``Scrubber``. Then the
sweep: real runs place secrets in every kind of text a run journals (and in names and keys:
tool names, exception class names, result keys), and the raw journal bytes, the RunResults,
the spans, ``export``, ``export --strip-content``, ``show``, ``show --json``, ``runs --json``
and ``stats`` are searched for each clear secret. Last, a copied journal directory alone
confirms none of the credentials it digested.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import boundloop as bl
from boundloop import keys
from boundloop.policy import redact as pr
from boundloop.policy.redact import Scrubber

KEY = bytes(range(7, 39))


def dg(value: Any) -> str:
    return pr.digest(KEY, value)


# == which keys name credentials ============================================================
CREDENTIAL_KEYS = [
    # SPEC 9's words, then the usual others.
    "password", "passwd", "pwd", "passcode", "pin", "token", "jwt", "api_key",
    "authorization", "secret", "private_key", "session_id", "cookie", "credential",
    "credentials", "access_key", "client_secret", "refresh_token", "passphrase", "otp",
    "access_token", "id_token", "secret_key", "aws_secret_access_key", "bearer", "auth",
    "api_secret", "signing_key", "master_key", "encryption_key", "account_key", "totp", "cvv",
    "secrets", "passwords", "cookies", "pass", "passkey", "creds",
    # Any case style, any separator, one word too.
    "sessionId", "SessionID", "sessionid", "SESSION_ID", "session-id", "privateKey",
    "PrivateKey", "privatekey", "X-Api-Key", "x-api-key", "api-key", "apiKey", "APIKey",
    "APIKEY", "API_KEY", "XApiKey", "Api.Key", "userPIN", "user_pin", "PIN", "JWT",
    "jwtToken", "DB_PASSWORD", "dbPassword", "Password2", "accessToken", "AccessToken",
    "accesstoken", "refreshtoken", "clientSecret", "Set-Cookie", "Proxy-Authorization",
    "phpsessid", "JSESSIONID", "csrf_token", "AccountKey", "secretAccessKey", "X-Auth-Token",
    "otp_code", "pin_code", "passPhrase",
]
NOT_CREDENTIAL_KEYS = [
    "max_tokens", "maxTokens", "MAX_TOKENS", "max_output_tokens", "tokens", "tokenizer",
    "tokenize", "pinned", "spin", "spinner", "pinyin", "author", "authored", "keyboard",
    "secretary", "keys", "key", "monkey", "passage", "passenger", "bypass", "compass",
    "input", "primary_key", "public_key", "cache_key", "idempotency_key", "sort_key",
    "token_count", "tokenCount", "token_ids", "token_usage", "output_token", "input_tokens",
    "page_token", "nextPageToken", "next_token", "pin_memory", "auth_url", "authType",
    "auth_method", "secret_name", "secretRef", "pass_rate", "session", "session_start",
    "cookbook", "tokenomics", "opt", "cvs", "signature", "thinking", "text", "query",
]


@pytest.mark.parametrize("key", CREDENTIAL_KEYS)
def test_names_a_credential(key: str) -> None:
    assert pr.is_credential(key), key
    red, changed = pr.redact({key: "clear-value-1"}, KEY)
    assert changed and red[key] == dg("clear-value-1")


@pytest.mark.parametrize("key", NOT_CREDENTIAL_KEYS)
def test_is_not_a_credential(key: str) -> None:
    assert not pr.is_credential(key), key
    red, changed = pr.redact({key: "kept"}, KEY)
    assert not changed and red == {key: "kept"}


# == credential-shaped text ==================================================================
SK_ANT = "sk-ant-api03-" + "Ab3" * 12
PATTERNS: list[tuple[str, str, str]] = [
    # (what, text, the secret that must go)
    ("pem", "key:\n-----BEGIN RSA PRIVATE KEY-----\nMIIEowIBAAKCAQEA7\nq2Z\n"
            "-----END RSA PRIVATE KEY-----\nend", "MIIEowIBAAKCAQEA7"),
    ("pem openssh", "-----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNzaC1rZXk\n"
                    "-----END OPENSSH PRIVATE KEY-----", "b3BlbnNzaC1rZXk"),
    ("pem cut short", "oops -----BEGIN EC PRIVATE KEY-----\nMHcCAQEEIBk9x", "MHcCAQEEIBk9x"),
    ("pem pgp", "-----BEGIN PGP PRIVATE KEY BLOCK-----\nlQOYBGx\n"
                "-----END PGP PRIVATE KEY BLOCK-----", "lQOYBGx"),
    ("jwt", "auth failed for eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0."
            "dozjgNryP4J3jVmNHl0w5N_XgL0n3I9PlFUP0THsR8U today",
     "dozjgNryP4J3jVmNHl0w5N_XgL0n3I9PlFUP0THsR8U"),
    ("url userinfo", "GET https://alice:Tr0ub4dor@example.com/x failed", "Tr0ub4dor"),
    ("url userinfo with @", "redis://:p@ss@w0rd@cache:6379/0", "p@ss@w0rd"),
    ("dsn", "could not connect to postgresql://app:s3cr3tpw@db.internal:5432/prod",
     "s3cr3tpw"),
    ("dsn key=value", "dsn='host=db port=5432 password=kv-s3cret dbname=prod'", "kv-s3cret"),
    ("bearer", "sent Authorization: Bearer abcDEF0123456789xyz", "abcDEF0123456789xyz"),
    ("bearer lowercase", "header was bearer mF_9.B5f-4.1JqM", "mF_9.B5f-4.1JqM"),
    ("bearer of letters only", "sent Bearer qwertyuiopasdfghjklzxcvbnm", "qwertyuiopasdfghjklzxcv"),
    ("basic", "Basic dXNlcjpwYXNzd29yZA== rejected", "dXNlcjpwYXNzd29yZA=="),
    ("cookie header", "Cookie: sessionid=9f8e7d6c5b4a; theme=dark", "9f8e7d6c5b4a"),
    ("anthropic", f"invalid x-api-key {SK_ANT}", SK_ANT),
    ("openai", "Incorrect API key provided: sk-proj-AbCdEf0123456789GhIjKl", "AbCdEf0123456789"),
    ("stripe", "sk_live_4eC39HqLyjWDarjtT1zdp7dc", "4eC39HqLyjWDarjtT1zdp7dc"),
    ("github", "remote: ghp_16C7e42F292c6912E7710c838347Ae178B4a denied",
     "16C7e42F292c6912E7710c838347Ae178B4a"),
    ("github pat", "github_pat_11ABCDEFG0123456789_abcdefghijklmnopqrstuv", "11ABCDEFG0123456789"),
    ("gitlab", "glpat-xxxxxxxxxxxxxxxxxxxx1234", "xxxxxxxxxxxxxxxxxxxx1234"),
    ("slack", "xoxb-123456789012-1234567890123-AbCdEfGhIjKlMnOp", "AbCdEfGhIjKlMnOp"),
    ("slack webhook", "post to https://hooks.slack.com/services/T00000000/B00000000/XXXXXXXX"
                      "XXXXXXXXXXXXXXXX", "B00000000/XXXXXXXX"),
    ("aws", "AccessKeyId AKIAIOSFODNN7EXAMPLE is not valid", "AKIAIOSFODNN7EXAMPLE"),
    ("google", "key=AIzaSyDaGmWKa4JsXZ-HjGw7ISLn_3namBGewQe", "AIzaSyDaGmWKa4JsXZ"),
    ("google oauth", "ya29.a0AfH6SMBx3k4aZp9-EXAMPLE-token rejected", "a0AfH6SMBx3k4aZp9"),
    ("huggingface", "hf_AbCdEfGhIjKlMnOpQrStUvWxYz01234567", "AbCdEfGhIjKlMnOpQrStUvWxYz"),
    ("npm", "npm_AbCdEfGhIjKlMnOpQrStUvWxYz0123456789", "AbCdEfGhIjKlMnOpQrStUvWxYz0123"),
    ("sendgrid", "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",
     "TwL2iGABf9DHoTf"),
    ("twilio", "SK0123456789abcdef0123456789abcdef", "0123456789abcdef0123456789abcdef"),
    ("groq", "gsk_" + "a1B2" * 12, "a1B2" * 12),
    ("vault", "token hvs.CAESIJ4tdnXbQ0ZFXR2HnWb6 expired", "CAESIJ4tdnXbQ0ZFXR2HnWb6"),
    ("query string", "GET /v1/items?api_key=qs-k3y-1&limit=5&token=qs-t0k-2",
     "qs-k3y-1|qs-t0k-2"),
    ("key=value", "ValueError: password=hunter2 rejected", "hunter2"),
    ("key: value", "config error: secret: shhh-very-quiet", "shhh-very-quiet"),
    ("json", 'body {"api_key": "json-k3y", "name": "bob"}', "json-k3y"),
    ("python repr", "Conn(host='db', password='p w d 1', port=5432)", "p w d 1"),
    ("header name", "X-Api-Key: hdr-k3y-99", "hdr-k3y-99"),
    ("camel key", "sessionId=ab12cd34ef", "ab12cd34ef"),
]


@pytest.mark.parametrize("what, text, secret", PATTERNS, ids=[p[0] for p in PATTERNS])
def test_credential_shaped_text_is_redacted(what: str, text: str, secret: str) -> None:
    scrubber = Scrubber(KEY)
    out = scrubber.text(text)
    for part in secret.split("|"):
        assert part not in out, (what, out)
    assert pr.PREFIX in out
    assert scrubber.text(out) == out  # idempotent: digests are never scrubbed again


SAFE_TEXTS = [
    "Basic authentication is not supported",
    "The bearer of this message is a friend.",
    "max_tokens: 100, tokenizer: gpt2, pinned: yes, token_count=12",
    "See https://example.com/docs?page=2&sort=asc for details",
    "ValueError: invalid literal for int() with base 10: 'abc'",
    "It is 12:30 in Paris; the sky is clear.",
    "a key: value pair, a monkey: banana",
    "ssh://git@github.com/org/repo.git",
    "sk-short and ghp_short are not keys",
    "the model said: eyJ is how base64 JSON starts",
]


@pytest.mark.parametrize("text", SAFE_TEXTS)
def test_ordinary_text_is_left_alone(text: str) -> None:
    out = Scrubber(KEY).text(text)
    assert out is text or out == text, out


def test_the_digest_in_text_is_the_fields_digest() -> None:
    scrubber = Scrubber(KEY)
    red, changed = scrubber.redact({"api_key": "k-1234567890", "q": "weather"})
    assert changed and red == {"api_key": dg("k-1234567890"), "q": "weather"}
    assert scrubber.text("tool failed: bad key k-1234567890") == \
        f"tool failed: bad key {dg('k-1234567890')}"


# == the scrubber ==========================================================================
def test_remembered_values_are_replaced_in_any_later_text() -> None:
    s = Scrubber(KEY)
    red, _ = s.redact({"user": "bob", "password": "correct horse", "nested": [
        {"token": ["tk-one-alpha", 424242]}], "pin": 1234, "otp": "12"})
    assert red["password"] == dg("correct horse")
    out = s.text("login correct horse failed; tk-one-alpha, 424242, pin 1234 and 12")
    for clear in ("correct horse", "tk-one-alpha", "424242", "1234"):
        assert clear not in out, out
    assert f"pin {dg(1234)}" in out
    assert out.endswith(" and 12")  # < MIN_REMEMBERED characters: not looked for
    assert s.text("bob logged in") == "bob logged in"  # a non-credential value stays


def test_dict_keys_are_scrubbed_as_text_once_the_run_remembers_a_value() -> None:
    s = Scrubber(KEY)
    result = {"KeyPw5529qz": "found", "id": 7, "nested": [{"KeyPw5529qz-old": 1}]}
    assert s.value(result) == (result, False)  # nothing remembered: short keys are left
    s.redact({"api_key": "KeyPw5529qz"})
    out, changed = s.value(result)
    assert changed and out == {dg("KeyPw5529qz"): "found", "id": 7,
                               "nested": [{f"{dg('KeyPw5529qz')}-old": 1}]}
    assert list(out) == [dg("KeyPw5529qz"), "id", "nested"]  # the order is kept
    assert s.value(out) == (out, False)  # idempotent


def test_a_credential_shaped_key_is_scrubbed_in_a_run_that_remembers_nothing() -> None:
    token = "ghp_" + "K3yT0k3n" * 5
    out, changed = Scrubber(KEY).value({token: "alice", "name": "ok"})
    assert changed and token not in repr(out) and out["name"] == "ok"
    assert list(out)[0].startswith(pr.PREFIX)


def test_short_remembered_values_are_replaced_as_whole_words_only() -> None:
    s = Scrubber(KEY)
    s.remember("1234")
    s.remember("abcd")
    out = s.text("pin 1234 ok, order 12345, room a1234, abcdef, (abcd)")
    assert out == f"pin {dg('1234')} ok, order 12345, room a1234, abcdef, ({dg('abcd')})"
    s.remember("longsecret")  # 8 characters or more: anywhere
    assert s.text("xxlongsecretxx") == f"xx{dg('longsecret')}xx"


def test_placeholders_and_digests_are_not_remembered() -> None:
    s = Scrubber(KEY)
    for value in ("None", "null", "true", "****", "xxxx", "hmac", "sha256", dg("x"), "ab",
                  True, None):
        s.remember(value)
    assert s.remembered == 0
    text = f"None null true **** hmac-sha256: {dg('x')}"
    assert s.text(text) == text


def test_longer_values_win_over_their_parts() -> None:
    s = Scrubber(KEY)
    s.remember("secret-part")
    s.remember("secret-part-and-more")
    assert s.text("x secret-part-and-more y") == f"x {dg('secret-part-and-more')} y"


def test_scrubbing_is_idempotent_and_keeps_unchanged_values_as_they_are() -> None:
    s = Scrubber(KEY)
    s.remember("hunter2-hunter2")
    value = {"a": ["hello", {"b": "hunter2-hunter2 here", "n": 5}], "c": "plain"}
    out, changed = s.value(value)
    assert changed and out["a"][1]["b"] == f"{dg('hunter2-hunter2')} here"
    assert out["c"] == "plain" and value["a"][1]["b"] == "hunter2-hunter2 here"  # a copy
    again, changed_again = s.value(out)
    assert again == out and not changed_again
    same = {"x": ["nothing", "to", "see"]}
    kept, changed = s.value(same)
    assert kept is same and not changed


def test_opaque_provider_blocks_are_left_verbatim() -> None:
    s = Scrubber(KEY)
    s.remember("remembered-secret")
    blocks = [{"type": "thinking", "thinking": "use remembered-secret",
               "signature": "EqQBremembered-secretpassword=x"},
              {"type": "redacted_thinking", "data": "remembered-secret"}]
    out, changed = s.value(blocks)
    assert changed and "remembered-secret" not in out[0]["thinking"]
    assert out[0]["signature"] == blocks[0]["signature"] and out[1] == blocks[1]


def test_struct_scrubbing_keeps_the_fields_it_is_told_to() -> None:
    s = Scrubber(KEY)
    s.remember("c4ll-id-secret")
    event = bl.CallDecided(run_id="r", execution_id="c4ll-id-secret", idempotency_key="k",
                           step=1, round=1, index=0, call_id="c4ll-id-secret", tool="t",
                           arguments={"q": "c4ll-id-secret"}, decision="denied",
                           reason="denied: c4ll-id-secret")
    out, changed = s.struct(event, lambda cls: {"run_id", "execution_id", "call_id", "tool"})
    assert changed and out.call_id == out.execution_id == "c4ll-id-secret"
    assert out.reason == f"denied: {dg('c4ll-id-secret')}"
    assert out.arguments == {"q": dg("c4ll-id-secret")}
    history = bl.RunAdmitted(run_id="r", budget=bl.Budget(), tools=[], history=[
        bl.UserMessage("my key c4ll-id-secret"), bl.NoticeMessage("ok")])
    out, changed = s.struct(history, lambda cls: {"run_id"})
    assert changed and out.history[0].text == f"my key {dg('c4ll-id-secret')}"
    assert out.history[1] is history.history[1]


def test_scrubbing_is_bounded() -> None:
    s = Scrubber(KEY)
    deep: Any = "api_key=deep-value-1"
    for _ in range(200):
        deep = [deep]
    out, _ = s.value(deep)  # no RecursionError: levels past MAX_DEPTH are left as they are
    assert isinstance(out, list)
    for i in range(pr.MAX_REMEMBERED + 10):
        s.remember(f"value-{i:06d}")
    assert s.remembered == pr.MAX_REMEMBERED


def test_scrubbing_costs_microseconds_per_round() -> None:
    """A typical round scrubs a few short texts (measured, not asserted tightly: the
    figure is printed with -s; the bound only catches a pathological regression)."""
    s = Scrubber(KEY)
    s.redact({"api_key": "sk-live-key-0123456789", "password": "hunter2"})
    texts = ["ValueError: the tool failed: connection refused",
             "The permit denied deploy: not on weekends", "It is sunny in Paris.",
             "search result for weather in Paris"]
    rounds = 2000
    started = time.perf_counter()
    for _ in range(rounds):
        for t in texts:
            s.text(t)
    per_round = (time.perf_counter() - started) / rounds * 1e6
    print(f"scrubbing 4 short texts: {per_round:.1f} us per round")
    assert per_round < 2000


# == the sweep: real runs, every kind of place, every output ================================
def _jwt(tag: str) -> str:
    return f"eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiJ{tag}MjM0NTY3ODkwIn0.{tag}dozjgNryP4J3jVmNHl0w5N"


PEM_BODY = "MIIEpAIBAAKCAQEAsweepPEMbodyQ2x9"
PEM = f"-----BEGIN RSA PRIVATE KEY-----\n{PEM_BODY}\nq2Z8\n-----END RSA PRIVATE KEY-----"
S = {
    # Values under credential keys (digested), then repeated in text (remembered).
    "pwd": "PwdA-7741qz", "jwt": _jwt("AAA"), "passcode": "PassC-3390qz", "pin": 482913,
    "sessionid": "SessA-5512qz", "api_key": "ApiKeyA-8821qz", "private_key": PEM,
    "res_session": "ResSess-1100qz", "res_private": "ResPriv-2200qz",
    "res_api": "ResApi-3300qz", "pwd_b": "PwdB-6613qz", "passcode_c": "PassCC-4471qz",
    "pwd_d": "PwdD-9134qz", "hist_key": "HistKey-2256qz",
    # Credential-shaped text (patterns).
    "url_pw": "UrlPw-7734qz", "qs_token": "QsTok-5521qz", "dsn_pw": "DsnPw-8812qz",
    "kv_pw": "KvPw-1290qz", "ghp": "ghp_" + "Sw33pT0k3n" * 4, "jwt2": _jwt("BBB"),
    "repr_pw": "ReprPw-4471qz", "sk_ant": "sk-ant-api03-" + "Sw3" * 12,
    "akia": "AKIAQ7W2E9R4T6Y1U3I5", "model_pw": "ModelPw-3312qz",
    "sk_proj": "sk-proj-" + "M0d3lK3y" * 3, "akia2": "AKIAZ8X7C6V5B4N3M2L1",
    "xoxb": "xoxb-123456789012-SweepSlackTok3n", "bearer": "BrTok.9931-ffGG77",
    "cookie": "CkVal-7281qz", "prompt_pw": "PromptPw-6620qz", "bearer2": "BrTok2.1188-hhJJ99",
    "jwt3": _jwt("CCC"), "sk_proj2": "sk-proj-" + "Pr0mptK3y" * 3,
    "basic": "c3dlZXA6YmFzaWNwdzEyMw==", "final_dsn": "FinDsn-5077qz",
    # Names and keys (run sweep-f): values redacted first, then used as a tool's name, an
    # exception class's name and a result's key; a credential-shaped tool name.
    "name_pw": "NamePw4410qz", "cls_pw": "ClsPw7731qz", "key_pw": "KeyPw5529qz",
    "ghp_name": "ghp_" + "N4m3dT00l" * 4,
}
#: Every placement tried: (where, the secret it puts there).
PLACEMENTS = [
    ("argument named pwd", "pwd"), ("argument named jwt", "jwt"),
    ("argument named passcode", "passcode"), ("argument named pin", "pin"),
    ("argument named sessionid", "sessionid"), ("argument named api_key", "api_key"),
    ("argument named private_key", "private_key"),
    ("result key sessionId", "res_session"), ("result key privateKey", "res_private"),
    ("result key X-Api-Key", "res_api"),
    ("the model's text beside its calls repeats the api_key", "api_key"),
    ("tool exception repeats the api_key of its own arguments", "api_key"),
    ("tool exception: URL userinfo", "url_pw"), ("tool exception: query string", "qs_token"),
    ("tool exception: DSN password", "dsn_pw"), ("tool exception: PEM private key", "pem"),
    ("free-text result repeats the pwd", "pwd"), ("free-text result: GitHub token", "ghp"),
    ("free-text result: JWT", "jwt2"), ("free-text result: DSN password=", "kv_pw"),
    ("an object's repr: password=", "repr_pw"), ("an object's repr repeats the passcode",
                                                 "passcode"),
    ("permit denial reason repeats the pin", "pin"),
    ("permit denial reason: Anthropic key", "sk_ant"),
    ("final text repeats the pwd", "pwd"), ("final text: AWS key id", "akia"),
    ("model exception repeats a redacted pwd", "pwd_b"),
    ("model exception: password=", "model_pw"), ("model exception: OpenAI key", "sk_proj"),
    ("model exception: AWS key id", "akia2"),
    ("malformed notice echoes a redacted value (as a tool's name)", "passcode_c"),
    ("malformed explanation echoes a Slack token (as a tool's name)", "xoxb"),
    ("cancel reason repeats a redacted pwd", "pwd_d"), ("cancel reason: Bearer", "bearer"),
    ("cancel reason: cookie", "cookie"),
    ("history call argument api_key", "hist_key"),
    ("history user text repeats it", "hist_key"), ("prompt: URL userinfo", "prompt_pw"),
    ("prompt: Bearer", "bearer2"), ("prompt: JWT", "jwt3"), ("prompt: PEM", "pem"),
    ("prompt: OpenAI key", "sk_proj2"), ("prompt: Basic", "basic"),
    ("final text repeats a history secret", "hist_key"), ("final text: DSN", "final_dsn"),
    ("an unknown tool's name repeats a redacted pwd", "name_pw"),
    ("an unknown tool's name: GitHub token", "ghp_name"),
    ("an exception class's name repeats a redacted passcode", "cls_pw"),
    ("a result's key repeats a redacted api_key", "key_pw"),
]


def clear(name: str) -> list[str]:
    """The clear texts of secret ``name`` that must never be found."""
    if name == "pem":
        return [PEM_BODY]
    value = S[name]
    return [str(value)] if name != "private_key" else [PEM_BODY]


class Creds:
    def __repr__(self) -> str:
        return f"Creds(user='bob', password='{S['repr_pw']}', note='{S['passcode']}')"


def _tools() -> list[bl.Tool]:
    @bl.tool
    def login(user: str = "bob", pwd: str = "", jwt: str = "", passcode: str = "",
              pin: int = 0, sessionid: str = "", api_key: str = "") -> str:
        return f"welcome {user}"

    @bl.tool
    def lookup() -> dict[str, str]:
        return {"sessionId": S["res_session"], "privateKey": S["res_private"],
                "X-Api-Key": S["res_api"], "name": "ok"}

    @bl.tool
    def call_api(url: str, api_key: str) -> str:
        raise RuntimeError(f"401 from {url}: api_key {api_key} rejected")

    @bl.tool
    def sign(private_key: str) -> str:
        raise ValueError(f"cannot load the key:\n{private_key}")

    @bl.tool
    def fetch(dsn: str) -> str:
        raise ConnectionError(f"could not connect to {dsn}")

    @bl.tool
    def notes() -> str:
        return (f"notes: the password was {S['pwd']}; deploy token {S['ghp']}; session "
                f"{S['jwt2']}; dsn host=db password={S['kv_pw']} dbname=x")

    @bl.tool
    def creds() -> Any:
        return Creds()

    @bl.tool
    def deploy(target: str) -> str:
        return "deployed"

    @bl.tool
    def stop(ctx: bl.ToolContext) -> str:
        ctx.cancel.cancel(f"operator revoked {S['pwd_d']}; Authorization: Bearer "
                          f"{S['bearer']}; Cookie: sid={S['cookie']}; theme=dark")
        return "stopping"

    @bl.tool
    def boom() -> str:
        raise type(S["cls_pw"], (RuntimeError,), {})("it broke")

    @bl.tool
    def keyed() -> dict[str, str]:
        return {S["key_pw"]: "found", "name": "ok"}

    return [login, lookup, call_api, sign, fetch, notes, creds, deploy, stop, boom, keyed]


def _permit(call: bl.ToolCall, tool: bl.Tool, ctx: Any) -> Any:
    if call.name == "deploy":
        return f"deploy denied: pin {S['pin']} and key {S['sk_ant']} are not allowed here"
    return True


def _runs(runner: bl.Runner) -> dict[str, bl.RunResult]:
    tools = _tools()
    c = bl.ToolCall
    url = f"https://svc:{S['url_pw']}@api.example.com/v1?limit=5&token={S['qs_token']}"
    a = bl.ScriptedModel([
        bl.CallTools([c("a1", "login", {"pwd": S["pwd"], "jwt": S["jwt"],
                                         "passcode": S["passcode"], "pin": S["pin"],
                                         "sessionid": S["sessionid"]}),
                      c("a2", "lookup", {}),
                      c("a3", "call_api", {"url": url, "api_key": S["api_key"]}),
                      c("a4", "sign", {"private_key": S["private_key"]})],
                     text=f"Logging in; the key {S['api_key']} is ready."),
        bl.CallTools([c("a5", "fetch", {"dsn": f"postgresql://app:{S['dsn_pw']}@db/prod"}),
                      c("a6", "notes", {}), c("a7", "creds", {}),
                      c("a8", "deploy", {"target": "prod"})]),
        bl.Final(f"Done as bob with {S['pwd']}; aws {S['akia']}."),
    ])
    b = bl.ScriptedModel([
        bl.CallTools([c("b1", "login", {"pwd": S["pwd_b"]})]),
        RuntimeError(f"provider error: password={S['model_pw']} after {S['pwd_b']}; key "
                     f"{S['sk_proj']}; id {S['akia2']}"),
    ])
    m = bl.ScriptedModel([
        bl.CallTools([c("c1", "login", {"passcode": S["passcode_c"]})]),
        {"kind": "calls", "calls": [{"id": "c2", "name": S["passcode_c"], "arguments": "x"}]},
        {"kind": "calls", "calls": [{"id": "c3", "name": S["xoxb"], "arguments": "x"}]},
    ])
    d = bl.ScriptedModel([
        bl.CallTools([c("d1", "login", {"pwd": S["pwd_d"]})]),
        bl.CallTools([c("d2", "stop", {})]),
        bl.Final("never"),
    ])
    e = bl.ScriptedModel([bl.Final(f"done: {S['hist_key']} and "
                                   f"postgresql://u:{S['final_dsn']}@h/db")])
    f = bl.ScriptedModel([
        bl.CallTools([c("f1", "login", {"pwd": S["name_pw"], "passcode": S["cls_pw"],
                                         "api_key": S["key_pw"]})]),
        bl.CallTools([c("f2", S["name_pw"], {}), c("f3", S["ghp_name"], {}),
                      c("f4", "boom", {}), c("f5", "keyed", {})]),
        bl.Final("done"),
    ])
    history = [{"kind": "call", "id": "h1", "name": "login",
                "arguments": {"api_key": S["hist_key"]}},
               {"kind": "tool_result", "id": "h1", "status": "ok", "content": "ok"},
               {"kind": "user", "text": f"my key {S['hist_key']} works"}]
    prompt = (f"use https://admin:{S['prompt_pw']}@internal.example.com with Authorization: "
              f"Bearer {S['bearer2']}, token {S['jwt3']}\n{PEM}\nalso {S['sk_proj2']} and "
              f"Basic {S['basic']}")
    budget = bl.Budget(max_model_steps=6, max_tool_calls=20, malformed_retries=1)
    return {
        "sweep-a": runner.run(model=a, tools=tools, prompt="go", run_id="sweep-a",
                              permit=_permit, budget=budget),
        "sweep-b": runner.run(model=b, tools=tools, prompt="go", run_id="sweep-b"),
        "sweep-c": runner.run(model=m, tools=tools, prompt="go", run_id="sweep-c",
                              budget=budget),
        "sweep-d": runner.run(model=d, tools=tools, prompt="go", run_id="sweep-d"),
        "sweep-e": runner.run(model=e, tools=tools, prompt=prompt, history=history,
                              run_id="sweep-e"),
        "sweep-f": runner.run(model=f, tools=tools, prompt="go", run_id="sweep-f"),
    }


def _cli(journal: Path, *commands: list[str]) -> list[str]:
    """Run ``python -m boundloop`` commands at once, each its own process; their stdout."""
    procs = [subprocess.Popen([sys.executable, "-m", "boundloop", "--journal", str(journal),
                               *cmd], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for cmd in commands]
    outs = []
    for cmd, p in zip(commands, procs, strict=True):
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, (cmd, out, err)
        outs.append(out + err)
    return outs


@pytest.fixture(scope="module")
def swept(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The sweep's runs, once for the module: the journal (with an old version's key file
    planted in it beforehand), the results, the key and the CLI outputs."""
    journal = tmp_path_factory.mktemp("sweep") / "journal"
    journal.mkdir()
    legacy = journal / keys.LEGACY_KEY_FILE  # as an older boundloop left it
    legacy.write_bytes(bytes(range(200, 232)))
    exporter = InMemorySpanExporter()
    tracer = TracerProvider()
    tracer.add_span_processor(SimpleSpanProcessor(exporter))
    telemetry = bl.Telemetry(tracer_provider=tracer)
    with bl.Runner(journal, telemetry=telemetry) as runner:
        results = _runs(runner)
        key = runner.journal.secret_key
    telemetry.flush()
    spans = [(s.name, dict(s.attributes or {}), [(e.name, dict(e.attributes or {}))
                                                  for e in s.events])
             for s in exporter.get_finished_spans()]
    ids = list(results)
    commands = [["runs", "--json"], ["stats", "--json"], ["stats"]]
    for run_id in ids:
        commands += [["export", run_id], ["export", run_id, "--strip-content"],
                     ["show", run_id, "--json"], ["show", run_id]]
    outputs = dict(zip([" ".join(c) for c in commands], _cli(journal, *commands),
                       strict=True))
    return {"journal": journal, "results": results, "key": key, "outputs": outputs,
            "legacy": legacy, "spans": repr(spans)}


def test_the_sweep_runs_end_as_planned(swept: dict[str, Any]) -> None:
    assert len(PLACEMENTS) >= 48
    statuses = {k: r.status for k, r in swept["results"].items()}
    assert statuses == {"sweep-a": "final", "sweep-b": "model_error",
                        "sweep-c": "malformed_response", "sweep-d": "cancelled",
                        "sweep-e": "final", "sweep-f": "final"}, {k: r.explanation for k, r in
                                              swept["results"].items()}
    a = swept["results"]["sweep-a"]
    results = {m.id: m for m in a.transcript if m.kind == "tool_result"}
    assert results["a3"].status == results["a4"].status == results["a5"].status == "error"
    assert results["a8"].status == "denied"
    assert "pin hmac-sha256:" in results["a8"].content  # the reason, scrubbed
    assert "Reason: operator revoked hmac-sha256:" in swept["results"]["sweep-d"].explanation
    f = {m.id: m for m in swept["results"]["sweep-f"].transcript if m.kind == "tool_result"}
    assert [f[i].status for i in ("f2", "f3", "f4", "f5")] == \
        ["unknown_tool", "unknown_tool", "error", "ok"]
    assert "spans" in swept and "execute_tool" in swept["spans"]


@pytest.mark.parametrize("where, name", PLACEMENTS, ids=[p[0] for p in PLACEMENTS])
def test_no_secret_in_clear_anywhere(swept: dict[str, Any], where: str, name: str) -> None:
    journal: Path = swept["journal"]
    raw = b"".join(p.read_bytes() for p in sorted(journal.rglob("*"))
                   if p.is_file() and p != swept["legacy"])
    results = msgspec.json.encode(list(swept["results"].values())).decode()
    for secret in clear(name):
        assert secret.encode() not in raw, f"{where}: in the journal's bytes"
        assert secret not in results, f"{where}: in a RunResult"
        for command, output in swept["outputs"].items():
            assert secret not in output, f"{where}: in `boundloop {command}`"
        assert secret not in swept["spans"], f"{where}: in a span"


def test_the_cli_outputs_are_real(swept: dict[str, Any]) -> None:
    outputs = swept["outputs"]
    listed = json.loads(outputs["runs --json"])
    assert {r["run_id"] for r in listed} == set(swept["results"])
    exported = [json.loads(x) for x in outputs["export sweep-a"].splitlines()]
    assert exported[0]["type"] == "RunAdmitted" and len(exported) > 10
    assert "hmac-sha256:" in outputs["export sweep-d --strip-content"]
    assert json.loads(outputs["show sweep-b --json"])


GUESSED = ["pwd", "jwt", "passcode", "pin", "sessionid", "api_key", "res_session",
           "res_private", "res_api", "pwd_b", "passcode_c", "pwd_d"]


def _guesses(value: Any, candidate_keys: list[bytes]) -> set[str]:
    """Every digest of ``value`` someone with only the copied directory could compute."""
    forms = [msgspec.json.encode(value), str(value).encode()]
    out = set()
    for data in forms:
        for algo in ("sha256", "sha1", "md5", "sha512", "blake2b", "blake2s", "sha3_256"):
            out.add(hashlib.new(algo, data).hexdigest())
        for k in candidate_keys:
            out.add(hmac.new(k, data, hashlib.sha256).hexdigest())
    return out


def test_a_copied_journal_confirms_none_of_the_guessed_credentials(
        swept: dict[str, Any], tmp_path: Path) -> None:
    copy = tmp_path / "copy"
    shutil.copytree(swept["journal"], copy)
    files = [p for p in copy.rglob("*") if p.is_file()]
    blob = b"".join(p.read_bytes() for p in files)
    assert swept["key"] not in blob  # the key is not in the copy
    # Any key an attacker could find in the copy: whole files, the old key file, every
    # 32-byte window of the small ones, and the empty key.
    candidates = [b""] + [p.read_bytes() for p in files]
    for p in files:
        data = p.read_bytes()
        if len(data) <= 16384:
            candidates += [data[i:i + 32] for i in range(0, max(len(data) - 31, 0))]
    text = blob.decode("latin-1")
    confirmed = [name for name in GUESSED
                 if any(g in text for g in _guesses(S[name], candidates))]
    assert len(GUESSED) == 12 and confirmed == []
    # Control: under the real key (kept apart, in the state directory) all 12 are there.
    keyed = [name for name in GUESSED if pr.digest(swept["key"], S[name]) in text]
    assert keyed == GUESSED
