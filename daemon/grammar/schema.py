"""JSON schemas (OpenAI's structured-output subset) checked in full before any grammar exists.

`check_schema` validates every keyword of a client's schema and its limits; errors are
`SchemaError`s: a client-safe message naming the keyword, where it is and the limit. What a
checked schema turns into is `grammar.convert`'s business.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final

from edgellmd.grammar.regex import PatternError, parse_pattern
from edgellmd.grammar.rules import (
    MAX_REPETITION,
    json_string,
)

# OpenAI's structured-output subset: types, and the keywords it documents per type.
SCHEMA_TYPES: Final = frozenset({"object", "array", "string", "number", "integer", "boolean", "null"})
ANNOTATIONS: Final = frozenset(
    {"title", "description", "$schema", "$id", "$comment", "examples", "default", "strict"}
)
SCHEMA_KEYWORDS: Final = frozenset(
    {
        "type",
        "properties",
        "required",
        "additionalProperties",
        "items",
        "enum",
        "const",
        "anyOf",
        "$ref",
        "$defs",
        "definitions",
        "pattern",
        "format",
        "minimum",
        "maximum",
        "exclusiveMinimum",
        "exclusiveMaximum",
        "multipleOf",
        "minItems",
        "maxItems",
        *ANNOTATIONS,
    }
)

# ---- limits -----------------------------------------------------------------------------------
# OpenAI's published structured-output limits (platform.openai.com, "Structured Outputs").
MAX_OBJECT_PROPERTIES: Final = 5_000  # `properties` entries in all
MAX_NESTING: Final = 10  # levels: each step into properties/items/additionalProperties is one
MAX_ENUM_VALUES: Final = 1_000  # `enum` values in all
MAX_SCHEMA_CHARS: Final = 120_000  # property and definition names, enum and const values together
LARGE_ENUM_VALUES: Final = 250  # an enum of more string values than this ...
MAX_LARGE_ENUM_CHARS: Final = 15_000  # ... may hold at most this many characters
# edgellm's own: bounds on the work a schema asks for (the grammar's bounds: grammar.rules and grammar.regex).
MAX_SCHEMA_NODES: Final = 20_000  # subschemas in all
MAX_SCHEMA_DEPTH: Final = 64  # subschemas inside subschemas, anyOf included
MAX_INTEGER_DIGITS: Final = 20  # of a bounded integer (uint64 fits); unbounded: 16, as JSON numbers go
INTEGER_DIGITS: Final = 16

STRING_FORMATS: Final = (
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
)
NUMBER_FORMATS: Final = ("int32", "int64", "float", "double")  # OpenAPI's; accepted, not enforced

_YEAR = r"(?:[1-9]\d{3}|0[1-9]\d{2}|00[1-9]\d|000[1-9])"  # 0001-9999, as datetime.date takes
_DATE = (
    rf"(?:{_YEAR}-(?:(?:0[13578]|1[02])-(?:0[1-9]|[12]\d|3[01])|(?:0[469]|11)-(?:0[1-9]|[12]\d|30)"
    r"|02-(?:0[1-9]|1\d|2[0-8]))|(?:\d\d(?:0[48]|[2468][048]|[13579][26])|(?:0[48]|[2468][048]|[13579][26])00)"
    r"-02-29)"
)  # days per month, and 29 February in leap years only
_TIME = r"(?:[01]\d|2[0-3]):[0-5]\d:[0-5]\d(?:\.\d{1,6})?(?:Z|[+-](?:[01]\d|2[0-3]):[0-5]\d)"
_DUR_TIME = r"T(?:\d{1,9}H(?:\d{1,9}M)?(?:\d{1,9}S)?|\d{1,9}M(?:\d{1,9}S)?|\d{1,9}S)"
_H16 = "[0-9a-fA-F]{1,4}"
_LABEL = "[A-Za-z0-9](?:[A-Za-z0-9-]{0,46}[A-Za-z0-9])?"  # five labels stay under 253 characters
_HOST = rf"{_LABEL}(?:\.{_LABEL}){{0,4}}"
_IPV4 = r"(?:(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)\.){3}(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)"
_PCHAR = r"(?:[A-Za-z0-9._~!$&'()*+,;=:@-]|%[0-9A-Fa-f]{2})"
FORMAT_PATTERNS: Final[Mapping[str, str]] = {
    "date": f"^{_DATE}$",
    "time": f"^{_TIME}$",
    "date-time": f"^{_DATE}T{_TIME}$",
    "duration": (
        rf"^P(?:(?:\d{{1,9}}Y(?:\d{{1,9}}M)?(?:\d{{1,9}}D)?|\d{{1,9}}M(?:\d{{1,9}}D)?|\d{{1,9}}D)"
        rf"(?:{_DUR_TIME})?|{_DUR_TIME}|\d{{1,9}}W)$"
    ),
    "uuid": "^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$",
    "ipv4": f"^{_IPV4}$",
    "ipv6": (
        f"^(?:(?:{_H16}:){{7}}{_H16}|(?:{_H16}:){{1,7}}:|(?:{_H16}:){{1,6}}:{_H16}"
        f"|(?:{_H16}:){{1,5}}(?::{_H16}){{1,2}}|(?:{_H16}:){{1,4}}(?::{_H16}){{1,3}}"
        f"|(?:{_H16}:){{1,3}}(?::{_H16}){{1,4}}|(?:{_H16}:){{1,2}}(?::{_H16}){{1,5}}"
        f"|{_H16}:(?::{_H16}){{1,6}}|:(?:(?::{_H16}){{1,7}}|:))$"
    ),
    "hostname": f"^{_HOST}$",
    "email": (
        rf"^[A-Za-z0-9_+-]{{1,32}}(?:\.[A-Za-z0-9_+-]{{1,32}}){{0,3}}"
        rf"@(?:{_LABEL}\.){{1,4}}[A-Za-z]{{2,24}}$"
    ),
    "uri": (
        rf"^https?://(?:{_HOST}|{_IPV4})(?::[1-9]\d{{0,3}})?(?:/{_PCHAR}*)*(?:\?(?:{_PCHAR}|[/?])*)?"
        rf"(?:#(?:{_PCHAR}|[/?])*)?$"
    ),
}

TYPE_KEYWORDS: Final = {
    "object": ("properties", "required", "additionalProperties"),
    "array": ("items", "minItems", "maxItems"),
    "string": ("pattern",),
    "number": ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"),
}
_LONE: Final = frozenset({"$ref", "anyOf"})  # combined with nothing but annotations (and root $defs)


SIMPLE_TYPES: Final = {t: t for t in ("string", "integer", "number", "boolean", "null")}
TYPE_ONLY: Final = frozenset({"type"}) | ANNOTATIONS


class SchemaError(Exception):
    """A schema edgellm refuses: a client-safe message naming the keyword, where it is and any limit."""

    def __init__(
        self, message: str, *, keyword: str, path: str, limit: int | None = None, unsupported: bool = False
    ) -> None:
        super().__init__(message)
        self.message = message
        self.keyword = keyword
        self.path = path
        self.limit = limit
        self.unsupported = unsupported


@dataclass(frozen=True, slots=True, eq=False)
class CheckedSchema:
    """A schema that passed `check_schema`, with what it counts toward the limits."""

    schema: Any
    label: str  # put before the paths of error messages ("" for a response format)
    properties: int
    enum_values: int
    chars: int


def shown(name: str) -> str:
    """A client-chosen name as error messages show it: itself when short and printable."""
    if len(name) <= 40 and name.isprintable():
        return name.replace("~", "~0").replace("/", "~1")
    return "<name>"


Path = tuple[str | int, ...]


def pointer(label: str, path: Path) -> str:
    return label + "#" + "".join(f"/{shown(s) if isinstance(s, str) else s}" for s in path)


# ---- JSON values (enum, const) ----------------------------------------------------------------


class _BadValue(Exception):
    pass


def json_text(value: Any, limit: int) -> str:
    """Compact JSON text for a JSON value, keys in the given order, at any depth (no recursion).

    Integral floats below 2**53 are written as integers (equal in JSON Schema). _BadValue for a
    non-finite number or a non-JSON value; stops once the text passes `limit` characters.
    """
    out: list[str] = []
    size = 0
    pending: list[Any] = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, _Raw):
            text = item.text
        elif item is None:
            text = "null"
        elif item is True or item is False:
            text = "true" if item else "false"
        elif isinstance(item, int):
            try:
                text = str(item)
            except ValueError:  # past Python's digit limit
                raise _BadValue("has a number too long to use") from None
        elif isinstance(item, float):
            if not math.isfinite(item):
                raise _BadValue("has a number that is not finite")
            text = str(int(item)) if item.is_integer() and abs(item) < 2**53 else repr(item)
        elif isinstance(item, str):
            text = json_string(item)
        elif isinstance(item, list):
            pending.append(_Raw("]"))
            for i in range(len(item) - 1, -1, -1):
                pending.append(item[i])
                if i:
                    pending.append(_Raw(","))
            text = "["
        elif isinstance(item, dict):
            pending.append(_Raw("}"))
            entries = list(item.items())
            for i in range(len(entries) - 1, -1, -1):
                key, sub = entries[i]
                if not isinstance(key, str):
                    raise _BadValue("is not a JSON value")
                pending.append(sub)
                pending.append(_Raw(json_string(key) + ":"))
                if i:
                    pending.append(_Raw(","))
            text = "{"
        else:
            raise _BadValue("is not a JSON value")
        out.append(text)
        size += len(text)
        if size > limit:
            raise _BadValue(f"is over {limit:,} characters as JSON")
    return "".join(out)


@dataclass(frozen=True, slots=True)
class _Raw:
    text: str


def json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer()):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


# ---- the checks -------------------------------------------------------------------------------


def _finite_number(value: Any) -> bool:
    # Not math.isfinite on an int: JSON integers of hundreds of digits overflow a float.
    if isinstance(value, bool):
        return False
    return isinstance(value, int) or (isinstance(value, float) and math.isfinite(value))


class _Checker:
    """One iterative walk over a schema: every keyword's type, references, limits."""

    def __init__(self, label: str, *, wrapper: bool = False) -> None:
        self.label = label
        self.wrapper = wrapper  # edgellm's own schema around checked parts: their counts add up
        self.nodes = self.properties = self.enum_values = self.chars = 0
        self.defs: dict[str, set[str]] = {"$defs": set(), "definitions": set()}
        self.refs: list[tuple[str, str, Path]] = []
        self.parts: list[CheckedSchema] = []

    def error(
        self, keyword: str, path: Path, problem: str, *, limit: int | None = None, unsupported: bool = False
    ) -> SchemaError:
        where = pointer(self.label, path)
        return SchemaError(
            f"'{keyword}' at {where} {problem}",
            keyword=keyword,
            path=where,
            limit=limit,
            unsupported=unsupported,
        )

    def over(self, keyword: str, path: Path, what: str, limit: int) -> SchemaError:
        return self.error(keyword, path, f"{what}; the most this server allows is {limit:,}", limit=limit)

    def run(self, schema: Any) -> None:
        pending: list[tuple[Any, Path, int, int, str]] = [(schema, (), 0, 0, "schema")]
        while pending:
            node, path, level, depth, keyword = pending.pop()
            self.nodes += 1
            if self.nodes > MAX_SCHEMA_NODES:
                raise self.over(keyword, path, f"is past {MAX_SCHEMA_NODES:,} subschemas", MAX_SCHEMA_NODES)
            if depth > MAX_SCHEMA_DEPTH:
                raise self.over(
                    keyword, path, f"nests subschemas more than {MAX_SCHEMA_DEPTH} deep", MAX_SCHEMA_DEPTH
                )
            if isinstance(node, CheckedSchema) and self.wrapper:
                self.parts.append(node)
                continue
            if isinstance(node, bool):
                continue
            if not isinstance(node, dict):
                raise self.error(keyword, path, "must be a JSON schema (an object or a boolean)")
            children = self._node(node, path, level)
            pending.extend(
                (sub, sub_path, sub_level, depth + 1, kw)
                for sub, sub_path, sub_level, kw in reversed(children)
            )
        for kind, name, path in self.refs:
            if kind != "#" and name not in self.defs[kind]:
                raise self.error("$ref", path, "names a definition the schema does not have")
        if not self.wrapper:
            self._totals()

    def _totals(self) -> None:
        if self.properties > MAX_OBJECT_PROPERTIES:
            raise self.over(
                "properties", (), f"has {self.properties:,} object properties in all", MAX_OBJECT_PROPERTIES
            )
        if self.enum_values > MAX_ENUM_VALUES:
            raise self.over("enum", (), f"has {self.enum_values:,} enum values in all", MAX_ENUM_VALUES)
        if self.chars > MAX_SCHEMA_CHARS:
            raise self.over(
                "properties",
                (),
                f"has {self.chars:,} characters of property names, definition "
                "names, enum and const values in all",
                MAX_SCHEMA_CHARS,
            )

    def _node(self, node: dict[str, Any], path: Path, level: int) -> list[tuple[Any, Path, int, str]]:
        children: list[tuple[Any, Path, int, str]] = []
        for key in node:
            if key not in SCHEMA_KEYWORDS:
                where, name = pointer(self.label, path), shown(str(key))
                raise SchemaError(
                    f"JSON schema keyword {name!r} (at {where}) is not supported; the "
                    "supported subset is OpenAI's structured-output subset",
                    keyword=name,
                    path=where,
                    unsupported=True,
                )
        constraints = set(node) - ANNOTATIONS - {"$defs", "definitions"}
        for lone in _LONE & constraints:
            if len(constraints) > 1:
                other = sorted(constraints - {lone})[0]
                raise self.error(lone, path, f"cannot be combined with '{other}'", unsupported=True)
        if {"enum", "const"} & constraints:
            others = sorted(constraints - {"enum", "const", "type"})
            if others:
                raise self.error(
                    "enum" if "enum" in node else "const",
                    path,
                    f"cannot be combined with '{others[0]}'",
                    unsupported=True,
                )
        if "pattern" in node and "format" in node:
            raise self.error("pattern", path, "cannot be combined with 'format'", unsupported=True)
        for key, value in node.items():
            check = _KEYWORD_CHECKS.get(key)
            if check is not None:
                check(self, value, path, level, children)
        lo, hi = node.get("minItems"), node.get("maxItems")
        if lo is not None and hi is not None and lo > hi:
            raise self.error("minItems", path, "is greater than 'maxItems'")
        self._satisfiable(node, path)
        return children

    def _satisfiable(self, node: dict[str, Any], path: Path) -> None:
        """Refuse what no value can meet, where the node alone shows it."""
        if _LONE & set(node):
            return
        kinds = schema_types(node)
        if "enum" in node or "const" in node:
            values = node["enum"] if "enum" in node else [node["const"]]
            allowed = set(kinds) | ({"integer"} if "number" in kinds else set())
            if "type" in node and not any(json_type(v) in allowed for v in values):
                raise self.error(
                    "enum" if "enum" in node else "const", path, "has no value of the 'type' given"
                )
            return
        if "integer" in kinds:
            bounds = integer_bounds(node)
            if bounds is not None and bounds[0] > bounds[1]:
                raise self.error(
                    "minimum",
                    path,
                    f"and the other bounds leave no integer of at most {MAX_INTEGER_DIGITS} digits",
                )
        if "array" in kinds and node.get("items") is False and node.get("minItems", 0) > 0:
            raise self.error("minItems", path, "cannot be met: 'items' is false")
        if "object" in kinds:
            props = node.get("properties", {})
            for name in node.get("required", []):
                if props.get(name) is False:
                    raise self.error("required", path, "names a property whose schema is false")
                if name not in props and node.get("additionalProperties") is False:
                    raise self.error(
                        "required",
                        path,
                        "names a property that 'properties' lacks and 'additionalProperties' forbids",
                    )

    def schema_list(
        self, key: str, value: Any, path: Path, level: int, children: list[tuple[Any, Path, int, str]]
    ) -> None:
        if not isinstance(value, list) or not value:
            raise self.error(key, path, "must be a non-empty list of schemas")
        children.extend((sub, (*path, key, i), level, key) for i, sub in enumerate(value))

    def schema_map(
        self, key: str, value: Any, path: Path, level: int, children: list[tuple[Any, Path, int, str]]
    ) -> None:
        if not isinstance(value, dict):
            raise self.error(key, path, "must be an object of schemas")
        if not all(isinstance(name, str) for name in value):
            raise self.error(key, path, "must be an object of schemas")
        if key == "properties":
            self.properties += len(value)
            if level + 1 > MAX_NESTING and value:
                raise self.over(key, path, f"nests schemas more than {MAX_NESTING} levels deep", MAX_NESTING)
        elif path:
            raise self.error(key, path, "is supported only at the root of the schema", unsupported=True)
        else:
            self.defs[key].update(value)
        self.chars += sum(len(name) for name in value)
        sub_level = level + 1 if key == "properties" else 0
        children.extend((sub, (*path, key, name), sub_level, key) for name, sub in value.items())

    def schema_one(
        self, key: str, value: Any, path: Path, level: int, children: list[tuple[Any, Path, int, str]]
    ) -> None:
        if isinstance(value, list) and key == "items":
            raise self.error(
                key,
                path,
                "must be one schema (lists of schemas, tuple validation, are not supported)",
                unsupported=True,
            )
        if not isinstance(value, dict | bool):
            raise self.error(key, path, "must be a schema (an object or a boolean)")
        if level + 1 > MAX_NESTING and value is not False:
            raise self.over(key, path, f"nests schemas more than {MAX_NESTING} levels deep", MAX_NESTING)
        children.append((value, (*path, key), level + 1, key))

    def values(self, key: str, values: list[Any], path: Path) -> None:
        for i, value in enumerate(values):
            try:
                text = json_text(value, MAX_SCHEMA_CHARS)
            except _BadValue as exc:
                raise self.error(key, (*path, "enum", i) if key == "enum" else path, str(exc)) from None
            self.chars += len(value) if isinstance(value, str) else len(text)
        if key == "enum" and len(values) > LARGE_ENUM_VALUES and all(isinstance(v, str) for v in values):
            size = sum(len(v) for v in values)
            if size > MAX_LARGE_ENUM_CHARS:
                raise self.over(
                    key,
                    path,
                    f"has {len(values):,} string values of {size:,} characters in all "
                    f"(over {LARGE_ENUM_VALUES} values)",
                    MAX_LARGE_ENUM_CHARS,
                )


_Children = list[tuple[Any, Path, int, str]]


def _check_type(c: _Checker, value: Any, path: Path, level: int, children: _Children) -> None:
    types: Any = [value] if isinstance(value, str) else value
    known = isinstance(types, list) and all(isinstance(t, str) and t in SCHEMA_TYPES for t in types)
    if not known or not types or len(set(types)) != len(types):
        raise c.error(
            "type",
            path,
            "must be one of " + ", ".join(sorted(SCHEMA_TYPES)) + ", or a non-empty list of distinct ones",
        )


def _check_required(c: _Checker, value: Any, path: Path, level: int, children: _Children) -> None:
    strings = isinstance(value, list) and all(isinstance(v, str) for v in value)
    if not strings or len(set(value)) != len(value):
        raise c.error("required", path, "must be a list of distinct strings")


def _check_enum(c: _Checker, value: Any, path: Path, level: int, children: _Children) -> None:
    if not isinstance(value, list) or not value:
        raise c.error("enum", path, "must be a non-empty list of JSON values")
    c.enum_values += len(value)
    c.values("enum", value, path)


def _check_const(c: _Checker, value: Any, path: Path, level: int, children: _Children) -> None:
    c.values("const", [value], path)


def _check_ref(c: _Checker, value: Any, path: Path, level: int, children: _Children) -> None:
    if not isinstance(value, str):
        raise c.error("$ref", path, "must be a string")
    target = ref_target(value)
    if target is None:
        raise c.error(
            "$ref",
            path,
            "must be a local reference: #, #/$defs/<name> or #/definitions/<name>",
            unsupported=True,
        )
    c.refs.append((*target, path))


def _check_pattern(c: _Checker, value: Any, path: Path, level: int, children: _Children) -> None:
    if not isinstance(value, str):
        raise c.error("pattern", path, "must be a string")
    try:
        parse_pattern(value)
    except PatternError as exc:
        raise c.error("pattern", path, exc.message, limit=exc.limit, unsupported=exc.unsupported) from None


def _check_format(c: _Checker, value: Any, path: Path, level: int, children: _Children) -> None:
    if not isinstance(value, str):
        raise c.error("format", path, "must be a string")
    if value not in STRING_FORMATS and value not in NUMBER_FORMATS:
        raise c.error(
            "format",
            path,
            f"{shown(value)!r} is not supported; the supported formats are "
            + ", ".join(STRING_FORMATS + NUMBER_FORMATS),
            unsupported=True,
        )


def _check_number(key: str) -> Callable[[_Checker, Any, Path, int, _Children], None]:
    def check(c: _Checker, value: Any, path: Path, level: int, children: _Children) -> None:
        if not _finite_number(value) or (key == "multipleOf" and value <= 0):
            raise c.error(
                key, path, "must be a positive number" if key == "multipleOf" else "must be a number"
            )

    return check


def _check_count(key: str) -> Callable[[_Checker, Any, Path, int, _Children], None]:
    def check(c: _Checker, value: Any, path: Path, level: int, children: _Children) -> None:
        if not _finite_number(value) or value < 0 or value != int(value):
            raise c.error(key, path, "must be a non-negative integer")
        if value > MAX_REPETITION:
            raise c.over(
                key, path, f"is {int(value):,}" if value < 10**9 else "is over 1,000,000,000", MAX_REPETITION
            )

    return check


def _check_string(key: str) -> Callable[[_Checker, Any, Path, int, _Children], None]:
    def check(c: _Checker, value: Any, path: Path, level: int, children: _Children) -> None:
        if not isinstance(value, str):
            raise c.error(key, path, "must be a string")

    return check


def _check_examples(c: _Checker, value: Any, path: Path, level: int, children: _Children) -> None:
    if not isinstance(value, list):
        raise c.error("examples", path, "must be a list")


def _check_strict(c: _Checker, value: Any, path: Path, level: int, children: _Children) -> None:
    if not isinstance(value, bool):
        raise c.error("strict", path, "must be a boolean")


def _check_additional(c: _Checker, value: Any, path: Path, level: int, children: _Children) -> None:
    c.schema_one("additionalProperties", value, path, level, children)


def _check_items(c: _Checker, value: Any, path: Path, level: int, children: _Children) -> None:
    c.schema_one("items", value, path, level, children)


def _check_any_of(c: _Checker, value: Any, path: Path, level: int, children: _Children) -> None:
    c.schema_list("anyOf", value, path, level, children)


def _check_map(key: str) -> Callable[[_Checker, Any, Path, int, _Children], None]:
    def check(c: _Checker, value: Any, path: Path, level: int, children: _Children) -> None:
        c.schema_map(key, value, path, level, children)

    return check


_KEYWORD_CHECKS: Final[Mapping[str, Callable[[_Checker, Any, Path, int, _Children], None]]] = {
    "type": _check_type,
    "required": _check_required,
    "enum": _check_enum,
    "const": _check_const,
    "$ref": _check_ref,
    "pattern": _check_pattern,
    "format": _check_format,
    "examples": _check_examples,
    "strict": _check_strict,
    "additionalProperties": _check_additional,
    "items": _check_items,
    "anyOf": _check_any_of,
    "properties": _check_map("properties"),
    "$defs": _check_map("$defs"),
    "definitions": _check_map("definitions"),
    **{k: _check_number(k) for k in TYPE_KEYWORDS["number"]},
    **{k: _check_count(k) for k in ("minItems", "maxItems")},
    **{k: _check_string(k) for k in ("title", "description", "$schema", "$id", "$comment")},
}


def ref_target(ref: str) -> tuple[str, str] | None:
    """("#", "") for the root, ("$defs" or "definitions", name) for a definition; None otherwise."""
    if ref == "#":
        return ("#", "")
    for kind in ("$defs", "definitions"):
        prefix = f"#/{kind}/"
        if ref.startswith(prefix) and "/" not in ref[len(prefix) :]:
            return (kind, ref[len(prefix) :].replace("~1", "/").replace("~0", "~"))
    return None


def check_schema(schema: Any, label: str = "") -> CheckedSchema:
    """Check a client's schema in full (SchemaError); `label` goes before paths in messages."""
    checker = _Checker(label)
    checker.run(schema)
    return CheckedSchema(schema, label, checker.properties, checker.enum_values, checker.chars)


def schema_types(node: Mapping[str, Any]) -> list[str]:
    value = node.get("type")
    if value is not None:
        return [value] if isinstance(value, str) else list(value)
    implied = [kind for kind, keys in TYPE_KEYWORDS.items() if any(k in node for k in keys)]
    if node.get("format") in STRING_FORMATS and "string" not in implied:
        implied.append("string")
    return implied  # none: any value


def integer_bounds(node: Mapping[str, Any]) -> tuple[int, int] | None:
    lows = [math.ceil(node["minimum"])] if "minimum" in node else []
    if "exclusiveMinimum" in node:
        lows.append(math.floor(node["exclusiveMinimum"]) + 1)
    highs = [math.floor(node["maximum"])] if "maximum" in node else []
    if "exclusiveMaximum" in node:
        highs.append(math.ceil(node["exclusiveMaximum"]) - 1)
    if not lows and not highs:
        return None
    widest, usual = 10**MAX_INTEGER_DIGITS - 1, 10**INTEGER_DIGITS - 1
    lo = max(lows) if lows else None
    hi = min(highs) if highs else None
    if lo is None:
        lo = -usual if hi is None or hi >= -usual else -widest
    if hi is None:
        hi = usual if lo <= usual else widest
    return max(lo, -widest), min(hi, widest)


def check_wrapper(wrapper: Any) -> list[CheckedSchema]:
    """Check a schema edgellm builds around `CheckedSchema` parts (tool calls) for shape; the parts."""
    checker = _Checker("", wrapper=True)
    checker.run(wrapper)
    return checker.parts
