"""Checked JSON schemas turned into llama.cpp grammars (GBNF).

`schema_to_grammar` checks a schema (`grammar.schema`) and turns it into GBNF that llama.cpp
parses (the rules go through `grammar.rules.Grammar`, which checks the grammar's own bounds);
`embedded_grammar` does the same for a schema edgellm builds around checked ones (tool
calls). Errors are `SchemaError`s.

What the grammar enforces, and what it only accepts:
- objects: properties in declared order, required ones required; `additionalProperties`
  false, true or a schema (extra keys come after the declared ones and never repeat a
  declared name). Without `additionalProperties`, an object with `properties` or `required`
  gets no extra keys (OpenAI's strict mode writes false); `{"type": "object"}` alone is any object.
- arrays: `items`, `minItems`/`maxItems` (llama.cpp's native `x{m,n}`).
- strings: any JSON string; `pattern` (ECMA-262 regex subset, see `grammar.regex`); `format`
  date, time, date-time, duration, uuid, ipv4, ipv6, hostname, email, uri (conservative
  grammars: everything written is valid; not every valid value can be written).
- integers: `minimum`/`maximum`/`exclusiveMinimum`/`exclusiveMaximum` exactly (at most 20
  digits; 16 on an unbounded side). numbers: any JSON number; bounds and `multipleOf` are
  accepted and not enforced. `format` int32/int64/float/double: accepted, not enforced.
- `enum`/`const` of any JSON value (written compactly, keys in the given order), `anyOf`,
  `type` lists, local `$ref` (`#`, `#/$defs/name`, `#/definitions/name`; recursion allowed).
- Without `type`, the types the keywords present imply (properties: object, items: array,
  pattern: string, minimum: number, ...), or any value when none does.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Final

from edgellmd.grammar.regex import pattern_alternatives
from edgellmd.grammar.rules import (
    RAW,
    Chars,
    Grammar,
    GrammarLimitError,
    Lit,
    Origin,
    Ref,
    Rep,
    Seq,
    chars,
    complement,
    escape_tails,
    intersect,
    json_string,
    json_unit,
    seq,
)
from edgellmd.grammar.schema import (
    FORMAT_PATTERNS,
    MAX_ENUM_VALUES,
    MAX_OBJECT_PROPERTIES,
    MAX_SCHEMA_CHARS,
    SIMPLE_TYPES,
    TYPE_ONLY,
    CheckedSchema,
    Path,
    SchemaError,
    check_schema,
    check_wrapper,
    integer_bounds,
    json_text,
    json_type,
    pointer,
    ref_target,
    schema_types,
)

# ---- the conversion ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, eq=False)
class _Doc:
    root: Any  # for $ref
    label: str


class _Converter:
    """Schema nodes as grammar alternatives; definitions become rules, converted in turn (no
    recursion through references). Recursion follows the schema's own nesting, which the
    checks bound (MAX_SCHEMA_DEPTH)."""

    def __init__(self, g: Grammar) -> None:
        self.g = g
        self.defs: dict[tuple[int, str], str] = {}
        self.pending: list[tuple[str, Any, _Doc, Path]] = []

    def at(self, keyword: str, doc: _Doc, path: Path) -> None:
        self.g.origin = Origin(keyword, lambda: pointer(doc.label, path))

    def value(self, node: Any, doc: _Doc, path: Path) -> list[Seq]:
        """Alternatives for the JSON text of the values `node` accepts ([] for none)."""
        g = self.g
        if isinstance(node, CheckedSchema):
            return self.value(node.schema, _Doc(node.schema, node.label), ())
        if node is True:
            return [(g.builtin("value"),)]
        if node is False:
            return []
        if "$ref" in node:
            return [(self.definition(node["$ref"], doc, path),)]
        if "anyOf" in node:
            alts = [
                alt
                for i, branch in enumerate(node["anyOf"])
                for alt in self.value(branch, doc, (*path, "anyOf", i))
            ]
            self.at("anyOf", doc, path)
            return g.factor(alts, "any-of")
        if "enum" in node or "const" in node:
            return self.constants(node, doc, path)
        kind = node.get("type")  # the common leaf, fast: {"type": "string"}
        simple = SIMPLE_TYPES.get(kind) if isinstance(kind, str) else None
        if simple is not None and node.keys() <= TYPE_ONLY:
            return [(g.builtin(simple),)] if simple != "boolean" else [(Lit("true"),), (Lit("false"),)]
        kinds = schema_types(node)
        if not kinds:
            return [(g.builtin("value"),)]
        alts = []
        for kind in kinds:
            alts.extend(_TYPES[kind](self, node, doc, path))
        self.at("type", doc, path)
        return g.factor(alts, "value")

    def definition(self, ref: str, doc: _Doc, path: Path) -> Ref:
        kind, name = ref_target(ref) or ("#", "")
        key = (id(doc.root), ref)
        if key not in self.defs:
            self.at("$ref", doc, path)
            rule = self.g.reserve("def")
            self.defs[key] = rule
            target = doc.root if kind == "#" else doc.root[kind][name]
            self.pending.append((rule, target, doc, () if kind == "#" else (kind, name)))
        return Ref(self.defs[key])

    def drain(self) -> None:
        while self.pending:
            rule, node, doc, path = self.pending.pop()
            self.g.define(rule, self.value(node, doc, path))

    def constants(self, node: Mapping[str, Any], doc: _Doc, path: Path) -> list[Seq]:
        values = node["enum"] if "enum" in node else [node["const"]]
        pairs = [(json_text(v, MAX_SCHEMA_CHARS), v) for v in values]
        if "enum" in node and "const" in node:
            const = json_text(node["const"], MAX_SCHEMA_CHARS)
            pairs = [(t, v) for t, v in pairs if t == const]
        if "type" in node:
            allowed = set(schema_types(node))
            if "number" in allowed:
                allowed.add("integer")
            pairs = [(t, v) for t, v in pairs if json_type(v) in allowed]
        texts = [t for t, _ in pairs]
        self.at("enum" if "enum" in node else "const", doc, path)
        return self.g.factor([(Lit(t),) for t in dict.fromkeys(texts)], "enum")

    def string(self, node: Mapping[str, Any], doc: _Doc, path: Path) -> list[Seq]:
        fmt = str(node.get("format"))
        if fmt in FORMAT_PATTERNS:
            self.at("format", doc, path)
            return self.g.factor(pattern_alternatives(self.g, FORMAT_PATTERNS[fmt]), "format")
        if "pattern" in node:
            self.at("pattern", doc, path)
            return self.g.factor(pattern_alternatives(self.g, node["pattern"]), "pattern")
        return [(self.g.builtin("string"),)]

    def integer(self, node: Mapping[str, Any], doc: _Doc, path: Path) -> list[Seq]:
        bounds = integer_bounds(node)
        if bounds is None:
            return [(self.g.builtin("integer"),)]
        lo, hi = bounds  # lo <= hi: checked
        self.at("minimum", doc, path)
        return self.g.factor(integer_range(lo, hi), "int")

    def array(self, node: Mapping[str, Any], doc: _Doc, path: Path) -> list[Seq]:
        g = self.g
        lo = int(node.get("minItems", 0))
        hi = None if node.get("maxItems") is None else int(node["maxItems"])
        items = self.value(node.get("items", True), doc, (*path, "items"))
        self.at("items", doc, path)
        space = g.builtin("space")
        if not items:
            if lo > 0:
                where = pointer(doc.label, path)
                raise SchemaError(
                    f"'minItems' at {where} cannot be met: 'items' is false", keyword="minItems", path=where
                )
            hi = 0
        if hi == 0:
            return [(Lit("["), space, Lit("]"))]
        item = g.named(items, "item")
        more_lo, more_hi = max(lo - 1, 0), None if hi is None else hi - 1
        tail = g.named([(Lit(","), space, item, space)], "more")
        more: Seq = (
            ()
            if more_hi == 0
            else (tail,)
            if (more_lo, more_hi) == (1, 1)
            else (Rep(tail, more_lo, more_hi),)
        )
        body = seq(item, space, more)
        if lo == 0:
            return [seq(Lit("["), space, Rep(g.named([body], "items"), 0, 1), Lit("]"))]
        return [seq(Lit("["), space, body, Lit("]"))]

    def object(self, node: Mapping[str, Any], doc: _Doc, path: Path) -> list[Seq]:
        g = self.g
        props: Mapping[str, Any] = node.get("properties", {})
        required: list[str] = node.get("required", [])
        extra = node.get("additionalProperties")
        if not props and not required and extra is None:
            return [(g.builtin("object"),)]
        must = set(required)
        space = g.builtin("space")
        entries: list[tuple[str, Seq, bool]] = []
        for name, sub in props.items():
            alts = self.value(sub, doc, (*path, "properties", name))
            if alts:
                # A short value (a const) stays in line, so that anyOf branches told apart by
                # it share their prefix up to it (tool names, discriminators).
                short = len(alts) == 1 and len(alts[0]) <= 2
                entries.append((name, alts[0] if short else (g.named(alts, "prop"),), name in must))
            elif name in must:
                where = pointer(doc.label, path)
                raise SchemaError(
                    f"'required' at {where} names a property whose schema is false",
                    keyword="required",
                    path=where,
                )
        extra_alts = (
            None
            if extra is None or extra is False
            else self.value(extra, doc, (*path, "additionalProperties"))
        )
        self.at("properties", doc, path)
        for name in required:
            if name in props:
                continue
            if extra is False or extra_alts == []:
                where = pointer(doc.label, path)
                raise SchemaError(
                    f"'required' at {where} names a property that 'properties' lacks and "
                    "'additionalProperties' forbids",
                    keyword="required",
                    path=where,
                )
            entries.append((name, (g.named(extra_alts, "prop") if extra_alts else g.builtin("value"),), True))
        end_after: Seq = ()
        end_first: Seq = ()
        if extra_alts:
            key = self.key_excluding([name for name, _, _ in entries])
            member = g.named([seq(key, space, Lit(":"), space, g.named(extra_alts, "extra"), space)], "extra")
            more = g.named([(Lit(","), space, member)], "extras")
            end_after = (Rep(more, 0, None),)
            end_first = (Rep(g.named([(member, Rep(more, 0, None))], "extras"), 0, 1),)
        # Right to left: `after` is what may follow once a property is written (each written
        # one starts with a comma), `first` what may open the object.
        after = end_after
        first: list[Seq] = [end_first]
        for name, ref, needed in reversed(entries):
            # Plain tuples: no two literals meet (a space is between), and seq() costs here.
            kv = (Lit(json_string(name)), space, Lit(":"), space, *ref, space)
            written = (Lit(","), space, *kv, *after)
            opening = (*kv, *after)
            if needed:
                first = [opening]
                after = written if len(written) <= 32 else (g.named([written], "props"),)
            else:
                first.append(opening)
                after = (g.named([written, after], "props"),)
        opening_alts = g.factor(list(reversed(first)), "props")
        return [seq(Lit("{"), space, g.inline(opening_alts, "props"), Lit("}"))]

    def key_excluding(self, names: list[str]) -> Seq:
        """A JSON string, canonically spelled, that is none of `names` (a trie over their spellings)."""
        g = self.g
        if not names:
            return (g.builtin("string"),)
        root = _Trie()
        for name in names:
            node = root
            for c in name:
                node = node.children.setdefault(json_unit(ord(c)), _Trie())
            node.end = True
        rest = g.named([(Rep(g.builtin("char"), 0, None), Lit('"'))], "key-rest")
        order = list(_walk(root))
        rules: dict[int, Ref] = {}
        for node in reversed(order):
            alts: list[Seq] = [] if node.end else [(Lit('"'),)]
            alts.extend((Lit(unit), rules[id(child)]) for unit, child in node.children.items())
            raw = RAW
            taken = [unit for unit in node.children if len(unit) == 1]
            if taken:
                raw = intersect(raw, complement(chars("".join(taken))))
            if raw:
                alts.append((Chars(raw), rest))
            escaped = [c for c in range(0x20) if json_unit(c) not in node.children]
            escaped += [c for c in (0x22, 0x5C, 0x7F) if json_unit(c) not in node.children]
            if escaped:
                alts.append((Lit("\\"), g.named(escape_tails(sorted(escaped)), "esc"), rest))
            rules[id(node)] = g.named(g.factor(alts, "key"), "key")
        return (Lit('"'), rules[id(root)])


class _Trie:
    __slots__ = ("children", "end")

    def __init__(self) -> None:
        self.children: dict[str, _Trie] = {}
        self.end = False


def _walk(root: _Trie) -> Iterator[_Trie]:
    pending = [root]
    while pending:
        node = pending.pop()
        yield node
        pending.extend(node.children.values())


def integer_range(lo: int, hi: int) -> list[Seq]:
    """Alternatives for the JSON integers from lo to hi (no leading zeros, no -0)."""
    out: list[Seq] = []
    if lo < 0:
        out.extend(seq(Lit("-"), s) for s in _magnitudes(max(1, -hi), -lo))
    if hi >= 0:
        out.extend(_magnitudes(max(lo, 0), hi))
    return out


def _magnitudes(a: int, b: int) -> list[Seq]:
    out: list[Seq] = []
    full: list[int] = []  # digit counts whose every number is in range, merged below
    for digits in range(len(str(a)), len(str(b)) + 1):
        lo, hi = max(a, 10 ** (digits - 1) if digits > 1 else 0), min(b, 10**digits - 1)
        if lo > hi:
            continue
        if digits > 1 and lo == 10 ** (digits - 1) and hi == 10**digits - 1:
            full.append(digits)
        else:
            out.extend(_same_length(str(lo), str(hi)))
    if full:
        out.append((Chars(((0x31, 0x39),)), Rep(_DIGIT, full[0] - 1, full[-1] - 1)))
    return out


_DIGIT: Final = Chars(((0x30, 0x39),))


def _digits(count: int) -> Seq:
    return () if count == 0 else (_DIGIT,) if count == 1 else (Rep(_DIGIT, count, count),)


def _same_length(lo: str, hi: str) -> list[Seq]:
    """Numerals of len(lo) digits from lo to hi (recursion: one level per digit, at most 20)."""
    if lo == hi:
        return [(Lit(lo),)] if lo else [()]
    k = 0
    while lo[k] == hi[k]:
        k += 1
    if k:
        return [seq(Lit(lo[:k]), s) for s in _same_length(lo[k:], hi[k:])]
    rest = len(lo) - 1
    a, b = int(lo[0]), int(hi[0])
    from_zero, to_nine = lo[1:] == "0" * rest, hi[1:] == "9" * rest
    out: list[Seq] = []
    if not from_zero:
        out.extend(seq(Lit(lo[0]), s) for s in _same_length(lo[1:], "9" * rest))
    start, end = (a if from_zero else a + 1), (b if to_nine else b - 1)
    if start <= end:
        head = Lit(str(start)) if start == end else Chars(((0x30 + start, 0x30 + end),))
        out.append(seq(head, _digits(rest)))
    if not to_nine:
        out.extend(seq(Lit(hi[0]), s) for s in _same_length("0" * rest, hi[1:]))
    return out


_TYPES: Final[Mapping[str, Callable[[_Converter, Mapping[str, Any], _Doc, Path], list[Seq]]]] = {
    "null": lambda c, n, d, p: [(Lit("null"),)],
    "boolean": lambda c, n, d, p: [(Lit("true"),), (Lit("false"),)],
    "integer": _Converter.integer,
    "number": lambda c, n, d, p: [(c.g.builtin("number"),)],
    "string": _Converter.string,
    "array": _Converter.array,
    "object": _Converter.object,
}


def _build(root: Any, label: str) -> str:
    g = Grammar()
    converter = _Converter(g)
    alts = converter.value(root, _Doc(root, label), ())
    converter.drain()
    if not alts:
        raise SchemaError(f"the JSON schema at {label}# accepts no value", keyword="schema", path=f"{label}#")
    try:
        # The reply ends at the value's last character: no whitespace after it, so a complete
        # object never runs on into `length` on spaces and newlines.
        return g.render([seq(g.inline(alts, "value"))])
    except GrammarLimitError as exc:
        if exc.origin is None:
            raise SchemaError(
                f"the JSON schema's grammar: {exc.message}",
                keyword="schema",
                path=f"{label}#",
                limit=exc.limit,
            ) from None
        keyword = exc.origin.keyword or "schema"
        raise SchemaError(
            f"'{keyword}' at {exc.origin.path}: {exc.message}",
            keyword=keyword,
            path=exc.origin.path,
            limit=exc.limit,
        ) from None


def schema_to_grammar(schema: Any) -> str:
    """GBNF (root rule `root`) for the JSON values a schema accepts; checks it first unless checked."""
    part = schema if isinstance(schema, CheckedSchema) else check_schema(schema)
    return _build(part.schema, part.label)


def embedded_grammar(wrapper: Any) -> str:
    """GBNF for a schema edgellm builds around `CheckedSchema` parts (tool calls).

    The wrapper's own keywords are checked for shape but are edgellm's: its nesting and names
    do not count toward the client's limits. The parts' counts add up against them, and the
    grammar's bounds hold for the whole.
    """
    parts = check_wrapper(wrapper)
    totals = (
        ("properties", "object properties", sum(p.properties for p in parts), MAX_OBJECT_PROPERTIES),
        ("enum", "enum values", sum(p.enum_values for p in parts), MAX_ENUM_VALUES),
        (
            "properties",
            "characters of names, enum and const values",
            sum(p.chars for p in parts),
            MAX_SCHEMA_CHARS,
        ),
    )
    for keyword, what, count, limit in totals:
        if count > limit:
            raise SchemaError(
                f"the schemas together have {count:,} {what}; the most this server allows is {limit:,}",
                keyword=keyword,
                path="#",
                limit=limit,
            )
    return _build(wrapper, "")
