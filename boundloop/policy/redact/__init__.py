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

from boundloop.policy.redact._credentials import CREDENTIAL_PAIRS as CREDENTIAL_PAIRS
from boundloop.policy.redact._credentials import CREDENTIAL_WORDS as CREDENTIAL_WORDS
from boundloop.policy.redact._credentials import is_credential as is_credential
from boundloop.policy.redact._credentials import key_words as key_words
from boundloop.policy.redact._patterns import KEYS_SHAPED_FROM as KEYS_SHAPED_FROM
from boundloop.policy.redact._patterns import MAX_LEARNED_WORDS as MAX_LEARNED_WORDS
from boundloop.policy.redact._patterns import MAX_REMEMBERED as MAX_REMEMBERED
from boundloop.policy.redact._patterns import MAX_REMEMBERED_CHARS as MAX_REMEMBERED_CHARS
from boundloop.policy.redact._patterns import MIN_REMEMBERED as MIN_REMEMBERED
from boundloop.policy.redact._patterns import OPAQUE_KEYS as OPAQUE_KEYS
from boundloop.policy.redact._patterns import SECRET_PATTERNS as SECRET_PATTERNS
from boundloop.policy.redact._patterns import WHOLE_WORD_BELOW as WHOLE_WORD_BELOW
from boundloop.policy.redact._scrubber import Scrubber as Scrubber
from boundloop.policy.redact._storable import KEPT_FIELDS as KEPT_FIELDS
from boundloop.policy.redact._storable import digests_in as digests_in
from boundloop.policy.redact._storable import journal_safe as journal_safe
from boundloop.policy.redact._storable import plain_content as plain_content
from boundloop.policy.redact._storable import plain_result as plain_result
from boundloop.policy.redact._storable import same_value as same_value
from boundloop.policy.redact._storable import storable as storable
from boundloop.policy.redact._storable import unstorable_reason as unstorable_reason
from boundloop.policy.redact._values import ARGUMENTS_NOT_KEPT as ARGUMENTS_NOT_KEPT
from boundloop.policy.redact._values import MAX_DEPTH as MAX_DEPTH
from boundloop.policy.redact._values import PREFIX as PREFIX
from boundloop.policy.redact._values import TOO_DEEP_TEXT as TOO_DEEP_TEXT
from boundloop.policy.redact._values import Shape as Shape
from boundloop.policy.redact._values import arguments_not_kept as arguments_not_kept
from boundloop.policy.redact._values import arguments_problem as arguments_problem
from boundloop.policy.redact._values import digest as digest
from boundloop.policy.redact._values import json_problem as json_problem
from boundloop.policy.redact._values import redact as redact
from boundloop.policy.redact._values import safe_repr as safe_repr
from boundloop.policy.redact._values import shape_problem as shape_problem
from boundloop.policy.redact._values import shape_text as shape_text
