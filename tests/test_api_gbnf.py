"""JSON schemas to llama.cpp grammars (edgellmd.grammar): checks, limits, and real llama.cpp.

Every grammar accepted here is handed to llama.cpp's own parser (`llama_sampler_init_grammar`
on a tiny test model's vocabulary, one token per byte) and driven byte by byte with
`llama_sampler_apply`/`llama_sampler_accept`: documents that validate are taken whole, others
refused.
"""

from __future__ import annotations

import datetime
import ipaddress
import json
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from edgellmd.grammar import regex as grammar_regex
from edgellmd.grammar import rules as grammar_rules
from edgellmd.grammar import schema as grammar_schema
from edgellmd.grammar.convert import embedded_grammar, schema_to_grammar
from edgellmd.grammar.rules import Grammar, GrammarLimitError, Lit, Ref, Rep, gbnf_literal, json_string
from edgellmd.grammar.schema import SchemaError, check_schema, json_text
from tests.bench_grammar_limits import ByteVocab, byte_vocab


@pytest.fixture(scope="module")
def vocab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ByteVocab]:
    with byte_vocab(tmp_path_factory.mktemp("gbnf")) as v:
        yield v


def refused(schema: Any) -> SchemaError:
    with pytest.raises(SchemaError) as caught:
        schema_to_grammar(schema)
    return caught.value


def outside_literals(grammar: str) -> str:
    """The grammar text with literals and classes blanked (to look at its structure)."""
    out, i = [], 0
    while i < len(grammar):
        c = grammar[i]
        if c in '"[':
            close = '"' if c == '"' else "]"
            i += 1
            while grammar[i] != close:
                i += 2 if grammar[i] == "\\" else 1
        else:
            out.append(c)
        i += 1
    return "".join(out)


def check_documents(vocab: ByteVocab, schema: Any, good: list[str], bad: list[str]) -> str:
    grammar = schema_to_grammar(schema)
    assert vocab.parses(grammar), grammar
    assert "(" not in outside_literals(grammar)  # MAX_GRAMMAR_NESTING: no group is ever written
    for text in good:
        assert vocab.matches(grammar, text), (text, grammar)
    for text in bad:
        assert not vocab.matches(grammar, text), (text, grammar)
    return grammar


# ---- schemas the converter supports: llama.cpp parses them, takes valid documents, refuses others


PERSON: Any = {  # what the openai client sends for a pydantic model (strict)
    "type": "object",
    "title": "Person",
    "additionalProperties": False,
    "properties": {
        "name": {"enum": ["ada", "bob"], "type": "string", "title": "Name"},
        "age": {"type": "integer", "title": "Age"},
        "role": {"anyOf": [{"enum": ["admin", "user"], "type": "string"}, {"type": "null"}], "title": "Role"},
    },
    "required": ["name", "age", "role"],
}
TREE: Any = {
    "$defs": {
        "node": {
            "type": "object",
            "properties": {
                "v": {"type": "integer"},
                "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 3},
            },
            "required": ["v", "kids"],
            "additionalProperties": False,
        }
    },
    "$ref": "#/$defs/node",
}

GOOD: list[tuple[str, Any, list[str], list[str]]] = [
    (
        "any-object",
        {"type": "object"},
        ["{}", '{"a": 1}', '{"a":[1,{"b":null}],"c":"x"}', "{ }"],
        ["[]", "1", '{"a"}', '{"a":1,}', " {}"],
    ),
    (
        "person",
        PERSON,
        ['{"name":"ada","age":36,"role":null}', '{ "name" : "bob" ,\n  "age":-1, "role":"user"}'],
        [
            '{"name":"eve","age":1,"role":null}',
            '{"name":"ada","age":1}',
            '{"age":1,"name":"ada","role":null}',
            '{"name":"ada","age":1.5,"role":null}',
            '{"name":"ada","age":1,"role":null,"x":1}',
        ],
    ),
    (
        "optional-in-order",
        {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "string"}, "c": {"type": "boolean"}},
            "required": ["b"],
        },
        ['{"b":"x"}', '{"a":1,"b":"x"}', '{"a":1,"b":"x","c":true}', '{"b":"x","c":false}'],
        ["{}", '{"a":1}', '{"b":"x","a":1}', '{"b":"x","b":"y"}', '{"b":"x","d":1}', '{,"b":"x"}'],
    ),
    (
        "all-optional",
        {"type": "object", "properties": {"a": {"type": "null"}, "b": {"type": "null"}}},
        ["{}", '{"a":null}', '{"b":null}', '{"a":null,"b":null}'],
        ['{"b":null,"a":null}', '{"a":null,}'],
    ),
    (
        "extras-true",
        {"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": True},
        ['{"a":1,"zz":[1]}', '{"ab":{}}', '{"":1}', '{"a":1,"b":2,"c":3}', '{"ax":1}'],
        ['{"a":1,"a":2}', '{"a":"x"}', '{"a":1,"zz":}'],
    ),
    (
        "extras-schema",
        {
            "type": "object",
            "properties": {"id": {"type": "integer"}},
            "required": ["id"],
            "additionalProperties": {"type": "string"},
        },
        ['{"id":1}', '{"id":1,"x":"y"}', '{"id":1,"i":"y","idx":"z"}'],
        ['{"id":1,"x":2}', '{"x":"y"}'],
    ),
    (
        "only-extras",
        {"type": "object", "additionalProperties": {"type": "integer"}},
        ["{}", '{"a":1,"a":2}'],
        ['{"a":"x"}'],
    ),
    (
        "required-undeclared",
        {"type": "object", "required": ["x"]},
        ['{"x":1}', '{"x":{"y":[]}}'],
        ["{}", '{"y":1}'],
    ),
    (
        "no-extras-declared-empty",
        {"type": "object", "properties": {}, "additionalProperties": False},
        ["{}"],
        ['{"a":1}'],
    ),
    (
        "array-bounds",
        {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 3},
        ["[1,2]", "[1, 2, 3]", "[ 1 ,2 ]"],
        ["[]", "[1]", "[1,2,3,4]", '[1,"a"]'],
    ),
    ("array-any", {"type": "array"}, ["[]", '[1,"a",null,[{}]]'], ["[1,]", "{}"]),
    ("array-at-most-one", {"type": "array", "maxItems": 1}, ["[]", "[true]"], ["[1,2]"]),
    ("array-false-items", {"type": "array", "items": False}, ["[]"], ["[1]"]),
    (
        "string",
        {"type": "string"},
        ['""', '"a\\"b"', '"\\u00e9\\n\\/"', '"é😀"'],
        ['"\n"', '"\\x41"', '"a', "'a'", '"\\u12"'],
    ),
    (
        "integer",
        {"type": "integer"},
        ["0", "-7", "1234567890123456"],
        ["01", "-0x", "1.0", "12345678901234567"],
    ),
    (
        "number",
        {"type": "number"},
        ["0", "-1.5e10", "0.25", "1E+2", "3e-07"],
        ["01", "1.", ".5", "1e999", "NaN", "-"],
    ),
    ("literals", {"type": ["boolean", "null"]}, ["true", "false", "null"], ["True", "nul", "0"]),
    (
        "type-list",
        {"type": ["string", "integer"], "pattern": "^a$", "minimum": 3},
        ['"a"', "3", "4000"],
        ['"b"', "2", "null"],
    ),
    (
        "implied-types",
        {"properties": {"a": {"type": "integer"}}, "required": ["a"], "pattern": "^x$"},
        ['{"a":1}', '"x"'],
        ["1", '"y"', "null"],
    ),
    ("anything", {}, ["1", '"x"', "[{}]", "null"], ["", "{"]),
    ("true", True, ["1", '{"a":[]}'], ["x"]),
    (
        "enum-mixed",
        {"enum": ["a", "ab", 1, 12, None, True, {"k": [1, 2]}, [], 1.5]},
        ['"a"', '"ab"', "1", "12", "null", "true", '{"k":[1,2]}', "[]", "1.5"],
        ['"b"', "2", "false", '{"k":[2,1]}', '"a b"'],
    ),
    ("const-object", {"const": {"a": [None, 2.0]}}, ['{"a":[null,2]}'], ['{"a":[null,2.5]}', "{}"]),
    ("enum-typed", {"type": "string", "enum": ["a", 1, None]}, ['"a"'], ["1", "null"]),
    ("enum-number-takes-integers", {"type": "number", "enum": [1, 2.5, "x"]}, ["1", "2.5"], ['"x"']),
    ("enum-and-const", {"enum": ["a", "b"], "const": "b"}, ['"b"'], ['"a"']),
    (
        "any-of",
        {"anyOf": [{"type": "string"}, {"type": "integer", "minimum": 0}]},
        ['"x"', "0", "7"],
        ["-1", "null"],
    ),
    (
        "any-of-objects",
        {
            "anyOf": [
                {
                    "type": "object",
                    "properties": {"kind": {"const": "a"}, "x": {"type": "integer"}},
                    "required": ["kind", "x"],
                    "additionalProperties": False,
                },
                {
                    "type": "object",
                    "properties": {"kind": {"const": "b"}, "y": {"type": "string"}},
                    "required": ["kind", "y"],
                    "additionalProperties": False,
                },
            ]
        },
        ['{"kind":"a","x":1}', '{"kind":"b","y":"s"}'],
        ['{"kind":"a","y":"s"}', '{"kind":"c","x":1}'],
    ),
    ("any-of-false-branch", {"anyOf": [False, {"type": "null"}]}, ["null"], ["1"]),
    (
        "tree",
        TREE,
        ['{"v":1,"kids":[]}', '{"v":1,"kids":[{"v":2,"kids":[{"v":3,"kids":[]}]}]}'],
        ['{"v":1}', '{"v":1,"kids":[{"v":2}]}'],
    ),
    (
        "root-recursion",
        {"type": "array", "items": {"$ref": "#"}, "maxItems": 2},
        ["[]", "[[],[[]]]"],
        ["[1]", "[[],[],[]]"],
    ),
    (
        "definitions",
        {
            "definitions": {"n": {"type": "null"}},
            "type": "object",
            "properties": {"a": {"$ref": "#/definitions/n"}},
            "required": ["a"],
        },
        ['{"a":null}'],
        ['{"a":1}'],
    ),
    (
        "ref-escaped-name",
        {"$defs": {"a/b~c": {"type": "boolean"}}, "$ref": "#/$defs/a~1b~0c"},
        ["true"],
        ["1"],
    ),
    (
        "false-def-is-never",
        {
            "$defs": {"no": False},
            "type": "object",
            "properties": {"a": {"$ref": "#/$defs/no"}, "b": {"type": "null"}},
        },
        ["{}", '{"b":null}'],
        ['{"a":1}'],
    ),
    (
        "annotations",
        {
            "type": "string",
            "title": "t",
            "description": "d",
            "$comment": "c",
            "examples": ["x"],
            "default": {"deep": [[[]]]},
            "$schema": "https://json-schema.org/draft/2020-12/schema",
            "$id": "x",
            "strict": True,
        },
        ['"x"'],
        ["1"],
    ),
    (
        "numbers-not-enforced",
        {"type": "number", "minimum": 0, "maximum": 1, "multipleOf": 0.5, "format": "double"},
        ["7.25", "-3"],
        ['"1"'],
    ),
    ("string-formats-ignored-off-strings", {"type": "integer", "format": "date"}, ["5"], ['"2020-01-01"']),
]


@pytest.mark.parametrize(("schema", "good", "bad"), [pytest.param(s, g, b, id=i) for i, s, g, b in GOOD])
def test_supported_schemas_parse_in_llama_cpp_and_match_their_documents(
    vocab: ByteVocab, schema: Any, good: list[str], bad: list[str]
) -> None:
    check_documents(vocab, schema, good, bad)


def test_documents_that_match_also_validate_as_python_reads_them(vocab: ByteVocab) -> None:
    # The accepted spellings decode to values of the schema (a few checked by hand).
    grammar = schema_to_grammar(PERSON)
    text = '{"name":"ada","age":36,"role":"admin"}'
    assert vocab.matches(grammar, text)
    assert json.loads(text) == {"name": "ada", "age": 36, "role": "admin"}


@pytest.mark.parametrize(
    ("lo", "hi"),
    [
        (-5, 5),
        (0, 0),
        (7, 7),
        (10, 99),
        (1, 1000),
        (-1000, -10),
        (95, 105),
        (123, 4567),
        (-99999, 3),
        (2**63 - 5, 2**63 + 5),
        (-(10**20) + 1, -(10**20) + 3),
    ],
)
def test_integer_bounds_are_exact(vocab: ByteVocab, lo: int, hi: int) -> None:
    grammar = schema_to_grammar({"type": "integer", "minimum": lo, "maximum": hi})
    assert vocab.parses(grammar)
    for value in {lo - 1, lo, lo + 1, hi - 1, hi, hi + 1, (lo + hi) // 2, 0, -1, 1, 10, 100}:
        assert vocab.matches(grammar, str(value)) == (lo <= value <= hi), value
    assert not vocab.matches(grammar, "-0")
    assert not vocab.matches(grammar, "0" + str(abs(hi)))


@pytest.mark.parametrize(
    ("schema", "inside", "outside"),
    [
        ({"type": "integer", "minimum": 10}, [10, 11, 10**15], [9, 0, -10]),
        ({"type": "integer", "maximum": -3}, [-3, -4, -(10**15)], [-2, 0, 5]),
        ({"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10}, [1, 9], [0, 10]),
        ({"type": "integer", "minimum": 1.5, "maximum": 3.5}, [2, 3], [1, 4]),
        ({"type": "integer", "exclusiveMinimum": 1.5}, [2], [1]),
        ({"type": "integer", "minimum": 10**17}, [10**17, 10**19], [10**17 - 1]),
        ({"type": "integer", "minimum": -1e300, "maximum": 5}, [5, -(10**15)], [6]),
    ],
)
def test_one_sided_and_fractional_integer_bounds(
    vocab: ByteVocab, schema: Any, inside: list[int], outside: list[int]
) -> None:
    check_documents(vocab, schema, [str(v) for v in inside], [str(v) for v in outside])


# ---- every JSON string can be a name, an enum value or a const --------------------------------


AWKWARD = [
    "plain",
    'with "quotes"',
    "back\\slash",
    "nul\x00byte",
    "".join(map(chr, range(32))) + "\x7f",
    "tab\tnl\nret\r",
    "uni é ü 日本",
    "emoji 😀 \U0010ffff",
    "sep\u2028\u2029",
    "bidi\u202e",
    "",
    " ",
    "\\u0000",
    '"',
    "\\",
    "'",
    '\\"',
    "lone \ud800 surrogate",
    "\udfff",
    "[]-^",
    "#comment",
    "::=",
    "\ufeff",
    "\x85",
]


@pytest.mark.parametrize("text", AWKWARD, ids=[ascii(t)[:30] for t in AWKWARD])
def test_names_enum_and_const_strings_are_escaped(vocab: ByteVocab, text: str) -> None:
    schema = {
        "type": "object",
        "properties": {text: {"const": text}, "e": {"enum": [text, text + "x"]}},
        "required": [text, "e"],
        "additionalProperties": False,
    }
    grammar = schema_to_grammar(schema)
    assert grammar.isascii()
    assert vocab.parses(grammar)
    for other in (text, text + "x"):
        document = "{" + json_string(text) + ":" + json_string(text) + ',"e":' + json_string(other) + "}"
        assert vocab.matches(grammar, document)
        assert json.loads(document) == {text: text, "e": other}
    assert not vocab.matches(grammar, "{" + json_string(text) + ":" + json_string(text + "y") + ',"e":"x"}')


@pytest.mark.parametrize("text", AWKWARD, ids=[ascii(t)[:30] for t in AWKWARD])
def test_extra_keys_never_repeat_a_declared_name(vocab: ByteVocab, text: str) -> None:
    schema = {"type": "object", "properties": {text: {"type": "integer"}}, "additionalProperties": True}
    grammar = schema_to_grammar(schema)
    assert vocab.parses(grammar)
    key = json_string(text)
    assert vocab.matches(grammar, "{" + key + ":1}")
    assert vocab.matches(grammar, "{" + json_string(text + "x") + ':"v"}')
    assert not vocab.matches(grammar, "{" + key + ':"v"}')  # the declared name, through the extras
    if len(text) > 1:
        assert vocab.matches(grammar, "{" + json_string(text[:-1]) + ':"v"}')


def test_json_strings_round_trip_and_gbnf_literals_are_ascii() -> None:
    for text in AWKWARD:
        assert json.loads(json_string(text)) == text
        assert gbnf_literal(text).isascii()


def test_json_values_of_any_depth_need_no_recursion() -> None:
    deep: Any = []
    for _ in range(100_000):
        deep = [deep]
    assert json_text(deep, 10**6) == "[" * 100_001 + "]" * 100_001
    error = refused({"const": deep})
    assert error.keyword == "const"
    assert "120,000" in error.message
    nested: Any = {"type": "null"}
    for _ in range(100_000):
        nested = {"anyOf": [nested]}
    assert "nests subschemas more than 64 deep" in refused(nested).message
    props: Any = {"type": "null"}
    for _ in range(100_000):
        props = {"type": "object", "properties": {"a": props}}
    assert refused(props).limit == grammar_schema.MAX_NESTING


# ---- patterns ---------------------------------------------------------------------------------


PATTERNS: list[tuple[str, list[str], list[str]]] = [
    ("^abc$", ["abc"], ["ab", "abcd", "xabc"]),
    ("abc", ["abc", "xxabcxx"], ["ab", "acb"]),
    ("^a|b$", ["a", "axx", "xb", "b"], ["xa", "bx"]),
    ("^ab$|^cd$", ["ab", "cd"], ["abcd", "c"]),
    ("^[a-c]+$", ["a", "abcba"], ["", "d", "ab1"]),
    ("^[^a-c]$", ["d", "\n", '"', "\\", "é", "😀", "\x00", "\x7f"], ["a", "b", ""]),
    ("^.$", ["a", '"', "\\", "\t", "\x01", "😀", "\x7f"], ["\n", "\r", "\u2028", "\u2029", "", "ab"]),
    ("^\\d{3}$", ["123"], ["12", "1234", "١٢٣"]),
    ("^\\w+$", ["a_Z9"], ["a-b", "é"]),
    ("^\\s$", [" ", "\t", "\n", "\u00a0", "\u3000", "\ufeff", "\v"], ["a", "", "\x1c"]),
    ("^\\D\\W\\S$", ["a-b"], ["1-b", "a_b", "a- "]),
    ("^\\n\\t\\r\\f\\v\\0$", ["\n\t\r\f\v\x00"], ["\n\t\r\f\v0"]),
    ("^\\x41\\u00e9\\u{1F600}\\uD83D\\uDE00$", ["Aé😀😀"], ["Ae😀😀"]),
    ("^\\cJ\\cj$", ["\n\n"], ["cJcj"]),
    ("^\\.\\*\\+\\?\\(\\)\\[\\]\\{\\}\\|\\/\\-\\\\\\^\\$$", [".*+?()[]{}|/-\\^$"], ["a"]),
    ("^(ab|cd)+$", ["ab", "cdab"], ["", "abc", "a"]),
    ("^(?:ab)?c$", ["c", "abc"], ["ab", "ababc"]),
    ("^a{2}$", ["aa"], ["a", "aaa"]),
    ("^a{2,}$", ["aa", "aaaaa"], ["a"]),
    ("^a{2,3}$", ["aa", "aaa"], ["a", "aaaa"]),
    ("^a{0,2}$", ["", "a", "aa"], ["aaa"]),
    ("^a+?b*?c??$", ["a", "aabbc"], ["b", "acc"]),
    ("^(a?)*$", ["", "a", "aaa"], ["b"]),
    ("^(a?b?)*c$", ["c", "abc", "babac", "bbc"], ["ca", "acc"]),
    ("^(a*|b)*$", ["", "aab", "bbb"], ["c"]),
    ("^(|a)+$", ["", "a", "aa"], ["b"]),
    ("^(a?){3,5}$", ["", "aaaaa"], ["aaaaaa"]),
    ("^(?:(a?)(b?)){2}$", ["", "ab", "abab", "ba"], ["aaa", "abba"]),
    ("^[a\\-z]$", ["a", "-", "z"], ["b"]),
    ("^[-a][a-]$", ["--", "aa", "-a"], ["b-"]),
    ("^[\\]]$", ["]"], ["\\"]),
    ("^[\\b]$", ["\b"], ["b"]),
    ("^[^]$", ["\n", "a"], ["", "ab"]),
    ("^x(?:y|z){2}$", ["xyz", "xzz"], ["xy"]),
    ("", ["", "anything"], []),
    ("^$", [""], ["a"]),
    ('^"\\\\$', ['"\\'], ['"']),
    ("^[\\u0000-\\u001f]$", ["\x00", "\x1f", "\n"], [" "]),
    ('^["\\\\]+$', ['"', "\\", '"\\"'], ["a"]),
    ("^\\{$", ["{"], ["}"]),
    ("^é+日$", ["é日", "éé日"], ["e日"]),
    ("^[\\s\\S]{2}", ["ab", "\n\nxyz"], ["a"]),
    ("^(([a-z])|([0-9]))+$", ["a1b2"], ["A"]),
]


@pytest.mark.parametrize(("pattern", "good", "bad"), PATTERNS, ids=[p[0] or "empty" for p in PATTERNS])
def test_pattern_features(vocab: ByteVocab, pattern: str, good: list[str], bad: list[str]) -> None:
    check_documents(
        vocab,
        {"type": "string", "pattern": pattern},
        [json_string(s) for s in good],
        [json_string(s) for s in bad],
    )


REFUSED_PATTERNS: list[tuple[str, str, bool]] = [
    ("(a)\\1", "back-references", True),
    ("(?=a)", "lookaround", True),
    ("(?!a)", "lookaround", True),
    ("(?<=a)b", "lookaround", True),
    ("(?<!a)b", "lookaround", True),
    ("(?<n>a)", "named groups", True),
    ("(?i)a", "'(?' forms", True),
    ("\\ba", "word-boundary", True),
    ("a\\B", "word-boundary", True),
    ("\\p{L}", "Unicode property", True),
    ("\\k<n>", "named back-references", True),
    ("\\01", "octal", True),
    ("a^b", "'^' is supported only", True),
    ("a$b", "'$' is supported only", True),
    ("(^a)", "'^' is supported only", True),
    ("(a$)", "'$' is supported only", True),
    ("(a", "unbalanced '('", False),
    ("a)", "unbalanced ')'", False),
    ("[a", "unbalanced '['", False),
    ("a]", "unbalanced ']'", False),
    ("a{", "'{' must start a quantifier", False),
    ("a{x}", "'{' must start a quantifier", False),
    ("a{,3}", "'{' must start a quantifier", False),
    ("a}", "unbalanced '}'", False),
    ("a**", "quantifier after a quantifier", False),
    ("a+*", "quantifier after a quantifier", False),
    ("*a", "nothing to repeat", False),
    ("a|*", "nothing to repeat", False),
    ("^*", "nothing to repeat", False),
    ("\\ud800", "lone surrogate", False),
    ("a\ud800", "lone surrogate", False),
    ("\\q", "unknown escape", False),
    ("[]", "empty class", False),
    ("[z-a]", "out of order", False),
    ("[\\d-z]", "class escape", False),
    ("a{5,2}", "n < m", False),
    ("\\", "lone '\\'", False),
    ("\\x4", "2 hex digits", False),
    ("\\u{110000}", "past U+10FFFF", False),
    ("\\u{}", "1 to 6 hex digits", False),
    ("\\c1", "control letter", False),
]


@pytest.mark.parametrize(
    ("pattern", "feature", "unsupported"), REFUSED_PATTERNS, ids=[ascii(p[0]) for p in REFUSED_PATTERNS]
)
def test_refused_pattern_features_are_named(pattern: str, feature: str, unsupported: bool) -> None:
    error = refused({"type": "object", "properties": {"code": {"type": "string", "pattern": pattern}}})
    assert (error.keyword, error.path, error.unsupported) == ("pattern", "#/properties/code", unsupported)
    assert error.message.startswith("'pattern' at #/properties/code ")
    assert feature in error.message
    assert "(at character " in error.message


def test_formats(vocab: ByteVocab) -> None:
    cases: dict[str, tuple[list[str], list[str]]] = {
        "date": (
            ["2024-02-29", "2000-02-29", "1900-02-28", "0004-02-29", "2023-12-31", "0001-01-01"],
            ["2023-02-29", "1900-02-29", "0000-01-01", "2023-13-01", "2023-04-31", "2023-1-01"],
        ),
        "time": (
            ["23:59:59Z", "00:00:00.123456+05:30", "12:00:00-00:00"],
            ["24:00:00Z", "12:00:00", "12:60:00Z", "12:00:00.1234567Z", "12:00:60Z"],
        ),
        "date-time": (
            ["2024-02-29T23:59:59Z", "1999-01-01T00:00:00.5+01:00"],
            ["2024-02-29 23:59:59Z", "2024-02-30T00:00:00Z"],
        ),
        "uuid": (
            ["123e4567-e89b-12d3-a456-426614174000", "123E4567-E89B-12D3-A456-426614174000"],
            ["123e4567e89b12d3a456426614174000", "123e4567-e89b-12d3-a456-42661417400g"],
        ),
        "ipv4": (
            ["0.0.0.0", "255.255.255.255", "192.168.1.10"],
            ["256.0.0.1", "01.2.3.4", "1.2.3", "1.2.3.4.5"],
        ),
        "ipv6": (
            ["::", "::1", "1::", "2001:db8::8a2e:370:7334", "1:2:3:4:5:6:7:8", "1:2:3:4:5:6:7::"],
            ["1:2:3:4:5:6:7:8:9", ":::", "12345::", "1::2::3", "g::"],
        ),
        "hostname": (["localhost", "a-b.example.com", "x1"], ["-a.com", "a-.com", "a..b", "a_b"]),
        "email": (["a.b+c@example.com", "x@y.io"], ["a@b", "@x.com", "a..b@x.com", "a@x.c"]),
        "uri": (
            ["https://example.com", "http://1.2.3.4:8080/a/b?c=d&e=%20#f"],
            ["ftp://x.com", "https://", "https://x.com/%zz"],
        ),
        "duration": (["P1D", "PT1H30M", "P1Y2M3DT4H5M6S", "P2W"], ["P", "PT", "P1H", "1D", "P1DT"]),
    }
    for fmt, (good, bad) in cases.items():
        check_documents(
            vocab,
            {"type": "string", "format": fmt},
            [json.dumps(s) for s in good],
            [json.dumps(s) for s in bad],
        )


def test_format_values_that_match_are_valid_for_python(vocab: ByteVocab) -> None:
    # Values written by walking the grammar's own alternatives, checked with the stdlib's parsers.
    grammar = schema_to_grammar({"type": "string", "format": "date-time"})
    for text in ("2024-02-29T23:59:59.5Z", "0001-01-01T00:00:00+23:59"):
        assert vocab.matches(grammar, json.dumps(text))
        datetime.datetime.fromisoformat(text)
    for text in ("::ffff:1:2", "1:2:3:4:5:6::"):
        assert vocab.matches(schema_to_grammar({"type": "string", "format": "ipv6"}), json.dumps(text))
        ipaddress.IPv6Address(text)
    uuid.UUID("123e4567-e89b-12d3-a456-426614174000")


# ---- schemas refused: the keyword, where, and why ---------------------------------------------


BAD: list[tuple[str, Any, str, str, str]] = [
    ("ref-not-string", {"$ref": 5}, "$ref", "#", "must be a string"),
    ("required-not-list", {"required": "x"}, "required", "#", "must be a list of distinct strings"),
    ("required-repeats", {"required": ["a", "a"]}, "required", "#", "distinct"),
    ("properties-list", {"properties": []}, "properties", "#", "must be an object of schemas"),
    (
        "property-not-schema",
        {"properties": {"a": 5}},
        "properties",
        "#/properties/a",
        "must be a JSON schema",
    ),
    ("enum-not-list", {"enum": 3}, "enum", "#", "non-empty list"),
    ("enum-empty", {"enum": []}, "enum", "#", "non-empty list"),
    ("enum-nan", {"enum": [1, float("nan")]}, "enum", "#/enum/1", "not finite"),
    ("const-inf", {"const": {"a": [1, float("inf")]}}, "const", "#", "not finite"),
    ("const-not-json", {"const": {1: 2}}, "const", "#", "not a JSON value"),
    ("min-items-string", {"minItems": "2"}, "minItems", "#", "non-negative integer"),
    ("min-items-negative", {"minItems": -1}, "minItems", "#", "non-negative integer"),
    ("min-items-fraction", {"minItems": 1.5}, "minItems", "#", "non-negative integer"),
    ("max-items-bool", {"maxItems": True}, "maxItems", "#", "non-negative integer"),
    ("min-over-max", {"minItems": 3, "maxItems": 2}, "minItems", "#", "greater than 'maxItems'"),
    ("type-unknown", {"type": "strnig"}, "type", "#", "must be one of"),
    ("type-empty", {"type": []}, "type", "#", "must be one of"),
    ("type-repeats", {"type": ["string", "string"]}, "type", "#", "distinct"),
    ("type-number", {"type": 5}, "type", "#", "must be one of"),
    ("type-unhashable", {"type": [["string"]]}, "type", "#", "must be one of"),
    ("items-tuple", {"items": [{"type": "string"}]}, "items", "#", "tuple validation"),
    ("items-string", {"items": "x"}, "items", "#", "must be a schema"),
    ("any-of-empty", {"anyOf": []}, "anyOf", "#", "non-empty list of schemas"),
    ("any-of-object", {"anyOf": {}}, "anyOf", "#", "non-empty list of schemas"),
    ("any-of-bad-branch", {"anyOf": [{"type": "x"}]}, "type", "#/anyOf/0", "must be one of"),
    ("ref-missing", {"$ref": "#/$defs/missing"}, "$ref", "#", "does not have"),
    ("ref-remote", {"$ref": "https://example.com/s"}, "$ref", "#", "local reference"),
    ("ref-deep-pointer", {"$ref": "#/properties/a"}, "$ref", "#", "local reference"),
    (
        "ref-with-type",
        {"$defs": {"a": {}}, "$ref": "#/$defs/a", "type": "string"},
        "$ref",
        "#",
        "cannot be combined with 'type'",
    ),
    ("any-of-with-type", {"anyOf": [{}], "type": "object"}, "anyOf", "#", "cannot be combined with 'type'"),
    ("enum-with-pattern", {"enum": ["a"], "pattern": "a"}, "enum", "#", "cannot be combined with 'pattern'"),
    ("pattern-with-format", {"pattern": "a", "format": "date"}, "pattern", "#", "'format'"),
    ("defs-not-at-root", {"properties": {"a": {"$defs": {}}}}, "$defs", "#/properties/a", "only at the root"),
    ("defs-list", {"$defs": []}, "$defs", "#", "must be an object of schemas"),
    ("pattern-number", {"pattern": 5}, "pattern", "#", "must be a string"),
    ("format-unknown", {"format": "email2"}, "format", "#", "'email2' is not supported"),
    ("format-number", {"format": 1}, "format", "#", "must be a string"),
    ("minimum-string", {"minimum": "3"}, "minimum", "#", "must be a number"),
    ("maximum-inf", {"maximum": float("inf")}, "maximum", "#", "must be a number"),
    ("exclusive-bool", {"exclusiveMinimum": True}, "exclusiveMinimum", "#", "must be a number"),
    ("multiple-of-zero", {"multipleOf": 0}, "multipleOf", "#", "positive number"),
    ("huge-integer-bound", {"type": "integer", "minimum": 10**400}, "minimum", "#", "at most 20 digits"),
    ("huge-count", {"maxItems": 10**400}, "maxItems", "#", "is over 1,000,000,000; the most"),
    ("title-number", {"title": 5}, "title", "#", "must be a string"),
    ("examples-object", {"examples": {}}, "examples", "#", "must be a list"),
    ("strict-string", {"strict": "yes"}, "strict", "#", "must be a boolean"),
    ("no-integer", {"type": "integer", "minimum": 5, "maximum": 4}, "minimum", "#", "leave no integer"),
    ("integer-too-long", {"type": "integer", "minimum": 1e25}, "minimum", "#", "at most 20 digits"),
    ("root-false", False, "schema", "#", "accepts no value"),
    ("root-never", {"type": "string", "enum": [1]}, "enum", "#", "has no value of the 'type' given"),
    ("root-never-through-any-of", {"anyOf": [False, {"anyOf": [False]}]}, "schema", "#", "accepts no value"),
    (
        "required-false",
        {"type": "object", "properties": {"a": False}, "required": ["a"]},
        "required",
        "#",
        "schema is false",
    ),
    (
        "required-forbidden",
        {"type": "object", "required": ["a"], "additionalProperties": False},
        "required",
        "#",
        "'additionalProperties' forbids",
    ),
    (
        "items-false-min",
        {"type": "array", "items": False, "minItems": 1},
        "minItems",
        "#",
        "'items' is false",
    ),
    (
        "ref-loop",
        {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
        "$ref",
        "#",
        "left recursion",
    ),
    (
        "ref-left-recursion",
        {"$defs": {"a": {"anyOf": [{"$ref": "#/$defs/a"}, {"type": "null"}]}}, "$ref": "#/$defs/a"},
        "$ref",
        "#",
        "refers back to itself",
    ),
    ("not-a-schema", "x", "schema", "#", "must be a JSON schema"),
    ("list-schema", [], "schema", "#", "must be a JSON schema"),
    (
        "long-name-shown-as-placeholder",
        {"properties": {"x" * 50: {"type": "strnig"}}},
        "type",
        "#/properties/<name>",
        "must be one of",
    ),
    (
        "unprintable-name",
        {"properties": {"a\nb": {"type": 1}}},
        "type",
        "#/properties/<name>",
        "must be one of",
    ),
    (
        "pointer-escapes",
        {"properties": {"a/b~": {"type": 1}}},
        "type",
        "#/properties/a~1b~0",
        "must be one of",
    ),
    (
        "nested-path",
        {"type": "object", "properties": {"a": {"type": "array", "items": {"maxItems": 20_000}}}},
        "maxItems",
        "#/properties/a/items",
        "the most this server allows is 1,000",
    ),
]


@pytest.mark.parametrize(
    ("schema", "keyword", "path", "fragment"), [pytest.param(s, k, p, f, id=i) for i, s, k, p, f in BAD]
)
def test_bad_schemas_name_the_keyword_and_where(schema: Any, keyword: str, path: str, fragment: str) -> None:
    error = refused(schema)
    assert (error.keyword, error.path) == (keyword, path), error.message
    assert fragment in error.message
    for leak in ("Traceback", "recursion depth", "Error", "strnig", "x" * 41, "\n", "object at 0x"):
        assert leak not in error.message


@pytest.mark.parametrize(
    "keyword",
    [
        "minLength",
        "allOf",
        "not",
        "oneOf",
        "patternProperties",
        "nullable",
        "uniqueItems",
        "prefixItems",
        "\x00evil" * 10,
    ],
)
def test_keywords_outside_the_subset_are_unsupported(keyword: str) -> None:
    error = refused({"type": "object", "properties": {"a": {keyword: 1}}})
    assert error.unsupported
    assert error.path == "#/properties/a"
    shown = keyword if keyword.isprintable() else "<name>"
    assert error.message == (
        f"JSON schema keyword {shown!r} (at #/properties/a) is not supported; the "
        "supported subset is OpenAI's structured-output subset"
    )


def test_the_reported_attacks_are_refused_before_any_grammar(vocab: ByteVocab) -> None:
    assert refused({"type": "array", "items": {"type": "integer"}, "maxItems": 20_000}).limit == 1_000
    assert refused({"type": "string", "pattern": "^a{0,20000}$"}).limit == 1_000
    wrong_types: list[Any] = [
        {"$ref": 5},
        {"required": "x"},
        {"properties": []},
        {"enum": 3},
        {"minItems": "2"},
    ]
    for schema in wrong_types:
        refused(schema)
    assert refused({"type": "string", "pattern": "(a)\\1"}).unsupported
    assert refused({"enum": list(range(20_000))}).limit == grammar_schema.MAX_ENUM_VALUES
    grammar = schema_to_grammar({"type": "array", "items": {"type": "integer"}, "maxItems": 1_000})
    assert vocab.parses(grammar)
    assert vocab.matches(grammar, "[" + ",".join(["1"] * 1_000) + "]")
    assert not vocab.matches(grammar, "[" + ",".join(["1"] * 1_001) + "]")


# ---- limits: exactly at the limit passes, one past fails --------------------------------------


def _object_of(n: int, name: str = "p") -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {f"{name}{i}": {"type": "null"} for i in range(n)},
        "required": [f"{name}{i}" for i in range(n)],
        "additionalProperties": False,
    }


def _nested(levels: int) -> Any:
    schema: Any = {"type": "null"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def _deep_any_of(depth: int) -> Any:
    schema: Any = {"type": "null"}
    for _ in range(depth):
        schema = {"anyOf": [schema]}
    return schema


def _patterns(depth: int) -> str:
    return "(" * depth + "a" + ")" * depth


def _distinct_firsts(n: int) -> list[str]:
    return [chr(0x4E00 + i) + str(i) for i in range(n)]


LIMITS: list[tuple[str, Any, Any, str, int]] = [
    (
        "max-items",
        {"type": "array", "maxItems": 1_000},
        {"type": "array", "maxItems": 1_001},
        "maxItems",
        grammar_rules.MAX_REPETITION,
    ),
    (
        "min-items",
        {"type": "array", "minItems": 1_000},
        {"type": "array", "minItems": 1_001},
        "minItems",
        grammar_rules.MAX_REPETITION,
    ),
    (
        "quantifier",
        {"pattern": "^a{1000}$"},
        {"pattern": "^a{1001}$"},
        "pattern",
        grammar_rules.MAX_REPETITION,
    ),
    (
        "quantifier-range",
        {"pattern": "^a{0,1000}$"},
        {"pattern": "^a{0,1001}$"},
        "pattern",
        grammar_rules.MAX_REPETITION,
    ),
    (
        "pattern-length",
        {"pattern": "a" * 1_000},
        {"pattern": "a" * 1_001},
        "pattern",
        grammar_regex.MAX_PATTERN_LENGTH,
    ),
    (
        "pattern-nesting",
        {"pattern": _patterns(16)},
        {"pattern": _patterns(17)},
        "pattern",
        grammar_regex.MAX_PATTERN_NESTING,
    ),
    ("nesting", _nested(10), _nested(11), "properties", grammar_schema.MAX_NESTING),
    (
        "properties",
        {"anyOf": [_object_of(2_500, "a"), _object_of(2_500, "b")]},
        {"anyOf": [_object_of(2_500, "a"), _object_of(2_501, "b")]},
        "properties",
        grammar_schema.MAX_OBJECT_PROPERTIES,
    ),
    (
        "enum-values",
        {
            "type": "array",
            "items": {"anyOf": [{"enum": [f"a{i}" for i in range(500)]}, {"enum": list(range(500))}]},
        },
        {
            "type": "array",
            "items": {"anyOf": [{"enum": [f"a{i}" for i in range(500)]}, {"enum": list(range(501))}]},
        },
        "enum",
        grammar_schema.MAX_ENUM_VALUES,
    ),
    (
        "characters",
        {"type": "object", "properties": {"n" * 60_000: {"const": "c" * 60_000}}},
        {"type": "object", "properties": {"n" * 60_000: {"const": "c" * 60_001}}},
        "properties",
        grammar_schema.MAX_SCHEMA_CHARS,
    ),
    (
        "large-enum",
        {"enum": [f"{i:03d}".ljust(59, "v") for i in range(251)] + ["v" * 191]},
        {"enum": [f"{i:03d}".ljust(59, "v") for i in range(251)] + ["v" * 192]},
        "enum",
        grammar_schema.MAX_LARGE_ENUM_CHARS,
    ),
    (
        "subschemas",
        {"anyOf": [{"type": "null"}] * (grammar_schema.MAX_SCHEMA_NODES - 1)},
        {"anyOf": [{"type": "null"}] * grammar_schema.MAX_SCHEMA_NODES},
        "anyOf",
        grammar_schema.MAX_SCHEMA_NODES,
    ),
    ("depth", _deep_any_of(64), _deep_any_of(65), "anyOf", grammar_schema.MAX_SCHEMA_DEPTH),
    (
        "choices",
        {"enum": _distinct_firsts(256)},
        {"enum": _distinct_firsts(257)},
        "enum",
        grammar_rules.MAX_GRAMMAR_CHOICES,
    ),
    (
        "pattern-states",
        {"pattern": "^(a|b){500}$"},
        {"pattern": "^(a|b){500}c$"},
        "pattern",
        grammar_rules.MAX_PATTERN_STATES,
    ),
    (
        "nested-repetitions-multiply",
        {"pattern": "^((a|aa){0,10}){0,33}$"},
        {"pattern": "^((a|aa){0,10}){0,34}$"},
        "pattern",
        grammar_rules.MAX_PATTERN_STATES,
    ),
    (
        "patterns-at-once",
        {"anyOf": [{"pattern": "^a{500}$"}, {"pattern": "^b{500}$"}]},
        {"anyOf": [{"pattern": "^a{500}$"}, {"pattern": "^b{501}$"}]},
        "pattern",
        grammar_rules.MAX_PATTERN_STATES,
    ),
]


@pytest.mark.parametrize(
    ("at_limit", "past_limit", "keyword", "limit"),
    [pytest.param(a, p, k, n, id=i) for i, a, p, k, n in LIMITS],
)
def test_limits(vocab: ByteVocab, at_limit: Any, past_limit: Any, keyword: str, limit: int) -> None:
    grammar = schema_to_grammar(at_limit)
    assert vocab.parses(grammar)
    error = refused(past_limit)
    assert (error.keyword, error.limit) == (keyword, limit), error.message
    assert f"the most this server allows is {limit:,}" in error.message


def test_large_enums_under_the_value_count_may_be_long() -> None:
    schema_to_grammar({"enum": ["v" * 400 + str(i) for i in range(250)]})  # 100,000 characters, 250 values


def test_grammar_bytes_limit(vocab: ByteVocab) -> None:
    base = len(schema_to_grammar({"const": ""}))
    wide, narrow = divmod(grammar_rules.MAX_GRAMMAR_BYTES - base, 10)  # a non-BMP character is \UXXXXXXXX
    text = "\U0001f600" * wide + "a" * narrow
    grammar = schema_to_grammar({"const": text})
    assert len(grammar) == grammar_rules.MAX_GRAMMAR_BYTES
    assert vocab.parses(grammar)
    error = refused({"const": text + "a"})
    assert (error.keyword, error.path, error.limit) == ("schema", "#", grammar_rules.MAX_GRAMMAR_BYTES)
    assert "1,000,001 bytes" in error.message


def test_grammar_rules_limit_counts_llama_cpp_s_expansion(vocab: ByteVocab) -> None:
    def schema(n: int) -> Any:  # n distinct patterns of 998 optional repetitions: 998 rules each
        prefixes = [chr(0x61 + i % 26) + chr(0x61 + i // 26) for i in range(n)]
        return {"type": "object", "properties": {p: {"pattern": f"^{p}b{{0,998}}$"} for p in prefixes}}

    assert vocab.parses(schema_to_grammar(schema(45)))
    error = refused(schema(52))
    assert error.limit == grammar_rules.MAX_GRAMMAR_RULES
    assert "once repetitions are expanded" in error.message


def test_leftmost_chains_are_bounded(vocab: ByteVocab) -> None:
    def chain(n: int) -> Any:
        defs: dict[str, Any] = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}
        defs[f"d{n}"] = {"type": "null"}
        return {"$defs": defs, "$ref": "#/$defs/d0"}

    grammar = schema_to_grammar(chain(200))
    assert vocab.parses(grammar)
    assert vocab.matches(grammar, "null")
    error = refused(chain(300))
    assert (error.keyword, error.limit) == ("$ref", grammar_rules.MAX_GRAMMAR_DEPTH)


def test_grammar_elements_limit() -> None:
    g = Grammar()
    item = g.named([(Lit("x"), g.builtin("space"))], "item")
    g.render([(Rep(item, 1_000, 1_000),)])
    many = Grammar()
    refs = [many.named([(Lit(f"x{i}"),)], "item") for i in range(2_001)]
    with pytest.raises(GrammarLimitError) as caught:
        many.render([tuple(Rep(r, 1_000, 1_000) for r in refs)])
    assert caught.value.limit == grammar_rules.MAX_GRAMMAR_ELEMENTS
    assert isinstance(refs[0], Ref)


# ---- the tool-call wrapper: checked parts inside edgellm's own schema ------------------------


def _wrapper(parts: list[grammar_schema.CheckedSchema]) -> Any:
    calls = {
        "anyOf": [
            {
                "type": "object",
                "properties": {"name": {"const": f"f{i}"}, "arguments": part},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for i, part in enumerate(parts)
        ]
    }
    return {
        "type": "object",
        "properties": {"tool_calls": {"type": "array", "items": calls, "minItems": 1, "maxItems": 8}},
        "required": ["tool_calls"],
        "additionalProperties": False,
    }


def test_wrapper_nesting_does_not_count_against_the_parts(vocab: ByteVocab) -> None:
    deepest = check_schema(_nested(10), "tools[0].function.parameters")
    grammar = embedded_grammar(_wrapper([deepest]))
    assert vocab.parses(grammar)
    inner = '{"a":' * 10 + "null" + "}" * 10
    assert vocab.matches(grammar, '{"tool_calls":[{"name":"f0","arguments":' + inner + "}]}")


def test_parts_add_up_against_the_limits() -> None:
    parts = [check_schema(_object_of(40), f"tools[{i}].function.parameters") for i in range(128)]
    with pytest.raises(SchemaError) as caught:
        embedded_grammar(_wrapper(parts))
    assert caught.value.limit == grammar_schema.MAX_OBJECT_PROPERTIES
    assert "5,120 object properties" in caught.value.message


def test_128_tools_stay_within_the_grammar_bounds(vocab: ByteVocab) -> None:
    kinds = {"type": ["string", "integer", "null"]}
    parts = [
        check_schema(
            {
                "type": "object",
                "properties": {f"t{i}_arg{j}": kinds for j in range(39)},
                "additionalProperties": False,
            },
            f"tools[{i}].function.parameters",
        )
        for i in range(128)
    ]
    grammar = embedded_grammar(_wrapper(parts))
    assert vocab.parses(grammar)
    assert vocab.matches(grammar, '{"tool_calls":[{"name":"f127","arguments":{"t127_arg3":1}}]}')
    assert not vocab.matches(grammar, '{"tool_calls":[{"name":"f128","arguments":{}}]}')


def test_errors_in_parts_carry_their_label() -> None:
    with pytest.raises(SchemaError) as caught:
        check_schema(
            {"type": "object", "properties": {"a": {"maxItems": 5_000}}}, "tools[3].function.parameters"
        )
    assert caught.value.path == "tools[3].function.parameters#/properties/a"
    error = refused(check_schema({"enum": _distinct_firsts(300)}, "tools[3].function.parameters"))
    assert error.path == "tools[3].function.parameters#"
