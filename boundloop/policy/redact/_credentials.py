"""Which keys name a credential (split into words: ``is_credential``)."""

from __future__ import annotations

import re

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

