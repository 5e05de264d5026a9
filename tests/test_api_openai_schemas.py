"""Validation of `POST /v1/embeddings` bodies: the good shapes and each refusal's parameter."""

from __future__ import annotations

from typing import Any

import pytest

from edgellmd.api.openai.decode import (
    MAX_EMBEDDING_INPUTS,
    EmbeddingRequest,
    parse_embeddings,
)
from edgellmd.errors import ApiError, InvalidRequest, UnsupportedParameter


def body(**fields: Any) -> dict[str, Any]:
    """A valid embeddings body, with `fields` added or replaced."""
    return {"model": "embed", "input": "hello", **fields}


def without(data: dict[str, Any], key: str) -> dict[str, Any]:
    """`data` less one key."""
    return {k: v for k, v in data.items() if k != key}


GOOD: list[tuple[dict[str, Any], EmbeddingRequest]] = [
    (body(), EmbeddingRequest("embed", ("hello",), "float", None)),
    (body(input=["a", "b c"]), EmbeddingRequest("embed", ("a", "b c"), "float", None)),
    (body(input=[1, 2, 3]), EmbeddingRequest("embed", ((1, 2, 3),), "float", None)),
    (body(input=[0]), EmbeddingRequest("embed", ((0,),), "float", None)),
    (body(input=[[1, 2], [3]]), EmbeddingRequest("embed", ((1, 2), (3,)), "float", None)),
    (
        body(input=["x"] * MAX_EMBEDDING_INPUTS),
        EmbeddingRequest("embed", ("x",) * MAX_EMBEDDING_INPUTS, "float", None),
    ),
    # One tokenized input: the input limit counts inputs, not tokens.
    (
        body(input=[5] * (MAX_EMBEDDING_INPUTS + 1)),
        EmbeddingRequest("embed", ((5,) * (MAX_EMBEDDING_INPUTS + 1),), "float", None),
    ),
    (body(encoding_format="base64"), EmbeddingRequest("embed", ("hello",), "base64", None)),
    (body(encoding_format="float"), EmbeddingRequest("embed", ("hello",), "float", None)),
    (
        body(encoding_format=None, dimensions=None, user=None),
        EmbeddingRequest("embed", ("hello",), "float", None),
    ),
    (body(user="user-42"), EmbeddingRequest("embed", ("hello",), "float", "user-42")),
]


@pytest.mark.parametrize(("data", "expected"), GOOD)
def test_good_bodies(data: dict[str, Any], expected: EmbeddingRequest) -> None:
    assert parse_embeddings(data) == expected


BAD: list[tuple[str, dict[str, Any], type[ApiError], str]] = [
    ("missing input", without(body(), "input"), InvalidRequest, "input"),
    ("null input", body(input=None), InvalidRequest, "input"),
    ("empty string", body(input=""), InvalidRequest, "input"),
    ("empty list", body(input=[]), InvalidRequest, "input"),
    ("empty string in list", body(input=["a", ""]), InvalidRequest, "input"),
    ("empty token list", body(input=[[1], []]), InvalidRequest, "input"),
    ("too many strings", body(input=["x"] * (MAX_EMBEDDING_INPUTS + 1)), InvalidRequest, "input"),
    ("too many token lists", body(input=[[1]] * (MAX_EMBEDDING_INPUTS + 1)), InvalidRequest, "input"),
    ("string and ints", body(input=["a", 1]), InvalidRequest, "input"),
    ("string and list", body(input=["a", [1]]), InvalidRequest, "input"),
    ("int and list", body(input=[1, [2]]), InvalidRequest, "input"),
    ("bool token", body(input=[1, True]), InvalidRequest, "input"),
    ("bool in token list", body(input=[[1, False]]), InvalidRequest, "input"),
    ("float token", body(input=[1.0]), InvalidRequest, "input"),
    ("negative token", body(input=[3, -1]), InvalidRequest, "input"),
    ("negative in token list", body(input=[[3], [-1]]), InvalidRequest, "input"),
    ("nested deeper", body(input=[[[1]]]), InvalidRequest, "input"),
    ("strings in a nested list", body(input=[["a"]]), InvalidRequest, "input"),
    ("object input", body(input={"text": "a"}), InvalidRequest, "input"),
    ("number input", body(input=7), InvalidRequest, "input"),
    ("unknown format", body(encoding_format="int8"), InvalidRequest, "encoding_format"),
    ("empty format", body(encoding_format=""), InvalidRequest, "encoding_format"),
    ("non-string format", body(encoding_format=1), InvalidRequest, "encoding_format"),
    ("dimensions", body(dimensions=256), UnsupportedParameter, "dimensions"),
    ("user not a string", body(user=5), InvalidRequest, "user"),
    ("missing model", without(body(), "model"), InvalidRequest, "model"),
    ("empty model", body(model=""), InvalidRequest, "model"),
    ("model not a string", body(model=["embed"]), InvalidRequest, "model"),
    ("unknown key", body(stream=True), InvalidRequest, "stream"),
]


@pytest.mark.parametrize(("data", "error", "param"), [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_bodies(data: dict[str, Any], error: type[ApiError], param: str) -> None:
    with pytest.raises(ApiError) as info:
        parse_embeddings(data)
    assert type(info.value) is error
    assert info.value.param == param
    assert info.value.status == 400


def test_unknown_keys_are_flagged_as_such() -> None:
    with pytest.raises(InvalidRequest) as info:
        parse_embeddings(body(temperature=0.5))
    assert info.value.code == "unknown_parameter"


def test_dimensions_error_is_the_unsupported_parameter_error() -> None:
    with pytest.raises(UnsupportedParameter) as info:
        parse_embeddings(body(dimensions=64))
    assert info.value.code == "unsupported_parameter"
    assert "dimensions" in info.value.message


def test_the_input_limit_is_configurable() -> None:
    assert parse_embeddings(body(input=["a", "b"]), max_inputs=2).inputs == ("a", "b")
    with pytest.raises(InvalidRequest, match="at most 2 inputs") as info:
        parse_embeddings(body(input=["a", "b", "c"]), max_inputs=2)
    assert info.value.param == "input"


def test_refusals_do_not_echo_the_input() -> None:
    secret = "s3cret-prompt-text"
    for data in (body(input=[secret, 1]), body(encoding_format=secret)):
        with pytest.raises(InvalidRequest) as info:
            parse_embeddings(data)
        assert secret not in info.value.message
