"""A non-strict tool's JSON schema brought into the subset the grammar enforces.

OpenAI and Anthropic take any JSON Schema for a tool that is not `strict`, and enforce none of
it; pydantic (`Field(min_length=...)`), MCP servers and agent CLIs send what the structured-
output subset refuses. `relax` keeps every keyword the subset has, enforces what it can
express of the rest, and leaves the others out (the model is then only asked, by the schema
in its prompt, not held):

- `minLength`/`maxLength` on a string without `pattern`, `format`, `enum` or `const` become a
  pattern of that many characters (up to MAX_ENFORCED_LENGTH; a longer bound is left out);
- `oneOf` is `anyOf` (the grammar cannot hold "exactly one", and a tool's alternatives
  rarely overlap);
- `allOf` is merged into its schema when its members only add properties, required names and
  annotations of an object (a pydantic model's base classes); otherwise left out;
- an object with empty `properties` and no `additionalProperties` has no keys (a tool that
  takes no arguments);
- a `pattern` the regex subset refuses, a `format` it does not know, and every keyword it does
  not have (`propertyNames`, `minProperties`, `uniqueItems`, `not`, `if`, ...) are left out;
- `$ref` and `anyOf` keep only annotations beside them; `enum` and `const` keep `type`.

The result goes through `check_schema` as any schema does: the hostile-input bounds hold for
it. Pure data: nothing here is built or compiled.
"""

from __future__ import annotations

from typing import Any, Final

from edgellmd.grammar.regex import PatternError, parse_pattern
from edgellmd.grammar.schema import ANNOTATIONS, NUMBER_FORMATS, SCHEMA_KEYWORDS, STRING_FORMATS

# A longer minLength or maxLength is left out: each character is a position of the pattern's
# (regex.MAX_PATTERN_STATES bounds them).
MAX_ENFORCED_LENGTH: Final = 256
_SUBSCHEMA_MAPS: Final = ("properties", "$defs", "definitions")
_SUBSCHEMA_LISTS: Final = ("anyOf", "oneOf", "allOf")
_OBJECT_PARTS: Final = frozenset({"type", "properties", "required", "additionalProperties"}) | ANNOTATIONS


def relax(schema: Any) -> tuple[Any, tuple[str, ...]]:
    """The schema in the enforced subset, and the keywords left out (sorted, each once)."""
    left: set[str] = set()
    return _node(schema, left, 0), tuple(sorted(left))


def _node(node: Any, left: set[str], depth: int) -> Any:
    if not isinstance(node, dict) or depth > 256:  # check_schema refuses what is not a schema
        return node
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in _SUBSCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: _node(sub, left, depth + 1) for name, sub in value.items()}
        elif key in _SUBSCHEMA_LISTS and isinstance(value, list):
            out[key] = [_node(sub, left, depth + 1) for sub in value]
        elif key in ("items", "additionalProperties") and isinstance(value, dict):
            out[key] = _node(value, left, depth + 1)
        else:
            out[key] = value
    _one_of(out, left)
    _all_of(out, left)
    _lengths(out, left)
    _pattern_and_format(out, left)
    for key in [k for k in out if k not in SCHEMA_KEYWORDS]:
        left.add(str(key))
        del out[key]
    _alone(out, left)
    if out.get("properties") == {} and "additionalProperties" not in out:
        out["additionalProperties"] = False  # no properties: no keys
    return out


def _one_of(node: dict[str, Any], left: set[str]) -> None:
    if "oneOf" not in node:
        return
    alternatives = node.pop("oneOf")
    if "anyOf" in node or not isinstance(alternatives, list):
        left.add("oneOf")
        return
    node["anyOf"] = alternatives


def _all_of(node: dict[str, Any], left: set[str]) -> None:
    if "allOf" not in node:
        return
    members = node.pop("allOf")
    parts = members if isinstance(members, list) else []
    if not parts or not all(isinstance(p, dict) and set(p) <= _OBJECT_PARTS for p in parts):
        left.add("allOf")
        return
    properties: dict[str, Any] = dict(node.get("properties") or {})
    required: list[Any] = list(node.get("required") or [])
    names = set(properties)
    for part in parts:
        theirs = set(part.get("properties") or {})
        if part.get("type", "object") != "object" or names & theirs:
            left.add("allOf")  # not an object, or two members define one property: not merged
            return
        names |= theirs
    for part in parts:
        properties.update(part.get("properties") or {})
        required += [r for r in part.get("required") or [] if r not in required]
        if part.get("additionalProperties") is False:
            node.setdefault("additionalProperties", False)
    node["type"] = node.get("type", "object")
    node["properties"] = properties
    if required:
        node["required"] = required


def _lengths(node: dict[str, Any], left: set[str]) -> None:
    lo, hi = node.pop("minLength", None), node.pop("maxLength", None)
    if lo is None and hi is None:
        return
    plain = not ({"pattern", "format", "enum", "const"} & set(node))
    numbers = all(v is None or (isinstance(v, int) and not isinstance(v, bool) and v >= 0) for v in (lo, hi))
    if not plain or not numbers:
        left.update(k for k, v in (("minLength", lo), ("maxLength", hi)) if v is not None)
        return
    low = lo or 0
    if low > MAX_ENFORCED_LENGTH:
        left.add("minLength")
        low = 0
    high = hi if hi is not None and hi <= MAX_ENFORCED_LENGTH else None
    if hi is not None and high is None:
        left.add("maxLength")
    if high is not None and high < low:
        left.update(("minLength", "maxLength"))  # nothing could match: asked, not held
        return
    if low or high is not None:
        node["pattern"] = f"^[\\s\\S]{{{low},{'' if high is None else high}}}$"


def _pattern_and_format(node: dict[str, Any], left: set[str]) -> None:
    pattern = node.get("pattern")
    if isinstance(pattern, str):
        try:
            parse_pattern(pattern)
        except PatternError:
            left.add("pattern")
            del node["pattern"]
    fmt = node.get("format")
    if isinstance(fmt, str) and fmt not in STRING_FORMATS and fmt not in NUMBER_FORMATS:
        left.add("format")
        del node["format"]


def _alone(node: dict[str, Any], left: set[str]) -> None:
    """`$ref` and `anyOf` combine with annotations only; `enum` and `const` with `type` only."""
    for lone in ("$ref", "anyOf"):
        if lone in node:
            for key in [k for k in node if k not in ANNOTATIONS and k not in (lone, "$defs", "definitions")]:
                left.add(str(key))
                del node[key]
            return
    if "enum" in node or "const" in node:
        keep = {"enum", "const", "type", "$defs", "definitions"} | ANNOTATIONS
        for key in [k for k in node if k not in keep]:
            left.add(str(key))
            del node[key]
