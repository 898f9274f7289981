"""``bl.Tool.from_schema``: a tool described by a plain JSON Schema, its arguments checked by
a cached ``jsonschema`` validator (Draft 2020-12 unless ``$schema`` names another draft)."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest

import boundloop as bl
from boundloop.tools import ArgumentError

jsonschema = pytest.importorskip("jsonschema", reason="Tool.from_schema needs jsonschema "
                                                      "(pip install 'boundloop[schema]')")

CONTACT = {"type": "object", "properties": {"name": {"type": "string"},
                                            "email": {"type": "string"}},
           "required": ["name", "email"], "additionalProperties": False}
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 40},
        "priority": {"type": "integer", "minimum": 1, "maximum": 5},
        "contact": {"$ref": "#/$defs/contact"},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["bug", "idea"]}},
    },
    "required": ["title", "contact"],
    "additionalProperties": False,
    "$defs": {"contact": CONTACT},
}
GOOD = {"title": "printer", "contact": {"name": "Ann", "email": "ann@example.com"}}


def as_dict(args: dict[str, Any]) -> dict[str, Any]:
    return args


def ticket() -> bl.Tool:
    return bl.Tool.from_schema("ticket", SCHEMA, as_dict, description="Open a ticket.")


def problem(tool: bl.Tool, arguments: Any) -> str:
    with pytest.raises(ArgumentError) as info:
        tool.validate(arguments)
    return str(info.value)


def test_valid_arguments_pass_and_the_schema_is_the_tools_own() -> None:
    tool = ticket()
    assert tool.validate(GOOD) == GOOD
    assert tool.validate({**GOOD, "priority": 5, "tags": ["bug"]})["priority"] == 5
    assert tool.schema == {"name": "ticket", "description": "Open a ticket.",
                           "parameters": SCHEMA}
    assert tool.schema["parameters"] is not SCHEMA


def test_a_missing_required_field() -> None:
    assert problem(ticket(), {"contact": GOOD["contact"]}) == \
        "Object missing required field `title`"


def test_a_wrong_type() -> None:
    assert problem(ticket(), {**GOOD, "priority": "high"}) == \
        "Expected `integer`, got `string` - at `$.priority`"
    assert problem(ticket(), {**GOOD, "priority": True}) == \
        "Expected `integer`, got `boolean` - at `$.priority`"
    assert problem(ticket(), ["not", "an", "object"]) == "Expected `object`, got `array`"


def test_a_field_that_additional_properties_false_forbids() -> None:
    assert problem(ticket(), {**GOOD, "colour": "red"}) == \
        "Object contains unknown field `colour`"


def test_a_nested_path_is_named() -> None:
    assert problem(ticket(), {**GOOD, "contact": {"name": "Ann"}}) == \
        "Object missing required field `email` - at `$.contact`"
    assert problem(ticket(), {**GOOD, "contact": {"name": "Ann", "email": 1}}) == \
        "Expected `string`, got `integer` - at `$.contact.email`"
    assert problem(ticket(), {**GOOD, "tags": ["bug", "wish"]}) == \
        'Expected one of ["bug","idea"] - at `$.tags[1]`'


def test_limits_are_described_without_quoting_the_value() -> None:
    secret = "hunter2-hunter2-hunter2-hunter2-hunter2-hunter2"
    text = problem(ticket(), {**GOOD, "title": secret})
    assert text == "Expected `string` of length <= 40 - at `$.title`"
    assert secret not in text
    assert problem(ticket(), {**GOOD, "priority": 9}) == \
        "Expected `integer` <= 5 - at `$.priority`"


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {"a": {"type": "nope"}}},
    {"type": "object", "properties": {"a": {"minimum": "one"}}},
    {"type": "object", "required": "a"},
    {"type": "object", "properties": {"a": {"type": "string"}}, "$schema": "urn:unknown"},
])
def test_a_bad_schema_is_a_config_error(schema: dict[str, Any]) -> None:
    with pytest.raises(bl.ConfigError, match="tool 't': its schema"):
        bl.Tool.from_schema("t", schema, as_dict)


@pytest.mark.parametrize("schema", [
    {"type": "array"}, {"properties": {"a": {}}}, {"type": ["object"]}, True, [],
    {"type": "string"},
])
def test_a_root_that_is_not_an_object_schema_is_a_config_error(schema: Any) -> None:
    with pytest.raises(bl.ConfigError, match=r"root of its schema must be an object schema"):
        bl.Tool.from_schema("t", schema, as_dict)


def test_a_schema_that_is_not_json_data_is_a_config_error() -> None:
    with pytest.raises(bl.ConfigError, match="must be JSON data"):
        bl.Tool.from_schema("t", {"type": "object", "default": object()}, as_dict)


def test_the_validator_is_built_once_per_tool(monkeypatch: pytest.MonkeyPatch) -> None:
    built: list[Any] = []

    real = jsonschema.Draft202012Validator

    class Counting:  # stands in for the class: counts the validators built from a schema
        check_schema = staticmethod(real.check_schema)

        def __new__(cls, schema: Any) -> Any:
            built.append(schema)
            return real(schema)

    monkeypatch.setattr(jsonschema, "Draft202012Validator", Counting)
    tool = ticket()
    for _ in range(3):
        tool.validate(GOOD)
        problem(tool, {})
    assert len(built) == 1


def test_another_draft_named_in_dollar_schema_is_honoured() -> None:
    draft7 = {"$schema": "http://json-schema.org/draft-07/schema#", "type": "object",
              "properties": {"pair": {"type": "array", "items": [{"type": "integer"}]}}}
    tool = bl.Tool.from_schema("t", draft7, as_dict)  # `items` as a list: draft-07 only
    assert tool.validate({"pair": [1, "x"]}) == {"pair": [1, "x"]}
    assert problem(tool, {"pair": ["x"]}) == "Expected `integer`, got `string` - at `$.pair[0]`"
    with pytest.raises(bl.ConfigError, match="not a valid JSON Schema"):
        bl.Tool.from_schema("t", {k: v for k, v in draft7.items() if k != "$schema"}, as_dict)


def test_later_changes_to_the_schema_change_nothing() -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}}
    tool = bl.Tool.from_schema("t", schema, as_dict)
    schema["properties"]["n"]["type"] = "string"
    tool.schema["parameters"]["properties"]["n"]["type"] = "string"
    assert tool.validate({"n": 1}) == {"n": 1}


def test_an_outside_reference_is_never_fetched_and_makes_arguments_invalid() -> None:
    schema = {"type": "object",
              "properties": {"a": {"$ref": "https://example.invalid/schema.json"}}}
    tool = bl.Tool.from_schema("t", schema, as_dict)
    assert tool.validate({}) == {}
    assert "could not be checked against the tool's schema" in problem(tool, {"a": 1})


def test_format_is_an_annotation_not_checked() -> None:
    schema = {"type": "object", "properties": {"at": {"type": "string", "format": "date"}}}
    assert bl.Tool.from_schema("t", schema, as_dict).validate({"at": "soon"}) == {"at": "soon"}


# --- the handler's calling convention -------------------------------------------------------

def test_a_handler_of_one_parameter_gets_the_arguments_as_one_dict(
        runner: bl.Runner) -> None:
    got: list[Any] = []

    def create(args: dict[str, Any], ctx: bl.ToolContext) -> str:
        got.append((dict(args), ctx.call_id))
        args["title"] = "changed"  # a copy: the transcript keeps what the model sent
        return "ok"

    tool = bl.Tool.from_schema("ticket", SCHEMA, create)
    model = bl.ScriptedModel([bl.CallTools([bl.ToolCall("c1", "ticket", GOOD),
                                            bl.ToolCall("c2", "ticket", {"title": 1})]),
                              bl.Final("done")])
    result = runner.run(model=model, tools=[tool], prompt="p")
    assert [m.status for m in result.transcript if isinstance(m, bl.ToolResultMessage)] == \
        ["ok", "invalid_arguments"]
    assert got == [(GOOD, "c1")]  # the invalid call never reached the handler
    first = next(m for m in result.transcript if isinstance(m, bl.CallMessage))
    assert first.arguments["title"] == "printer"


def test_a_handler_of_several_parameters_gets_keyword_arguments(runner: bl.Runner) -> None:
    schema = {"type": "object", "properties": {"query": {"type": "string"},
                                               "limit": {"type": "integer"}},
              "required": ["query"]}

    async def search(query: str, limit: int = 3, *, ctx: bl.ToolContext) -> list[str]:
        assert ctx.attempt == 1
        return [query] * limit

    tool = bl.Tool.from_schema("search", schema, search, read_only=True, idempotent=True)
    assert (tool.read_only, tool.idempotent, tool.irreversible) == (True, True, False)
    # A field the schema allows (no additionalProperties) but the handler does not take.
    assert problem(tool, {"query": "q", "other": 1}) == \
        "Object contains unknown field `other` (the tool's handler takes no such parameter)"
    model = bl.ScriptedModel([bl.CallTools([bl.ToolCall("c1", "search", {"query": "q",
                                                                          "limit": 2})]),
                              bl.Final("done")])
    result = runner.run(model=model, tools=[tool], prompt="p")
    assert bl.ToolResultMessage("c1", "ok", ["q", "q"]) in result.transcript


def test_a_single_parameter_named_like_a_property_gets_it_by_keyword() -> None:
    schema = {"type": "object", "properties": {"query": {"type": "string"}},
              "required": ["query"]}
    tool = bl.Tool.from_schema("t", schema, lambda query: query)
    kwargs = tool.validate({"query": "q"})
    assert tool.handler(**tool.bind(kwargs, None)) == "q"  # type: ignore[arg-type]


def test_a_handler_taking_kwargs_gets_any_field() -> None:
    schema = {"type": "object", "properties": {"user-id": {"type": "integer"}}}

    def handler(**fields: Any) -> dict[str, Any]:
        return fields

    tool = bl.Tool.from_schema("t", schema, handler)
    kwargs = tool.validate({"user-id": 1, "extra": True})
    assert tool.handler(**tool.bind(kwargs, None)) == {"user-id": 1,  # type: ignore[arg-type]
                                                       "extra": True}


@pytest.mark.parametrize(("handler", "words"), [
    (lambda a, b: None, r"properties \['c'\] are not parameters"),
    (lambda a, b, c, d: None, "parameter 'd' has no default, but the schema does not"),
    (lambda a, b, /, c=1: None, "must be a plain named parameter"),
    (lambda *args: None, "must be a plain named parameter"),
])
def test_a_handler_that_cannot_take_the_arguments_is_a_config_error(
        handler: Any, words: str) -> None:
    schema = {"type": "object", "properties": {"a": {}, "b": {}, "c": {}},
              "required": ["a", "b", "c"]}
    with pytest.raises(bl.ConfigError, match=words):
        bl.Tool.from_schema("t", schema, handler)


def test_a_property_named_like_the_context_parameter_is_a_config_error() -> None:
    def handler(args: dict[str, Any], ctx: bl.ToolContext) -> None: ...

    with pytest.raises(bl.ConfigError, match="property 'ctx'"):
        bl.Tool.from_schema("t", {"type": "object", "properties": {"ctx": {}}}, handler)


def test_the_tool_options_are_checked_as_for_any_tool() -> None:
    with pytest.raises(bl.ConfigError, match="both read_only and irreversible"):
        bl.Tool.from_schema("t", SCHEMA, as_dict, read_only=True, irreversible=True)
    with pytest.raises(bl.ConfigError, match="timeout_s"):
        bl.Tool.from_schema("t", SCHEMA, as_dict, timeout_s=0)
    with pytest.raises(bl.ConfigError, match="must be callable"):
        bl.Tool.from_schema("t", SCHEMA, "not a function")  # type: ignore[arg-type]


# --- optional dependencies ------------------------------------------------------------------

def test_without_jsonschema_from_schema_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "jsonschema", None)  # import jsonschema raises
    with pytest.raises(bl.ConfigError, match=r"boundloop\[schema\]"):
        bl.Tool.from_schema("t", SCHEMA, as_dict)


def test_importing_boundloop_imports_neither_jsonschema_nor_mcp() -> None:
    code = ("import sys, boundloop, boundloop.mcp\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('jsonschema', 'mcp', 'referencing')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True)
    assert out.stdout.strip() == "[]"
