"""The Scrubber: a run's remembered secrets, replaced in its later texts."""

from __future__ import annotations

import re
import typing
from collections.abc import Callable, Collection, Iterable
from typing import Any

import msgspec

from boundloop.policy.redact._credentials import is_credential
from boundloop.policy.redact._patterns import (
    _ALNUM,
    _ANCHORS,
    _ANCHORS_LOWER,
    _KEY_FRAGMENTS,
    _KEY_VALUE,
    _PARTS,
    _PUNCTUATION,
    _SECRET_GROUP,
    _SECRET_RE,
    _WORDS,
    KEYS_SHAPED_FROM,
    MAX_LEARNED_WORDS,
    MAX_REMEMBERED,
    MAX_REMEMBERED_CHARS,
    MIN_REMEMBERED,
    OPAQUE_KEYS,
    WHOLE_WORD_BELOW,
    _placeholder,
    _tokenish,
)
from boundloop.policy.redact._values import (
    _SCALARS,
    MAX_DEPTH,
    PREFIX,
    _items,
    digest,
    redact,
)
from boundloop.policy.safe_text import ELLIPSIS


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
