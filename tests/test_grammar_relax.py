"""Non-strict tool schemas (grammar.relax): every JSON Schema keyword is taken; those the grammar
can hold are enforced, on llama.cpp's own grammar parser driven byte by byte; the rest are left
out and named; the hostile-input bounds still hold for what comes out; `strict: true` keeps
the exact subset, and a tool call's grammar holds the relaxed schema end to end."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from edgellmd.api.structured import tool_plan
from edgellmd.errors import ApiError
from edgellmd.grammar.convert import schema_to_grammar
from edgellmd.grammar.relax import MAX_ENFORCED_LENGTH, relax
from edgellmd.grammar.schema import MAX_OBJECT_PROPERTIES, SchemaError, check_schema
from tests.bench_grammar_limits import ByteVocab, byte_vocab


@pytest.fixture(scope="module")
def vocab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ByteVocab]:
    with byte_vocab(tmp_path_factory.mktemp("relax")) as v:
        yield v


def enforced(vocab: ByteVocab, schema: Any, good: list[Any], bad: list[Any]) -> tuple[str, ...]:
    """Relax `schema`, build its grammar, check llama.cpp takes `good` and refuses `bad` (as JSON)."""
    relaxed, left_out = relax(schema)
    grammar = schema_to_grammar(relaxed)
    assert vocab.parses(grammar), grammar
    for value in good:
        assert vocab.matches(grammar, json.dumps(value, ensure_ascii=False)), (value, relaxed)
    for value in bad:
        assert not vocab.matches(grammar, json.dumps(value, ensure_ascii=False)), (value, relaxed)
    return left_out


def test_min_and_max_length_are_enforced(vocab: ByteVocab) -> None:
    schema = {  # pydantic's Field(min_length=2, max_length=5), as openai.pydantic_function_tool sends it
        "type": "object",
        "properties": {
            "code": {"type": "string", "minLength": 2, "maxLength": 5},
            "note": {"type": "string", "minLength": 1},
        },
        "required": ["code", "note"],
        "additionalProperties": False,
    }
    left = enforced(
        vocab,
        schema,
        good=[
            {"code": "ab", "note": "x"},
            {"code": "abcde", "note": "a longer note"},
            {"code": "é\n日", "note": "y"},
        ],
        bad=[{"code": "a", "note": "x"}, {"code": "abcdef", "note": "x"}, {"code": "ab", "note": ""}],
    )
    assert left == ()


def test_lengths_past_the_bound_or_beside_a_pattern_are_left_out(vocab: ByteVocab) -> None:
    long = {"type": "string", "maxLength": MAX_ENFORCED_LENGTH + 1, "minLength": 1}
    left = enforced(vocab, long, good=["a", "b" * (MAX_ENFORCED_LENGTH + 5)], bad=[""])
    assert left == ("maxLength",)
    with_pattern = {"type": "string", "pattern": "^[a-z]+$", "maxLength": 2}
    left = enforced(vocab, with_pattern, good=["abc"], bad=["A"])
    assert left == ("maxLength",)
    assert relax({"type": "string", "minLength": 5, "maxLength": 2})[1] == ("maxLength", "minLength")
    assert relax({"type": "string", "minLength": "2"})[1] == ("minLength",)


def test_one_of_is_any_of(vocab: ByteVocab) -> None:
    schema = {"oneOf": [{"type": "integer"}, {"type": "string", "enum": ["auto"]}]}
    left = enforced(vocab, schema, good=[3, "auto"], bad=["manual", 2.5, None])
    assert left == ()


def test_all_of_merges_an_objects_parts(vocab: ByteVocab) -> None:
    schema = {  # a pydantic model with a base class, as some generators write it
        "allOf": [
            {"type": "object", "properties": {"id": {"type": "integer"}}, "required": ["id"]},
            {"properties": {"name": {"type": "string"}}, "required": ["name"], "additionalProperties": False},
        ]
    }
    left = enforced(
        vocab,
        schema,
        good=[{"id": 1, "name": "a"}],
        bad=[{"id": 1}, {"name": "a"}, {"id": 1, "name": "a", "extra": True}],
    )
    assert left == ()
    # Members that are not an object's parts, or that define one property twice: left out.
    assert relax({"allOf": [{"type": "string"}, {"minLength": 1}]}) == ({}, ("allOf",))
    twice = {"allOf": [{"properties": {"a": {"type": "string"}}}, {"properties": {"a": {"type": "integer"}}}]}
    assert relax(twice)[1] == ("allOf",)


def test_empty_properties_means_no_keys(vocab: ByteVocab) -> None:
    left = enforced(vocab, {"type": "object", "properties": {}}, good=[{}], bad=[{"key": "time"}])
    assert left == ()
    # Said outright, extra keys stay allowed.
    open_ = {"type": "object", "properties": {}, "additionalProperties": True}
    assert relax(open_) == (open_, ())


def test_keywords_the_grammar_cannot_hold_are_left_out_and_named(vocab: ByteVocab) -> None:
    schema = {
        "type": "object",
        "properties": {
            "tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True},
            "meta": {"type": "object", "propertyNames": {"pattern": "^x-"}, "minProperties": 1},
            "when": {"type": "string", "format": "rfc-822"},
            "who": {"type": "string", "pattern": "^(?=a)a$"},  # lookahead: outside the regex subset
            "ref": {"$ref": "#/$defs/thing", "description": "kept", "nullable": True},
            "pick": {"enum": ["a", "b"], "type": "string", "maxLength": 1},
            "not_null": {"not": {"type": "null"}},
        },
        "required": ["tags"],
        "$defs": {"thing": {"type": "integer", "deprecated": True}},
        "if": {"required": ["a"]},
        "then": {"required": ["b"]},
    }
    left = enforced(
        vocab,
        schema,
        good=[{"tags": ["a", "a"], "meta": {}, "when": "Tue", "who": "b", "ref": 3, "pick": "a"}],
        bad=[{"tags": "a"}, {"tags": [], "ref": "3"}, {"tags": [], "pick": "c"}],
    )
    assert left == (
        "deprecated",
        "format",
        "if",
        "maxLength",
        "minProperties",
        "not",
        "nullable",
        "pattern",
        "propertyNames",
        "then",
        "uniqueItems",
    )


def test_a_relaxed_schema_still_meets_every_bound() -> None:
    huge = {
        "type": "object",
        "properties": {f"p{i}": {"type": "string", "minLength": 1} for i in range(MAX_OBJECT_PROPERTIES + 1)},
    }
    relaxed, _ = relax(huge)
    with pytest.raises(SchemaError, match="object properties"):
        check_schema(relaxed)
    # Lengths become patterns, each within the pattern bounds: many of them still meet the grammar's.
    many = {
        "type": "object",
        "properties": {f"p{i}": {"type": "string", "maxLength": MAX_ENFORCED_LENGTH} for i in range(64)},
    }
    schema_to_grammar(relax(many)[0])
    deep: Any = {"type": "string"}
    for _ in range(300):
        deep = {"oneOf": [deep]}
    relaxed, _ = relax(deep)
    with pytest.raises(SchemaError):
        check_schema(relaxed)


def _tool(parameters: dict[str, Any], strict: bool | None) -> dict[str, Any]:
    function: dict[str, Any] = {"name": "lookup", "parameters": parameters}
    if strict is not None:
        function["strict"] = strict
    return {"type": "function", "function": function}


PYDANTIC_FIELD: dict[str, Any] = {
    "type": "object",
    "properties": {"city": {"type": "string", "minLength": 2, "maxLength": 40, "title": "City"}},
    "required": ["city"],
}


def test_strict_tools_keep_the_exact_subset_and_others_are_relaxed(vocab: ByteVocab, tmp_path: Path) -> None:
    with pytest.raises(ApiError) as caught:
        tool_plan([_tool(PYDANTIC_FIELD, True)], "required", False)
    assert caught.value.code == "unsupported_parameter"
    assert "minLength" in caught.value.message
    for strict in (None, False):
        plan = tool_plan([_tool(PYDANTIC_FIELD, strict)], "required", False)
        assert plan is not None
        assert plan.grammar is not None
        assert vocab.parses(plan.grammar)
        call = '{"tool_calls":[{"name":"lookup","arguments":{"city":"Oslo"}}]}'
        assert vocab.matches(plan.grammar, call)
        assert not vocab.matches(plan.grammar, call.replace("Oslo", "O"))  # minLength 2, held
    with pytest.raises(ApiError) as caught:
        tool_plan([_tool(PYDANTIC_FIELD, "yes")], "required", False)  # type: ignore[arg-type]
    assert caught.value.param == "tools[0].function.strict"


@pytest.mark.parametrize(
    ("parameters", "call_arguments"),
    [
        ({}, "{}"),  # no parameters
        (
            {"properties": {"city": {"type": "string"}}, "required": ["city"]},
            '{"city":"Oslo"}',
        ),  # no type said
    ],
)
def test_a_tool_whose_parameters_say_no_type_takes_an_object(
    vocab: ByteVocab, parameters: dict[str, Any], call_arguments: str
) -> None:
    plan = tool_plan([_tool(parameters, None)], "required", False)
    assert plan is not None
    assert plan.grammar is not None
    call = '{"tool_calls":[{"name":"lookup","arguments":' + call_arguments + "}]}"
    assert vocab.matches(plan.grammar, call)
    assert not vocab.matches(plan.grammar, call.replace(call_arguments, '"Oslo"'))  # never a scalar


@pytest.mark.parametrize("kind", ["integer", "number", "string", "boolean", "null", "array"])
def test_a_tool_whose_parameters_are_no_object_is_refused(kind: str) -> None:
    """A call's arguments are an object: a scalar schema once made replies whose call could not
    be read (the call's closing brace taken as the argument's end) and came out as text."""
    with pytest.raises(ApiError) as caught:
        tool_plan([_tool({"type": kind}, None)], "required", False)
    assert caught.value.param == "tools[0].function.parameters"
    assert "type object" in caught.value.message
