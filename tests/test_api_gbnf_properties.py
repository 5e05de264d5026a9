"""Property tests for JSON schemas to grammars: anything either is refused cleanly or parses in llama.cpp.

Random schemas (random nesting, keywords of the wrong type, sizes past the limits, names and
values from every Unicode category but lone surrogates, random quantifiers, huge numbers):
the converter raises `SchemaError` or returns a grammar that real llama.cpp parses, never
anything else. Random patterns over a small alphabet: the grammar takes exactly the strings
Python's `re` finds a match in (the features both share).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edgellmd.grammar.convert import schema_to_grammar
from edgellmd.grammar.rules import MAX_GRAMMAR_BYTES, json_string
from edgellmd.grammar.schema import SchemaError, json_text
from tests.bench_grammar_limits import ByteVocab, byte_vocab

# Daemons, engine processes or many seconds: left out of ./dev test --quick.
pytestmark = pytest.mark.slow

PROPERTY = settings(
    max_examples=150,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@pytest.fixture(scope="module")
def vocab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ByteVocab]:
    with byte_vocab(tmp_path_factory.mktemp("gbnf-properties")) as v:
        yield v


# Every Unicode category but Cs (lone surrogates), and the characters that need escaping.
TEXT = st.text(st.characters(blacklist_categories=["Cs"]), max_size=10) | st.text(
    st.sampled_from('"\\\x00\x01\x1f\x7f\n\t\u2028/~#[]-^:= '), max_size=6
)
HUGE = (
    st.integers(-(10**30), 10**30)
    | st.integers(10**300, 10**400)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.sampled_from([0, 1, -1, 999, 1_000, 1_001, 2_000, 2_001, 20_000, 10**20, 10**21, 1.5, -0.0])
)
COUNT = st.integers(0, 1_100) | HUGE | st.booleans() | st.none() | st.text(max_size=3)
SCALAR = st.none() | st.booleans() | st.integers(-(2**80), 2**80) | st.floats() | TEXT
JSON = st.recursive(
    SCALAR,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TEXT, inner, max_size=4),
    max_leaves=12,
)
FINITE = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | TEXT,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3),
    max_leaves=8,
)
GARBAGE = st.integers() | st.text(max_size=4) | st.none() | st.lists(st.integers(), max_size=2)
TYPES = st.sampled_from(["object", "array", "string", "number", "integer", "boolean", "null"])
TYPE = TYPES | st.lists(TYPES, max_size=4) | GARBAGE
TOKENS = st.sampled_from(
    [
        "a",
        "b",
        "\\d",
        "\\w",
        "\\s",
        "\\D",
        ".",
        "[a-z]",
        "[^x]",
        "[\\]-]",
        "(",
        ")",
        "(?:",
        "|",
        "*",
        "+",
        "?",
        "??",
        "{2}",
        "{1,3}",
        "{0,}",
        "{1000}",
        "{1001}",
        "{0,999999}",
        "{",
        "}",
        "^",
        "$",
        "\\",
        "\\1",
        "(?=",
        "(?<n>",
        "[",
        "]",
        "\\u0041",
        "\\x4",
        "\\uD800",
        "\\p{L}",
        "\\b",
        "-",
        '"',
        "\\\\",
        "\\n",
        "é",
        "😀",
        "\x00",
        "\\u{10FFFF}",
        "[^]",
        "[]",
    ]
)
PATTERN = st.lists(TOKENS | st.characters(blacklist_categories=["Cs"]), max_size=14).map("".join)
FORMATS = (
    st.sampled_from(
        [
            "date",
            "time",
            "date-time",
            "duration",
            "uuid",
            "ipv4",
            "ipv6",
            "hostname",
            "email",
            "uri",
            "int32",
            "double",
            "bogus",
        ]
    )
    | GARBAGE
)


REFS = st.sampled_from(
    ["#", "#/$defs/a", "#/$defs/b", "#/$defs/a~1b", "#/$defs/~0", "#/definitions/a", "x", "#/a"]
)


def _schemas(garbage: bool) -> st.SearchStrategy[Any]:
    """Random schemas; with `garbage`, keywords often hold values of the wrong type."""
    junk = GARBAGE if garbage else st.nothing()
    kind = TYPE if garbage else TYPES | st.lists(TYPES, min_size=1, max_size=3, unique=True)
    count = COUNT if garbage else st.integers(0, 6) | st.sampled_from([1_000, 1_001])
    bound = HUGE | junk if garbage else st.integers(-(10**22), 10**22) | st.floats(-1e30, 1e30)
    base = st.one_of(
        st.booleans(),
        junk,
        st.just({}),
        st.fixed_dictionaries({"type": kind}),
        st.fixed_dictionaries(
            {"enum": st.lists(JSON if garbage else FINITE, min_size=not garbage, max_size=6) | junk},
            optional={"type": kind},
        ),
        st.fixed_dictionaries(
            {"const": JSON if garbage else FINITE},
            optional={"type": kind, "enum": st.lists(FINITE, min_size=1, max_size=3)},
        ),
        st.fixed_dictionaries(
            {"type": st.just("string")}, optional={"pattern": PATTERN | junk, "format": FORMATS}
        ),
        st.fixed_dictionaries(
            {"type": st.just("integer") | kind},
            optional=dict.fromkeys(("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"), bound),
        ),
        st.builds(lambda n: {"enum": list(range(n))}, st.integers(990, 1_010)),
        st.builds(
            lambda c, n: {"const": c * n}, st.characters(blacklist_categories=["Cs"]), st.integers(0, 130_000)
        ),
        st.fixed_dictionaries(
            {
                "title": TEXT | junk,
                "description": TEXT,
                "default": JSON,
                "examples": st.lists(JSON, max_size=2),
            }
        ),
    )

    def extend(inner: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
        props = st.dictionaries(TEXT, inner, max_size=5)
        return st.one_of(
            st.fixed_dictionaries(
                {"type": st.just("object") | kind},
                optional={
                    "properties": props | junk,
                    "required": st.lists(TEXT, max_size=3, unique=True) | junk,
                    "additionalProperties": st.booleans() | inner,
                },
            ),
            st.fixed_dictionaries(
                {"type": st.just("array") | kind},
                optional={"items": inner | junk, "minItems": count, "maxItems": count},
            ),
            st.fixed_dictionaries({"anyOf": st.lists(inner, min_size=not garbage, max_size=4) | junk}),
            st.fixed_dictionaries(
                {
                    "$defs": st.dictionaries(st.sampled_from(["a", "b", "a/b", "~"]), inner, max_size=3),
                    "$ref": REFS | junk,
                }
            ),
            st.builds(_nest, inner, st.integers(0, 14)),
        )

    return st.recursive(base, extend, max_leaves=20)


def _nest(schema: Any, levels: int) -> Any:
    for _ in range(levels):
        schema = {"type": "object", "properties": {"n": schema}, "required": ["n"]}
    return schema


def _convert(schema: Any) -> str | SchemaError:
    try:
        return schema_to_grammar(schema)
    except SchemaError as exc:  # any other exception fails the test
        return exc


def _converts_or_refuses(vocab: ByteVocab, schema: Any) -> None:
    grammar = _convert(schema)
    if isinstance(grammar, SchemaError):
        assert grammar.message
        assert grammar.keyword
        assert grammar.path.startswith("#")
        assert "Traceback" not in grammar.message
        return
    assert len(grammar) <= MAX_GRAMMAR_BYTES
    assert grammar.isascii()
    assert vocab.parses(grammar), grammar[:2_000]


@PROPERTY
@given(schema=_schemas(garbage=True))
def test_random_schemas_are_refused_or_parse_in_llama_cpp(vocab: ByteVocab, schema: Any) -> None:
    _converts_or_refuses(vocab, schema)


@PROPERTY
@given(schema=_schemas(garbage=False))
def test_random_well_typed_schemas_are_refused_or_parse_in_llama_cpp(vocab: ByteVocab, schema: Any) -> None:
    _converts_or_refuses(vocab, schema)


@settings(PROPERTY, max_examples=300)
@given(pattern=PATTERN)
def test_random_patterns_are_refused_or_parse_in_llama_cpp(vocab: ByteVocab, pattern: str) -> None:
    _converts_or_refuses(vocab, {"type": "string", "pattern": pattern})


@PROPERTY
@given(values=st.lists(FINITE, min_size=1, max_size=8))
def test_enum_values_are_written_as_json_that_reads_back(vocab: ByteVocab, values: list[Any]) -> None:
    grammar = schema_to_grammar({"enum": values})
    assert vocab.parses(grammar)
    for value in values:
        text = json_text(value, 10**6)
        assert vocab.matches(grammar, text), text
        assert _same(json.loads(text), value)


def _same(a: Any, b: Any) -> bool:
    """JSON equality: numbers by value (1 == 1.0), no bool/number mixing."""
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, int | float) and isinstance(b, int | float):
        return a == b or (math.isclose(a, b) and isinstance(b, float))
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    return bool(a == b)


@PROPERTY
@given(names=st.lists(TEXT, min_size=1, max_size=6, unique=True), extra=st.booleans())
def test_any_property_names_are_written_and_read_back(
    vocab: ByteVocab, names: list[str], extra: bool
) -> None:
    schema = {
        "type": "object",
        "properties": {n: {"type": "integer"} for n in names},
        "required": names,
        "additionalProperties": extra,
    }
    grammar = schema_to_grammar(schema)
    document = "{" + ",".join(f"{json_string(n)}:{i}" for i, n in enumerate(names)) + "}"
    assert vocab.matches(grammar, document)
    assert json.loads(document) == {n: i for i, n in enumerate(names)}


# Patterns over features Python's `re` shares with ECMA-262 on this alphabet (no newline: Python's
# `$` also matches before a final one; no \r: Python's `.` takes it).
ALPHABET = "ab1 -_"
ATOMS = st.sampled_from(
    [
        "a",
        "b",
        "1",
        " ",
        "-",
        "_",
        ".",
        "\\d",
        "\\w",
        "\\s",
        "\\D",
        "\\W",
        "\\S",
        "[ab]",
        "[^a]",
        "[a-b1]",
        "[-a]",
        "\\-",
        "[\\d_]",
    ]
)
QUANTIFIERS = st.sampled_from(["", "", "*", "+", "?", "{2}", "{0,2}", "{1,}", "{1,3}", "*?", "+?", "??"])


def _regexes() -> st.SearchStrategy[str]:
    def extend(inner: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
        return st.one_of(
            st.lists(inner, min_size=2, max_size=3).map("".join),
            st.lists(inner, min_size=2, max_size=3).map(lambda parts: "(" + "|".join(parts) + ")"),
            st.tuples(inner, QUANTIFIERS).map(lambda t: f"(?:{t[0]}){t[1]}"),
            st.builds(lambda r: f"({r})", inner),
        )

    atom = st.tuples(ATOMS, QUANTIFIERS).map("".join)
    body = st.recursive(atom, extend, max_leaves=6)
    return st.tuples(st.booleans(), body, st.booleans()).map(
        lambda t: ("^" if t[0] else "") + t[1] + ("$" if t[2] else "")
    )


@PROPERTY
@given(pattern=_regexes(), samples=st.lists(st.text(ALPHABET, max_size=7), min_size=1, max_size=12))
def test_patterns_match_what_python_matches(vocab: ByteVocab, pattern: str, samples: list[str]) -> None:
    grammar = _convert({"type": "string", "pattern": pattern})
    if isinstance(grammar, SchemaError):
        assert grammar.limit is not None, grammar.message  # only a limit may refuse these
        return
    compiled = re.compile(pattern)
    for text in [*samples, "", "ab", "a1 -_b"]:
        assert vocab.matches(grammar, json_string(text)) == bool(compiled.search(text)), (pattern, text)
