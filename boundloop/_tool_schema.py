"""Tool.from_schema's JSON Schema side: the schema copied and checked, its jsonschema
validator built once, and a validation error told in msgspec's manner (what was expected,
and where), quoting no argument value.

How the handler takes the validated arguments is ``boundloop.tools``' business
(``_schema_binding``, next to the hint-derived tools).
"""

from __future__ import annotations

import importlib
import re
from typing import Any

import msgspec

from boundloop.errors import ConfigError
from boundloop.policy.safe_text import describe_exception

_DRAFT_2020_12 = "https://json-schema.org/draft/2020-12/schema"
#: The most characters of a schema value or a field name that a message quotes.
_QUOTE = 200
_JSON_TYPES: tuple[tuple[type | tuple[type, ...], str], ...] = (
    (bool, "boolean"), (int, "integer"), (float, "number"), (str, "string"),
    ((list, tuple), "array"), (dict, "object"), (type(None), "null"))
_BOUNDS = {
    "minLength": "`string` of length >=", "maxLength": "`string` of length <=",
    "minItems": "`array` of length >=", "maxItems": "`array` of length <=",
    "minProperties": "`object` with at least this many fields:",
    "maxProperties": "`object` with at most this many fields:",
    "minContains": "`array` with at least this many matching items:",
    "maxContains": "`array` with at most this many matching items:",
    "multipleOf": "a multiple of",
}
_LIMITS = {"minimum": ">=", "maximum": "<=", "exclusiveMinimum": ">", "exclusiveMaximum": "<"}


def _jsonschema() -> Any:
    try:
        return importlib.import_module("jsonschema")
    except ImportError:
        raise ConfigError("Tool.from_schema needs the `jsonschema` package, which is not "
                          "installed: pip install 'boundloop[schema]' (boundloop[mcp] "
                          "includes it)") from None


def _cut(text: str, limit: int = _QUOTE) -> str:
    return text if len(text) <= limit else text[:limit - 1] + "\u2026"


def _quote(value: Any) -> str:
    try:
        return _cut(msgspec.json.encode(value).decode())
    except (TypeError, ValueError, OverflowError, RecursionError):
        return _cut(type(value).__name__)


def _json_type(value: Any) -> str:
    for kind, name in _JSON_TYPES:
        if isinstance(value, kind):
            return name
    return type(value).__name__


def _plain_schema(name: str, schema: Any) -> dict[str, Any]:
    """A JSON copy of ``schema`` (so later changes to it change nothing here), whose root
    is an object schema."""
    _jsonschema()  # a missing package is reported first, whatever the schema
    try:
        plain = msgspec.json.decode(msgspec.json.encode(schema))
    except (TypeError, ValueError, OverflowError, RecursionError) as exc:
        raise ConfigError(f"tool {name!r}: its schema must be JSON data (dicts, lists, "
                          f"strings, numbers, booleans, None): {describe_exception(exc)}"
                          ) from None
    if not isinstance(plain, dict) or plain.get("type") != "object":
        raise ConfigError(
            f"tool {name!r}: the root of its schema must be an object schema, "
            '{"type": "object", "properties": {...}}, since a call\'s arguments are an '
            f"object; got {_quote(plain)}. To take another kind of value, make it a "
            "property of an object schema")
    return plain


def _schema_validator(name: str, plain: dict[str, Any]) -> Any:
    """The validator of ``plain``, built once (the schema is checked first)."""
    js = _jsonschema()
    declared = plain.get("$schema")
    kind: Any = js.Draft202012Validator
    if declared is not None:
        found = js.validators.validator_for(plain, default=None) \
            if isinstance(declared, str) else None
        if found is None:
            raise ConfigError(f"tool {name!r}: its schema's $schema {_quote(declared)} names "
                              f"no JSON Schema draft that jsonschema knows; drop it (Draft "
                              f"2020-12 is assumed) or name a known draft")
        if found is not js.validators.Draft202012Validator:
            kind = found
    try:
        kind.check_schema(plain)
        return kind(plain)
    except js.exceptions.SchemaError as exc:
        where = f" - at `{_cut(exc.json_path)}`" if exc.path else ""
        draft = getattr(kind, "META_SCHEMA", {}).get("$id") or kind.__name__
        raise ConfigError(f"tool {name!r}: its schema is not a valid JSON Schema ({draft}): "
                          f"{_cut(str(exc.message), 500)}{where}") from None
    except RecursionError:
        raise ConfigError(f"tool {name!r}: its schema is nested too deeply") from None



def _unknown_fields(value: Any, schema: Any) -> list[str]:
    if not isinstance(value, dict) or not isinstance(schema, dict):
        return []
    known = schema.get("properties") or {}
    patterns = schema.get("patternProperties") or {}

    def matches(key: str) -> bool:
        for pattern in patterns:
            try:
                if re.search(pattern, key):
                    return True
            except (re.error, TypeError):
                continue
        return False

    return [str(k) for k in value if k not in known and not (isinstance(k, str) and matches(k))]


def _schema_problem(error: Any) -> str:
    """A plain message for a jsonschema ValidationError, in msgspec's manner: what was
    expected and, below the root, where (``- at `$.a.b[0]```). It quotes no argument value
    (one may be long, or a secret), only field names and the schema's own values."""
    kind, expected, value = error.validator, error.validator_value, error.instance
    if kind == "type":
        kinds = expected if isinstance(expected, list) else [expected]
        text = f"Expected `{' | '.join(str(k) for k in kinds)}`, got `{_json_type(value)}`"
    elif kind == "required":
        absent = [n for n in expected if isinstance(value, dict) and n not in value]
        text = f"Object missing required field `{_cut(str((absent or expected)[0]))}`"
    elif kind in ("additionalProperties", "unevaluatedProperties"):
        unknown = _unknown_fields(value, error.schema) if kind == "additionalProperties" else []
        text = f"Object contains unknown field `{_cut(unknown[0])}`" if unknown else \
            "Object contains fields the schema does not allow"
    elif kind == "enum":
        text = f"Expected one of {_quote(expected)}"
    elif kind == "const":
        text = f"Expected {_quote(expected)}"
    elif kind in _LIMITS:
        text = f"Expected `{_json_type(value)}` {_LIMITS[kind]} {_quote(expected)}"
    elif kind in _BOUNDS:
        text = f"Expected {_BOUNDS[kind]} {_quote(expected)}"
    elif kind == "pattern":
        text = f"Expected `string` matching regex {_quote(expected)}"
    elif kind == "uniqueItems":
        text = "Expected `array` of unique items"
    elif kind == "dependentRequired":
        text = "Object missing a field that another field present requires " \
               f"({_quote(expected)})"
    elif kind in ("oneOf", "anyOf"):
        text = f"Expected a value matching {'exactly' if kind == 'oneOf' else 'at least'} " \
               f"one of the schemas in `{kind}`"
    elif kind == "not":
        text = "Expected a value that does not match the schema in `not`"
    elif kind is None:  # the schema `false`
        text = "No value is allowed here"
    else:
        text = f"Expected a value that satisfies the schema's `{_cut(str(kind))}`"
    if error.absolute_path:
        text += f" - at `{_cut(str(error.json_path))}`"
    return text
