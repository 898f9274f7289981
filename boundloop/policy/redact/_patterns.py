"""What text scrubbing looks for: remembered-value limits and credential-shaped text."""

from __future__ import annotations

import re

from boundloop.policy.redact._values import PREFIX

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


