"""What may enter the journal: credential-like and sensitive fields become keyed digests, and
values the journal cannot hold are refused or made storable at the boundary.

A redacted value is stored as ``"hmac-sha256:<hex>"`` (HMAC under the journal's redaction
key, kept apart from the journal: ``boundloop.keys``), so a guessed secret cannot be
confirmed from a copied journal without that key.

**Which keys are credentials** (``is_credential``): a key is split into words at punctuation
and camelCase (``X-Api-Key`` -> x, api, key; ``sessionId`` -> session, id) and lower-cased;
it names a credential when a word is in ``CREDENTIAL_WORDS`` (which also lists compounds
written as one word: ``sessionid``, ``apikey``) or two adjacent words are in
``CREDENTIAL_PAIRS``, unless the neighbouring word makes it something else
(``page_token``, ``token_count``, ``auth_url``, ``pin_memory``, ``secret_name``). Whole words
only: ``max_tokens``, ``pinned``, ``spin``, ``tokenizer``, ``author`` are not credentials.

**Secrets in text** (``Scrubber``, one per run): every clear value redacted in the run is
remembered, and later texts (exception messages, permit and cancel reasons, notices,
results, final text) have each occurrence replaced by that value's digest; text with the
shape of a credential (``SECRET_PATTERNS``: PEM private keys, JWTs, URL userinfo and DSN
passwords, Bearer/Basic values, cookie headers, well-known API-key prefixes; and
``key=value`` / ``key: value`` text whose key names a credential, query strings and DSNs
included) is replaced by its digest too. Values shorter than ``MIN_REMEMBERED`` characters
are not looked for in text, and those shorter than ``WHOLE_WORD_BELOW`` only as whole words.

**Shape.** Tool arguments, tool results and ``history=`` values may nest containers (dicts,
lists, tuples, sets) at most ``MAX_DEPTH`` levels deep (the outermost container is level 1)
and may not contain themselves. Every walk here is iterative or bounded by ``MAX_DEPTH``, so
no value, however deep or cyclic, reaches Python's recursion limit; values are checked
before they reach msgspec's encoders, which recurse in C.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import typing
from collections.abc import Callable, Collection, Iterable, Iterator
from typing import Any, Literal

import msgspec

from boundloop.policy.safe_text import ELLIPSIS, describe_exception

PREFIX = "hmac-sha256:"

#: The deepest nesting of containers kept in tool arguments, tool results and history values
#: (the outermost dict or list is level 1). Deeper values are refused at the boundary: the
#: call is ``invalid_arguments``, the result becomes an ``error``, a history raises
#: ConfigError.
MAX_DEPTH = 64

#: The one key of the arguments that stand for arguments that could not be kept (nested
#: deeper than MAX_DEPTH, holding themselves, or holding a key or value JSON cannot hold).
#: It is not a Python identifier, so no tool parameter has this name: such a call is always
#: ``invalid_arguments``; the value says why.
ARGUMENTS_NOT_KEPT = "(arguments not kept)"

#: Whole words (of a key split at punctuation and camelCase, lower-cased) that name a
#: credential, with the compounds people write as one word (``sessionid``, ``apikey``).
#: Plurals only where they name containers of credentials: ``tokens`` is not one
#: (``max_tokens``), nor are ``pinned``, ``spin``, ``tokenizer`` or ``author``.
CREDENTIAL_WORDS = frozenset({
    "password", "passwords", "passwd", "pwd", "pass", "passcode", "passphrase", "passkey",
    "pin", "pincode", "otp", "totp", "hotp", "cvv", "cvc",
    "token", "jwt", "bearer", "secret", "secrets", "authorization", "auth", "credential",
    "credentials", "creds", "cookie", "cookies",
    "apikey", "apikeys", "privatekey", "accesskey", "secretkey", "sessionkey", "signingkey",
    "masterkey", "encryptionkey", "accountkey", "appkey", "secretaccesskey",
    "sessionid", "sessid", "phpsessid", "jsessionid", "sessiontoken",
    "accesstoken", "refreshtoken", "authtoken", "idtoken", "apitoken", "bearertoken",
    "csrftoken", "xsrftoken", "clientsecret", "apisecret",
})
#: Adjacent word pairs that name a credential (``api_key``, ``X-Api-Key``, ``privateKey``,
#: ``SessionID``).
CREDENTIAL_PAIRS = frozenset({
    ("api", "key"), ("api", "keys"), ("private", "key"), ("access", "key"), ("secret", "key"),
    ("session", "key"), ("session", "id"), ("signing", "key"), ("master", "key"),
    ("encryption", "key"), ("account", "key"), ("app", "key"), ("pass", "phrase"),
})
#: Credential words that name something else after these words (``page_token``,
#: ``output_token``: a cursor and a count) ...
_NOT_AFTER: dict[str, frozenset[str]] = {
    "token": frozenset({"num", "total", "input", "output", "prompt",
                        "completion", "reasoning", "cache", "cached", "page", "next", "prev",
                        "previous", "continuation", "pagination", "cursor", "end", "start",
                        "stop", "special", "unk", "pad", "bos", "eos", "sep", "mask"}),
}
#: ... or before these words (``token_count``, ``token_ids``, ``auth_url``, ``pin_memory``).
_NOT_BEFORE: dict[str, frozenset[str]] = {
    "token": frozenset({"count", "counts", "usage", "budget", "budgets",
                        "type", "types", "ids", "index", "indices", "offset", "offsets",
                        "position", "positions", "logprob", "logprobs", "estimate", "length",
                        "len", "size", "total", "totals", "rate", "price", "cost"}),
    "auth": frozenset({"url", "uri", "type", "method", "mode", "provider", "endpoint",
                       "scheme", "required", "enabled", "domain", "server", "host", "flow"}),
    "pin": frozenset({"memory", "version", "versions"}),
    "pass": frozenset({"rate", "count", "counts", "fail", "through", "thru", "number",
                       "percent", "ratio", "threshold", "at", "k"}),
    "secret": frozenset({"name", "names", "ref", "arn", "path", "version", "versions"}),
}

_WORD = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|\d+")
_json = msgspec.json.Encoder()
_msgpack = msgspec.msgpack.Encoder()
_INT_MIN, _UINT_MAX = -(2 ** 63), 2 ** 64 - 1
_SURROGATE = re.compile("[\ud800-\udfff]")
#: What an encoder may raise for a value it cannot take (RecursionError: too deep, cyclic).
_ENCODE_ERRORS = (TypeError, ValueError, OverflowError, RecursionError)

#: Exact types that hold no other value (a container of only these needs no walk).
_SCALARS = frozenset({str, int, float, bool, type(None)})
_CONTAINERS = (dict, list, tuple, set, frozenset)
#: Stands in the journal for a part of a value nested deeper than MAX_DEPTH (never reached
#: through the runner, which refuses such values first; a safeguard for direct callers).
TOO_DEEP_TEXT = f"(not kept: nested deeper than {MAX_DEPTH} levels)"

Shape = Literal["too_deep", "cycle"]


def key_words(key: str) -> list[str]:
    """``"X-Api-Key"`` -> ``["x", "api", "key"]``; ``"maxTokens"`` -> ``["max", "tokens"]``."""
    return [w.lower() for w in _WORD.findall(key)]


def _names_credential(key: str) -> bool:
    words = key_words(key)
    last = len(words) - 1
    for i, word in enumerate(words):
        if word in CREDENTIAL_WORDS and not (
                (i > 0 and words[i - 1] in _NOT_AFTER.get(word, ()))
                or (i < last and words[i + 1] in _NOT_BEFORE.get(word, ()))):
            return True
    return any(pair in CREDENTIAL_PAIRS for pair in zip(words, words[1:], strict=False))


#: Verdicts of ``is_credential`` by key (a dict lookup is the hot path of ``redact``);
#: bounded, and only short keys, so hostile keys cannot grow it without limit.
_CREDENTIAL: dict[str, bool] = {}
_CACHE_KEYS = 4096


def is_credential(key: str) -> bool:
    """True when a whole word (or word pair) of ``key`` names a credential."""
    verdict = _CREDENTIAL.get(key)
    if verdict is None:
        verdict = _names_credential(key)
        if len(_CREDENTIAL) < _CACHE_KEYS and len(key) <= 256:
            _CREDENTIAL[key] = verdict
    return verdict


def safe_repr(value: Any) -> str:
    """``repr(value)``, or ``<TypeName object>`` when that raises; never raises."""
    try:
        text = repr(value)
    except Exception:  # noqa: BLE001 - a user object's __repr__ must not fail the run
        return f"<{type(value).__name__} object>"
    return text if type(text) is str else f"<{type(value).__name__} object>"


def digest(secret_key: bytes, value: Any) -> str:
    """The keyed digest that stands for ``value`` in the journal (never raises)."""
    try:
        data = _json.encode(value)
    except _ENCODE_ERRORS:
        data = safe_repr(value).encode("utf-8", "surrogatepass")
    return PREFIX + hmac.new(secret_key, data, hashlib.sha256).hexdigest()


# -- shape: depth and cycles ------------------------------------------------------------
def _items(container: Any) -> Iterator[Any]:
    return iter(container.values() if isinstance(container, dict) else container)


def _flat(container: Any) -> bool:
    """True when ``container`` holds only plain scalars (one pass in C)."""
    values = container.values() if isinstance(container, dict) else container
    return _SCALARS.issuperset(map(type, values))


def _within(container: Any, levels: int) -> bool:
    """True when ``container`` nests at most ``levels`` levels (itself included). Recursion
    is bounded by ``levels``, so a cycle just runs out of levels."""
    if levels <= 0:
        return False
    values = container.values() if isinstance(container, dict) else container
    if len(values) > 16 and _SCALARS.issuperset(map(type, values)):
        return True  # a long run of scalars: one pass in C
    levels -= 1
    for v in values:
        if type(v) not in _SCALARS and isinstance(v, _CONTAINERS) and not _within(v, levels):
            return False
    return True


def shape_problem(value: Any, limit: int = MAX_DEPTH) -> Shape | None:
    """``"too_deep"`` when containers in ``value`` nest deeper than ``limit`` levels (the
    outermost is level 1), ``"cycle"`` when one contains itself, else None.

    Never reaches Python's recursion limit: a bounded check first (a container of plain
    scalars costs one pass in C), then, only for a value that fails it, an iterative walk
    that tells a cycle from depth. Dict keys are not walked (keys that cannot be encoded
    fail the encoder, which callers catch).
    """
    if not isinstance(value, _CONTAINERS) or _within(value, limit):
        return None
    return _classify(value, limit)


def _classify(value: Any, limit: int) -> Shape:
    on_path = {id(value)}
    path = [id(value)]
    frames = [_items(value)]
    while frames:
        for child in frames[-1]:
            if isinstance(child, _CONTAINERS):
                if not child or (type(child) in (list, dict) and _flat(child)):
                    if len(frames) >= limit:
                        return "too_deep"
                    continue
                cid = id(child)
                if cid in on_path:
                    return "cycle"
                if len(frames) >= limit:
                    return "too_deep"
                on_path.add(cid)
                path.append(cid)
                frames.append(_items(child))
                break
        else:
            frames.pop()
            on_path.discard(path.pop())
    return "too_deep"  # pragma: no cover - _within said so; a value changed meanwhile


def shape_text(problem: Shape) -> str:
    """What is wrong, as the end of a sentence about a value (``"it is ..."``)."""
    if problem == "too_deep":
        return f"nested deeper than {MAX_DEPTH} levels"
    return "a dict or list that contains itself"


def arguments_not_kept(problem: Shape | str) -> dict[str, Any]:
    """The arguments that stand for arguments that could not be kept: ``problem`` is a
    Shape, or what ends ``"the arguments ..."`` (from ``arguments_problem``)."""
    why = f"are nested deeper than {MAX_DEPTH} levels" if problem == "too_deep" else \
        "contain themselves (a dict or list nested inside itself)" if problem == "cycle" \
        else problem
    return {ARGUMENTS_NOT_KEPT: f"the arguments {why}, so they were not kept"}


def arguments_problem(arguments: Any) -> Shape | str | None:
    """Why tool arguments cannot be kept in the transcript and the journal, else None: a
    Shape, or (as the end of ``"the arguments ..."``) a key or value that JSON cannot hold,
    naming where. Text with a lone surrogate and integers beyond 64 bits are left to
    ``storable`` (the response is then malformed). Never raises."""
    problem = shape_problem(arguments)
    if problem is not None or not isinstance(arguments, dict):
        return problem
    why = json_problem(arguments)
    return None if why is None else f"hold {why}"


def json_problem(value: Any) -> str | None:
    """What in ``value`` (nested at most MAX_DEPTH deep) JSON cannot hold, naming where
    (``"a tuple key (1, 2) at `a` (JSON keys are text or numbers)"``), else None. Lone
    surrogates are left to ``storable``. Never raises."""
    try:
        _json.encode(value)
    except UnicodeEncodeError:
        return None
    except _ENCODE_ERRORS:
        return _json_problem(value)
    return None


def _json_problem(value: Any) -> str:
    stack: list[tuple[str, Any]] = [("", value)]
    while stack:
        where, item = stack.pop()
        at = f" at `{where}`" if where else ""
        if isinstance(item, dict):
            for k, v in item.items():
                try:
                    _json.encode({k: None})
                except UnicodeEncodeError:
                    pass
                except _ENCODE_ERRORS:
                    return f"a {type(k).__name__} key {safe_repr(k)[:80]}{at} (JSON keys are " \
                           "text or numbers)"
                name = k if isinstance(k, str) else safe_repr(k)
                stack.append((f"{where}.{name}" if where else name, v))
        elif isinstance(item, list | tuple | set | frozenset):
            stack.extend((f"{where}[{i}]", v) for i, v in enumerate(item))
        else:
            try:
                _json.encode(item)
            except UnicodeEncodeError:
                pass
            except _ENCODE_ERRORS:
                return f"a value of type {type(item).__name__}{at} (not JSON-like)"
    return "a value that JSON cannot hold"


# -- redaction --------------------------------------------------------------------------
def redact(value: Any, secret_key: bytes, sensitive: Collection[str] = (),
           found: list[Any] | None = None) -> tuple[Any, bool]:
    """``value`` with credential and ``sensitive`` fields (at any depth) replaced by digests.

    Returns the redacted copy and whether anything was replaced; each clear value replaced
    is appended to ``found`` when given (a ``Scrubber`` remembers them). Containers nested
    deeper than ``MAX_DEPTH`` (or holding themselves) are replaced by a short text and
    count as redacted: the journal never holds them.
    """
    if isinstance(value, dict | list | tuple):
        return _redact(value, secret_key, sensitive, 1, found)
    return value, False


def _redact(value: Any, secret_key: bytes, sensitive: Collection[str],
            level: int, found: list[Any] | None = None) -> tuple[Any, bool]:
    # Bounded recursion: at most MAX_DEPTH + 1 frames, whatever the value (a cycle too).
    if level > MAX_DEPTH:
        return TOO_DEEP_TEXT, True
    changed = False
    if isinstance(value, dict):
        out: dict[Any, Any] = {}
        known = _CREDENTIAL.get
        for k, v in value.items():
            if type(k) is str:
                credential = known(k)
                if credential is None:
                    credential = is_credential(k)
            else:
                credential = isinstance(k, str) and is_credential(k)
            if credential or (k in sensitive and isinstance(k, str)):
                out[k] = digest(secret_key, v)
                changed = True
                if found is not None:
                    found.append(v)
            elif isinstance(v, dict | list | tuple):
                out[k], sub = _redact(v, secret_key, sensitive, level + 1, found)
                changed = changed or sub
            else:
                out[k] = v
        return out, changed
    if _flat(value):
        return list(value), False
    items: list[Any] = []
    for v in value:
        if isinstance(v, dict | list | tuple):
            v, sub = _redact(v, secret_key, sensitive, level + 1, found)
            changed = changed or sub
        items.append(v)
    return items, changed


# -- secrets in text -------------------------------------------------------------------------
#: Remembered values shorter than this are never looked for in text (the field that held
#: one is still redacted): replacing every ``ab`` or ``7`` in a run's texts would mangle
#: them and hide nothing worth hiding.
MIN_REMEMBERED = 4
#: Remembered values shorter than this are replaced only as whole words (not inside a longer
#: run of letters and digits): a PIN ``1234`` is replaced in "pin 1234 refused", not in
#: "order 12345". Longer values are replaced wherever they occur.
WHOLE_WORD_BELOW = 8
#: Remembered values longer than this are not looked for (they are still redacted where
#: they were found); a run remembers at most ``MAX_REMEMBERED`` values (later ones are
#: still redacted, and still caught by the patterns).
MAX_REMEMBERED_CHARS = 65_536
MAX_REMEMBERED = 4096
#: Dict keys at least this long are scrubbed even in a run that remembers no secret (shorter
#: ones then skip the scrubber): API keys, tokens and JWTs, the credentials that turn up as
#: keys (a map of tokens to their owners), are all longer. Once a run remembers a value,
#: every key of ``MIN_REMEMBERED`` characters or more is scrubbed.
KEYS_SHAPED_FROM = 16
#: The most distinct words of one text a resumed run checks against the journal's digests.
MAX_LEARNED_WORDS = 20_000
_WORDS = re.compile(r"\S+")
_PARTS = re.compile(r"[:=,;]+")
_PUNCTUATION = "\"'`.,;:!?()[]{}<>"

#: Keys whose values text scrubbing leaves alone: opaque blobs of provider content blocks
#: (a thinking block's ``signature``, a reasoning item's ``encrypted_content``, a
#: ``redacted_thinking`` block's ``data``) that an adapter must send back verbatim and that
#: hold no readable text. Credential keys are still redacted there (``redact``).
OPAQUE_KEYS = frozenset({"signature", "encrypted_content"})
#: Placeholder values that are not secrets (and would otherwise be replaced everywhere).
_PLACEHOLDERS = frozenset({"true", "false", "null", "none", "nil", "undefined", "redacted",
                           "<redacted>", "[redacted]"})
_PLACEHOLDER_CHARS = frozenset("*xX#.-_•")
_ALNUM = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789")

#: Text with the shape of a credential, by kind: ``(name, anchors, regex, group)``. A text
#: is searched for the (compiled together) regexes only when it holds one of the anchors,
#: literal parts every match contains (lower-case anchors are looked for in the lower-cased
#: text), so most texts cost a few substring tests. ``group`` is the part replaced by its
#: digest (``None``: the whole match). Written for this module after the shapes the
#: detect-secrets plugins look for.
SECRET_PATTERNS: tuple[tuple[str, tuple[str, ...], str, str | None], ...] = (
    # PEM private keys (RSA, EC, DSA, OPENSSH, ENCRYPTED, PGP ... PRIVATE KEY [BLOCK]), also
    # cut short (an exception message truncated in the middle of one).
    ("pem", ("-----BEGIN",),
     r"-----BEGIN[A-Z0-9 ]{0,40}PRIVATE KEY(?: BLOCK)?-----[\s\S]*?"
     r"(?:-----END[A-Z0-9 ]{0,40}PRIVATE KEY(?: BLOCK)?-----|\Z)", None),
    # JSON Web Tokens: base64url header and payload (both JSON objects: "ey"), signature.
    ("jwt", (".ey",), r"(?<![\w-])ey[A-Za-z0-9_-]{8,}\.ey[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]*",
     None),
    # URL userinfo: scheme://user:password@host (DSNs too); the password is replaced, up to
    # the authority's last "@" (passwords that hold an unescaped "@").
    ("userinfo", ("://",),
     r"(?<![\w+.-])[A-Za-z][A-Za-z0-9+.-]{0,30}://[^\s:/?#@\"'<>]*:"
     r"(?P<userinfo_pw>[^\s/?#\"'<>]+)@[^\s@/?#\"'<>]*", "userinfo_pw"),
    # HTTP authorization values: "Bearer <token>", "Basic <base64>" (after the header's
    # name too: see _KEY_VALUE), when the value looks like a credential (_tokenish).
    ("scheme", ("bearer", "basic", "digest"),
     r"\b(?i:bearer|basic|digest)\s+(?P<scheme_value>[A-Za-z0-9._~+/=-]{8,})",
     "scheme_value"),
    # Cookie headers: every cookie in the line.
    ("cookie", ("cookie",),
     r"(?<![\w-])(?i:set-cookie|cookie)[ \t]*:[ \t]*(?P<cookie_value>[^\r\n]+)",
     "cookie_value"),
    # Well-known API-key prefixes.
    ("anthropic", ("sk-ant-",), r"(?<![\w-])sk-ant-[A-Za-z0-9_-]{16,}", None),
    ("openai", ("sk-",), r"(?<![\w-])sk-(?:proj-|svcacct-|admin-)?[A-Za-z0-9_-]{20,}", None),
    ("stripe", ("k_live_", "k_test_"), r"(?<![\w-])(?:sk|rk)_(?:live|test)_[A-Za-z0-9]{16,}",
     None),
    ("github", ("ghp_", "gho_", "ghu_", "ghs_", "ghr_", "github_pat_"),
     r"(?<![\w-])(?:gh[pousr]_[A-Za-z0-9]{30,}|github_pat_[A-Za-z0-9_]{30,})", None),
    ("gitlab", ("glpat-",), r"(?<![\w-])glpat-[A-Za-z0-9_-]{20,}", None),
    ("slack", ("xox", "xapp-", "hooks.slack.com"),
     r"(?<![\w-])(?:xox[abposre]-[A-Za-z0-9-]{10,}|xapp-[0-9]-[A-Za-z0-9-]{10,})"
     r"|https://hooks\.slack\.com/services/[A-Za-z0-9_/]{20,}", None),
    ("aws", ("AKIA", "ASIA", "ABIA", "ACCA"),
     r"(?<![A-Z0-9])(?:AKIA|ASIA|ABIA|ACCA)[A-Z0-9]{16}(?![A-Z0-9])", None),
    ("google", ("AIza", "ya29.", "GOCSPX-"),
     r"(?<![\w-])(?:AIza[A-Za-z0-9_-]{30,}|ya29\.[A-Za-z0-9_-]{20,}|GOCSPX-[A-Za-z0-9_-]{20,})",
     None),
    ("huggingface", ("hf_",), r"(?<![\w-])hf_[A-Za-z0-9]{30,}", None),
    ("npm_pypi", ("npm_", "pypi-"), r"(?<![\w-])(?:npm_[A-Za-z0-9]{36}|pypi-[A-Za-z0-9_-]{50,})",
     None),
    ("sendgrid", ("SG.",), r"(?<![\w-])SG\.[A-Za-z0-9_-]{16,}\.[A-Za-z0-9_-]{16,}", None),
    ("twilio", ("SK",), r"(?<![\w-])SK[0-9a-fA-F]{32}(?![\w-])", None),
    ("groq_xai", ("gsk_", "xai-", "pplx-", "r8_"),
     r"(?<![\w-])(?:gsk_[A-Za-z0-9]{40,}|xai-[A-Za-z0-9]{40,}|pplx-[A-Za-z0-9]{40,}"
     r"|r8_[A-Za-z0-9]{30,})", None),
    ("vault", ("hvs.", "hvb.", "hvr."), r"(?<![\w-])hv[sbr]\.[A-Za-z0-9_-]{20,}", None),
)
_SECRET_RE = re.compile("|".join(f"(?P<{name}>{regex})"
                                 for name, _, regex, _ in SECRET_PATTERNS))
_SECRET_GROUP = {name: group for name, _, _, group in SECRET_PATTERNS}
_ANCHORS = tuple(dict.fromkeys(a for _, anchors, _, _ in SECRET_PATTERNS for a in anchors
                               if a.lower() != a))
_ANCHORS_LOWER = tuple(dict.fromkeys(a for _, anchors, _, _ in SECRET_PATTERNS
                                     for a in anchors if a.lower() == a))

#: ``key=value`` and ``key: value`` (also quoted: ``"password": "..."``, ``password='...'``,
#: query strings ``?api_key=...&token=...``, DSNs ``password=... host=...``, headers
#: ``Authorization: Bearer ...``) where the key names a credential (``is_credential``): the
#: value is replaced (after an authorization scheme word, the value that follows it). Only
#: texts that hold ``=`` or ``:`` and one of ``_KEY_FRAGMENTS`` (lower-cased) are searched.
_KEY_VALUE = re.compile(
    r"""(?P<key>(?<![\w.-])[A-Za-z_][\w.-]{0,63})(?P<q>["']?)[ \t]{0,4}[=:](?!//)[ \t]{0,4}"""
    r"""(?:"(?P<dq>(?:[^"\\\r\n]|\\.)*)"|'(?P<sq>(?:[^'\\\r\n]|\\.)*)'"""
    r"""|(?P<scheme>(?i:bearer|basic|digest|token|bot|negotiate)[ \t]+)?"""
    r"""(?P<plain>[^\s&;,'"<>(){}\[\]]+))""")
#: Parts of every credential word and pair (``CREDENTIAL_WORDS``, ``CREDENTIAL_PAIRS``).
_KEY_FRAGMENTS = ("pass", "pwd", "pin", "otp", "cvv", "cvc", "token", "jwt", "bearer",
                  "secret", "auth", "cred", "cookie", "key", "sess")


def _tokenish(text: str) -> bool:
    """True when an authorization value looks like a credential, not a word of prose
    ("Basic authentication"): a digit or a symbol in it, mixed case past its first letter,
    or 24 letters or more (longer than any word of prose)."""
    if len(text) >= 24 or any(c.isdigit() or c in "._~+/=-" for c in text):
        return True
    rest = text[1:]
    return any(c.isupper() for c in rest) and any(c.islower() for c in rest)


def _placeholder(text: str) -> bool:
    return text.lower() in _PLACEHOLDERS or _PLACEHOLDER_CHARS.issuperset(text) \
        or text.startswith(PREFIX) or text in PREFIX


class Scrubber:
    """One run's secret scrubber (pure: no I/O). It redacts structured values
    (``redact``), remembers every clear value it redacted, and replaces later occurrences
    of those values in any text (``text``, ``value``, ``struct``) with their keyed digests
    (the same ``hmac-sha256:...`` a field holding the value gets), then redacts text with
    the shape of a credential (``SECRET_PATTERNS``, and values of keys that name
    credentials in ``key=value`` text).

    Remembered values shorter than ``MIN_REMEMBERED`` characters are not looked for; those
    shorter than ``WHOLE_WORD_BELOW`` only as whole words; placeholders (``None``,
    ``****``) never. Secrets found by the patterns are remembered too. Scrubbing is
    idempotent: digests are never scrubbed again.
    """

    __slots__ = ("_digests", "_key", "_pattern", "_stale", "_unseen")

    def __init__(self, secret_key: bytes, *, inherit: Scrubber | None = None,
                 digests: Iterable[str] = ()) -> None:
        """``inherit``: a scrubber whose remembered values this one starts with (the same
        run before a resume on this runner, a child's parent). ``digests``: digests the
        run's journal already holds (a resumed run): words of later texts whose digest is
        one of them are learned as secrets and replaced (``learn``)."""
        self._key = secret_key
        self._digests: dict[str, str] = {} if inherit is None else dict(inherit._digests)
        self._pattern: re.Pattern[str] | None = None
        self._stale = bool(self._digests)
        self._unseen = set(digests) - set(self._digests.values())

    # -- remembering -------------------------------------------------------------------
    def remember(self, value: Any) -> None:
        """Remember the text of ``value`` (a string or number, or every one nested in a
        container) as a secret of this run."""
        stack: list[tuple[Any, int]] = [(value, 1)]
        while stack:
            item, level = stack.pop()
            if isinstance(item, str):
                self._remember(item, item)
                stripped = item.strip()
                if stripped != item:
                    self._remember(stripped, item)
                # "Bearer <token>", "user:pass": the secret part alone may be repeated
                # elsewhere (a denial reason quoting the token); remember the parts too.
                if not _placeholder(stripped) and not stripped.startswith(PREFIX):
                    for part in re.split(r"[\s:=]+", stripped):
                        if part != stripped and len(part) >= 8 and not _placeholder(part):
                            self._remember(part, item)
            elif isinstance(item, int | float) and not isinstance(item, bool):
                self._remember(str(item), item)
            elif isinstance(item, dict | list | tuple) and level <= MAX_DEPTH:
                stack.extend((v, level + 1) for v in _items(item))

    def _remember(self, text: str, value: Any) -> None:
        if not MIN_REMEMBERED <= len(text) <= MAX_REMEMBERED_CHARS or text in self._digests \
                or len(self._digests) >= MAX_REMEMBERED or _placeholder(text):
            return
        self._digests[text] = digest(self._key, value)
        self._stale = True

    @property
    def remembered(self) -> int:
        """How many texts this run remembers."""
        return len(self._digests)

    def _compiled(self) -> re.Pattern[str] | None:
        if self._stale:
            parts = []
            for text in sorted(self._digests, key=len, reverse=True):
                part = re.escape(text)
                if len(text) < WHOLE_WORD_BELOW:
                    if text[0] in _ALNUM:
                        part = "(?<![0-9A-Za-z])" + part
                    if text[-1] in _ALNUM:
                        part += "(?![0-9A-Za-z])"
                parts.append(part)
            self._pattern = re.compile("|".join(parts)) if parts else None
            self._stale = False
        return self._pattern

    # -- scrubbing ---------------------------------------------------------------------
    def learn(self, text: str) -> None:
        """Remember every word of ``text`` (whole, without surrounding punctuation, or a
        ``key=value`` part) whose digest the journal holds but whose clear value this
        scrubber has not seen: after a resume, a secret redacted before it is replaced
        again when it comes back (a secret holding spaces is not found this way)."""
        unseen = self._unseen
        tried: set[str] = set()
        for m in _WORDS.finditer(text):
            word = m.group()
            parts = _PARTS.split(word)
            for candidate in (word, word.strip(_PUNCTUATION), *parts,
                              *(part.strip(_PUNCTUATION) for part in parts)):
                if len(candidate) < MIN_REMEMBERED or candidate in tried:
                    continue
                tried.add(candidate)
                values: list[Any] = [candidate]
                if candidate.isascii() and candidate.isdigit():
                    values.append(int(candidate))  # a PIN redacted as a number
                for value in values:
                    d = digest(self._key, value)
                    if d in unseen:
                        unseen.discard(d)
                        self._remember(candidate, value)
                        if not unseen:
                            return
            if len(tried) > MAX_LEARNED_WORDS:
                return

    def _cut_secret(self, text: str) -> str:
        """A text cut short (ending in an ellipsis) that ends with the start of a
        remembered value: that start is replaced by the value's digest too."""
        body = text[:-1]
        for value, dig in self._digests.items():
            head = value[:MIN_REMEMBERED]
            at = body.find(head, max(len(body) - len(value) + 1, 0))
            while at != -1:
                if value.startswith(body[at:]):
                    return body[:at] + dig + text[-1]
                at = body.find(head, at + 1)
        return text

    def text(self, text: str) -> str:
        """``text`` with every remembered value and every credential-shaped part replaced by
        its digest (the same object when nothing was replaced)."""
        if self._unseen:
            self.learn(text)
        known = self._digests
        if known:
            hit = len(known) > 32
            if not hit:
                for value in known:
                    if value in text:
                        hit = True
                        break
            pattern = self._compiled() if hit else None
            if pattern is not None:
                out, found = pattern.subn(self._known, text)
                if found:
                    text = out
            if text.endswith(ELLIPSIS):
                text = self._cut_secret(text)
        lower: str | None = None
        for anchor in _ANCHORS:
            if anchor in text:
                break
        else:
            lower = text.lower()
            for anchor in _ANCHORS_LOWER:
                if anchor in lower:
                    break
            else:
                anchor = ""
        if anchor:
            out, found = _SECRET_RE.subn(self._shaped, text)
            if found:
                text, lower = out, None
        if "=" in text or ":" in text:
            if lower is None:
                lower = text.lower()
            for fragment in _KEY_FRAGMENTS:
                if fragment in lower:
                    return self._key_values(text)
        return text

    def _known(self, m: re.Match[str]) -> str:
        return self._digests[m.group()]

    def _replace(self, m: re.Match[str], group: str | int) -> str:
        secret = m.group(group)
        start, end = m.span(group)
        if not secret or _placeholder(secret) or m.string.startswith(PREFIX, start):
            return m.group()
        self._remember(secret, secret)
        base = m.start()
        whole = m.group()
        return whole[:start - base] + digest(self._key, secret) + whole[end - base:]

    def _shaped(self, m: re.Match[str]) -> str:
        name = m.lastgroup or ""
        group = _SECRET_GROUP.get(name)
        if name == "scheme" and not _tokenish(m.group("scheme_value")):
            return m.group()
        return self._replace(m, group if group is not None else name)

    def _key_values(self, text: str) -> str:
        """``_KEY_VALUE`` replacements, by hand: after a key that names no credential the
        search goes on right after that key, so ``Error: password=...`` is found."""
        parts: list[str] = []
        pos = done = 0
        search = _KEY_VALUE.search
        while (m := search(text, pos)) is not None:
            if not is_credential(m.group("key")):
                pos = m.end("key")
                continue
            group = next(g for g in ("dq", "sq", "plain") if m.group(g) is not None)
            parts.append(text[done:m.start()])
            parts.append(self._replace(m, group))
            pos = done = m.end()
        if not parts:
            return text
        parts.append(text[done:])
        return "".join(parts)

    def value(self, value: Any) -> tuple[Any, bool]:
        """A JSON-like value with every text in it scrubbed, dict keys included (see
        ``KEYS_SHAPED_FROM``), and whether anything changed; unchanged containers are not
        copied."""
        return self._value(value, 1)

    def _key_floor(self) -> int:
        """The shortest dict key ``value`` scrubs: every key that could hold a remembered
        value once the run remembers one (or may learn one), else only keys long enough to
        have a credential's shape, so a run that redacted nothing pays one ``len`` per key."""
        return MIN_REMEMBERED if self._digests or self._unseen else KEYS_SHAPED_FROM

    def _dict_key(self, key: str) -> str:
        """A dict key scrubbed: ``text`` for a key long enough to have a credential's shape;
        a shorter one is only looked at for remembered values (measured: 1 µs a key less
        than ``text``, whose shape checks it cannot match)."""
        if len(key) >= KEYS_SHAPED_FROM:
            return self.text(key)
        if self._unseen:
            self.learn(key)
        known = self._digests
        if len(known) <= 32 and not any(value in key for value in known):
            return key
        pattern = self._compiled()
        return key if pattern is None else pattern.sub(self._known, key)

    def _value(self, value: Any, level: int) -> tuple[Any, bool]:
        if isinstance(value, str):
            out = self.text(value)
            return out, out is not value and out != value
        if level > MAX_DEPTH:
            return value, False
        if isinstance(value, dict):
            new: dict[Any, Any] | None = None
            renamed: dict[str, str] | None = None
            floor = self._key_floor()
            opaque = OPAQUE_KEYS if value.get("type") != "redacted_thinking" \
                else OPAQUE_KEYS | {"data"}
            for k, v in value.items():
                # A key is text too (SPEC 9): a result keyed by a secret holds it in clear.
                if type(k) is str and len(k) >= floor:
                    scrubbed = self._dict_key(k)
                    if scrubbed != k:
                        if renamed is None:
                            renamed = {}
                        renamed[k] = scrubbed
                if (type(v) in _SCALARS and type(v) is not str) or k in opaque:
                    continue
                got, changed = self._value(v, level + 1)
                if changed:
                    if new is None:
                        new = dict(value)
                    new[k] = got
            if renamed is not None:
                new = {renamed.get(k, k): v for k, v in (value if new is None else new).items()}
            return (value, False) if new is None else (new, True)
        if isinstance(value, list | tuple):
            items: list[Any] | None = None
            for i, v in enumerate(value):
                if type(v) in _SCALARS and type(v) is not str:
                    continue
                got, changed = self._value(v, level + 1)
                if changed:
                    if items is None:
                        items = list(value)
                    items[i] = got
            return (value, False) if items is None else (items, True)
        if isinstance(value, msgspec.Struct):
            return self.struct(value, _no_fields, level)
        return value, False

    def struct(self, obj: Any, keep: Callable[[type], Collection[str]],
               level: int = 1) -> tuple[Any, bool]:
        """A msgspec Struct (an event, a message) with every text in its fields scrubbed,
        except the fields ``keep(type)`` names (ids, names, categories the fold matches on),
        at any depth; and whether anything changed. (``level``: how deep this struct is.)"""
        if level > MAX_DEPTH:
            return obj, False
        names = _WALKED.get((type(obj), keep))  # _text_fields' cache, read here first
        if names is None:
            names = _text_fields(type(obj), keep)
        if not names:
            return obj, False
        changes: dict[str, Any] = {}
        for name in names:
            v = getattr(obj, name)
            if v is None or type(v) in (int, float, bool):
                continue
            if isinstance(v, msgspec.Struct):
                got, changed = self.struct(v, keep, level + 1)
            elif isinstance(v, list) and v and isinstance(v[0], msgspec.Struct):
                got, changed = v, False
                for i, item in enumerate(v):
                    new_item, item_changed = self.struct(item, keep, level + 1) \
                        if isinstance(item, msgspec.Struct) else self._value(item, level + 1)
                    if item_changed:
                        if not changed:
                            got, changed = list(v), True
                        got[i] = new_item
            else:
                got, changed = self._value(v, level + 1)
            if changed:
                changes[name] = got
        if not changes:
            return obj, False
        return msgspec.structs.replace(obj, **changes), True

    def redact(self, value: Any, sensitive: Collection[str] = ()) -> tuple[Any, bool]:
        """``redact`` under this run's key, remembering the values it replaced, then the
        texts left in the value scrubbed; and whether anything changed."""
        found: list[Any] = []
        out, changed = redact(value, self._key, sensitive, found)
        for v in found:
            self.remember(v)
        out, scrubbed = self.value(out)
        return out, changed or scrubbed


def _no_fields(cls: type) -> Collection[str]:
    return ()


_NUMBERS = (int, float, bool, type(None))
#: The fields ``Scrubber.struct`` walks, by (Struct type, keep): every field but those kept
#: and those that can only hold numbers (computed once per type; bounded).
_WALKED: dict[tuple[type, Any], tuple[str, ...]] = {}


def _text_fields(cls: type, keep: Callable[[type], Collection[str]]) -> tuple[str, ...]:
    found = _WALKED.get((cls, keep))
    if found is None:
        kept = keep(cls)
        try:
            infos = msgspec.structs.fields(cls)
        except Exception:  # noqa: BLE001 - unresolvable annotations: walk every field
            names = [n for n in getattr(cls, "__struct_fields__", ()) if n not in kept]
        else:
            names = [f.name for f in infos if f.name not in kept
                     and not all(t in _NUMBERS for t in (typing.get_args(f.type) or (f.type,)))]
        found = tuple(names)
        if len(_WALKED) < 1024:
            _WALKED[(cls, keep)] = found
    return found


#: Fields of boundloop's events and messages that ``Scrubber.struct`` leaves alone when
#: scrubbing what a run journals: ids, names and categories the fold and the replay check
#: match on (a remembered value that happens to equal a tool's name must not rename the
#: tool), and structs of numbers. Every other text field is scrubbed.
KEPT_FIELDS = frozenset({
    "run_id", "execution_id", "idempotency_key", "call_id", "id", "name", "tool", "tools",
    "decision", "status", "outcome", "owner", "by", "parent_run_id", "parent_execution_id",
    "child_run_id", "digest", "error_category", "exhausted_limit", "budget", "usage",
    "reservation",
})


# -- storability --------------------------------------------------------------------------
def storable(value: Any) -> bool:
    """True when ``value`` can be journaled as it is (msgpack takes no lone surrogate, no
    integer beyond 64 bits, no value nested too deep or holding itself). Never raises."""
    try:
        _msgpack.encode(value)
    except _ENCODE_ERRORS:
        return False
    return True


def same_value(a: Any, b: Any) -> bool:
    """``a`` and ``b`` are the same value, types included (``1``, ``1.0`` and ``True`` are
    not): their msgpack bytes are equal. A value that cannot be encoded is not the same.
    Never raises."""
    try:
        return bool(_msgpack.encode(a) == _msgpack.encode(b))
    except _ENCODE_ERRORS:
        return False


_DIGEST = re.compile(re.escape(PREFIX) + "[0-9a-f]{64}")


def digests_in(value: Any) -> set[str]:
    """Every digest (``hmac-sha256:<hex>``) in a JSON-like value or msgspec Struct (a
    run's transcript), at any depth and inside texts."""
    try:
        text = _json.encode(value).decode()
    except _ENCODE_ERRORS:
        return set()
    return set(_DIGEST.findall(text))


def journal_safe(value: Any) -> Any:
    """``value`` (JSON-like data) made storable: lone surrogates in text become U+FFFD, and
    integers beyond 64 bits become their decimal strings. Storable values come back as they
    are."""
    if storable(value):
        return value
    return _made_safe(value, 1)


def _made_safe(value: Any, level: int) -> Any:
    if isinstance(value, str):
        return _SURROGATE.sub("\ufffd", value)
    if isinstance(value, bool):
        return value
    if isinstance(value, int):
        return value if _INT_MIN <= value <= _UINT_MAX else str(value)
    if isinstance(value, dict | list | tuple):
        if level > MAX_DEPTH:
            return TOO_DEEP_TEXT
        if isinstance(value, dict):
            return {_safe_key(k): _made_safe(v, level + 1) for k, v in value.items()}
        return [_made_safe(v, level + 1) for v in value]
    return value


def _safe_key(key: Any) -> Any:
    if isinstance(key, str):
        return _SURROGATE.sub("\ufffd", key)
    if isinstance(key, int) and not isinstance(key, bool) and not _INT_MIN <= key <= _UINT_MAX:
        return str(key)
    return key


def plain_result(value: Any) -> tuple[Any, bytes, str | None]:
    """A tool result as storable JSON-like data, with its compact JSON and, when it cannot
    be recorded, why not. Never raises.

    Objects msgspec does not know become their ``repr``; lone surrogates become U+FFFD and
    integers beyond 64 bits their decimal strings (as ``journal_safe``). A value nested
    deeper than ``MAX_DEPTH``, containing itself, or not convertible (a ``__repr__`` that
    raises, a dict key that is not a string or number) gives ``(sentence, its JSON, why)``,
    where ``why`` ends a sentence about the value (``"it is nested deeper than 64
    levels"``) and ``sentence`` is the content that stands for the result.

    The depth is walked only when the JSON has more than ``MAX_DEPTH`` brackets (a value
    cannot nest deeper than it has containers), so most results cost no Python-level walk.
    """
    if type(value) in _SCALARS:
        content = journal_safe(value)
        return content, _json.encode(content), None
    try:
        plain = msgspec.to_builtins(value, str_keys=True, enc_hook=repr)
    except RecursionError:
        problem = shape_problem(value)
        why = f"it is {shape_text(problem)}" if problem is not None else \
            "it is nested too deeply to be converted (or holds an object that contains itself)"
    except Exception as exc:  # noqa: BLE001 - user objects may raise anything while converted
        why = f"it holds a value that cannot be converted to JSON-like data " \
              f"({describe_exception(exc)})"
    else:
        data: bytes | None
        try:
            data = _json.encode(plain)
        except _ENCODE_ERRORS:  # a lone surrogate, or too deep for the encoder
            data = None
        problem = None
        if data is None or data.count(b"[") + data.count(b"{") > MAX_DEPTH:
            problem = shape_problem(plain)
        if problem is None:
            content = journal_safe(plain)
            if data is None or content is not plain:
                data = _json.encode(content)
            return content, data, None
        why = f"it is {shape_text(problem)}"
    text = f"The tool's result cannot be recorded: {why}."
    return text, _json.encode(text), why


def plain_content(value: Any) -> tuple[Any, str | None]:
    """``plain_result`` without the JSON: ``(content, None)``, or ``(None, why)`` when the
    value cannot be recorded."""
    content, _, why = plain_result(value)
    return (content, None) if why is None else (None, why)


def unstorable_reason(value: Any) -> str | None:
    """Why ``value`` cannot be journaled (or written as JSON, as the transcript is measured
    and sent), naming where (``"an integer beyond 64 bits at `arguments.n`"``), else None.
    Slower than ``storable``: for error messages."""
    problem = shape_problem(value)
    if problem is not None:
        return f"a value {shape_text(problem)}"
    stack: list[tuple[str, Any]] = [("", value)]
    while stack:
        where, item = stack.pop()
        at = f" at `{where}`" if where else ""
        if isinstance(item, dict):
            for k, v in item.items():
                name = k if isinstance(k, str) else safe_repr(k)
                if isinstance(k, str) and _SURROGATE.search(k):
                    return f"a key with a lone surrogate (text that is not valid Unicode){at}"
                if isinstance(k, int) and not isinstance(k, bool) and \
                        not _INT_MIN <= k <= _UINT_MAX:
                    return f"a key that is an integer beyond 64 bits{at}"
                if not isinstance(k, str | int | float) and not storable(k):
                    return f"a key of type {type(k).__name__}{at}"
                stack.append((f"{where}.{name}" if where else name, v))
        elif isinstance(item, list | tuple | set | frozenset):
            stack.extend((f"{where}[{i}]", v) for i, v in enumerate(item))
        elif isinstance(item, str):
            if _SURROGATE.search(item):
                return f"text with a lone surrogate (not valid Unicode){at}"
        elif isinstance(item, bool) or item is None or isinstance(item, float):
            continue
        elif isinstance(item, int):
            if not _INT_MIN <= item <= _UINT_MAX:
                return f"an integer beyond 64 bits{at}"
        elif not storable(item):
            return f"a value of type {type(item).__name__}{at} (not JSON-like)"
    if not storable(value):
        return "a value that cannot be encoded"
    return json_problem(value)
