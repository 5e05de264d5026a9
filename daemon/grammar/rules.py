"""GBNF rules for llama.cpp, checked against what llama.cpp can take before it sees them.

Layer under `grammar.convert` (JSON schemas) and `grammar.regex` (patterns).
`Grammar` collects rules made of a few atoms (literal text, one character of a set, a rule
reference, a repetition of one of those) and renders them as GBNF only after checking what
llama.cpp would make of them: rules and elements once it expands `x{m,n}`, bytes, the
alternatives it follows at once (its "stacks": every token's check pays for each), the
states of patterns matched at once, the chains of leftmost references it walks recursively,
and left recursion, which it refuses. Strings are spelled as JSON text (`json_string`, and
`set_atom` for one character of a set, raw or escaped as JSON requires).

Why each limit is where it is, measured against llama.cpp: docs/structured-output.md
("Grammar limits, measured"; `.venv/bin/python -m tests.bench_grammar_limits`).
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Final

# ---- limits (see the module docstring for the measurements behind them) ----------------------

# Repetition bounds: `minItems`/`maxItems` and regex `{m,n}`. llama.cpp refuses x{m} past
# 2,000, silently drops an upper bound past 2,000, and refuses a group whose rules times the
# count pass 2,000; repeated items here are always one atom (a reference counts once).
MAX_REPETITION: Final = 1_000
MAX_GRAMMAR_BYTES: Final = 1_000_000  # GBNF text handed to llama.cpp
MAX_GRAMMAR_RULES: Final = 50_000  # rules once llama.cpp has expanded x{m,n} (n - m rules each)
MAX_GRAMMAR_ELEMENTS: Final = 2_000_000  # grammar elements after that expansion (copies of x{m})
# Alternatives llama.cpp follows at one point of the reply (one "stack" each); every token's
# check costs in proportion (module docstring). Enum values are written as a trie, so this
# counts distinct next characters there, not values.
MAX_GRAMMAR_CHOICES: Final = 256
MAX_GRAMMAR_DEPTH: Final = 256  # chain of leftmost rule references (walked recursively)
# Positions of a pattern once its counted repetitions are written out (x{m,n}: n times x's,
# nested ones multiply), shared by the patterns that may be matched at once. llama.cpp keeps
# one stack per repetition count an ambiguous text leaves open: ^((a|aa){0,100}){0,100}$ took
# over 120 s for 300 characters; (a|aa){0,1000} after 900 characters, 0.6 ms per token check.
MAX_PATTERN_STATES: Final = 1_000
# The converter writes no parenthesised group: every group is a named rule, so llama.cpp's
# parser recurses one level per rule, never per nesting (crash between 10,000 and 20,000).
MAX_GRAMMAR_NESTING: Final = 0

Ranges = tuple[tuple[int, int], ...]  # sorted, disjoint, non-adjacent inclusive code point ranges
MAX_CODE_POINT: Final = 0x10FFFF


class GrammarLimitError(Exception):
    """A grammar past one of the limits above, or one llama.cpp would refuse; the message is client-safe."""

    def __init__(self, message: str, origin: Origin | None, limit: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.origin = origin
        self.limit = limit


@dataclass(frozen=True, slots=True)
class Origin:
    """Where a rule comes from: the schema keyword and its path, for error messages."""

    keyword: str
    where: Callable[[], str]  # the path, written only for an error

    @property
    def path(self) -> str:
        """The path of the keyword, as error messages show it."""
        return self.where()


# ---- code point sets --------------------------------------------------------------------------


def norm(ranges: Iterable[tuple[int, int]]) -> Ranges:
    """Sorted, merged ranges."""
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(ranges):
        if out and lo <= out[-1][1] + 1:
            if hi > out[-1][1]:
                out[-1] = (out[-1][0], hi)
        else:
            out.append((lo, hi))
    return tuple(out)


def complement(ranges: Ranges) -> Ranges:
    """All code points not in `ranges`."""
    out: list[tuple[int, int]] = []
    nxt = 0
    for lo, hi in ranges:
        if lo > nxt:
            out.append((nxt, lo - 1))
        nxt = hi + 1
    if nxt <= MAX_CODE_POINT:
        out.append((nxt, MAX_CODE_POINT))
    return tuple(out)


def intersect(a: Ranges, b: Ranges) -> Ranges:
    """Code points in both."""
    out: list[tuple[int, int]] = []
    i = j = 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if lo <= hi:
            out.append((lo, hi))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return tuple(out)


def contains(ranges: Ranges, c: int) -> bool:
    """True when `c` is in `ranges`."""
    return any(lo <= c <= hi for lo, hi in ranges)


def chars(text: str) -> Ranges:
    """The set of the characters of `text`."""
    return norm((ord(c), ord(c)) for c in text)


# Characters JSON lets a string hold as themselves (valid UTF-8, so no surrogates), and those
# it must escape. 0x7F may stand raw in JSON; it is escaped here as llama.cpp's converter does.
RAW: Final[Ranges] = ((0x20, 0x21), (0x23, 0x5B), (0x5D, 0x7E), (0x80, 0xD7FF), (0xE000, MAX_CODE_POINT))
ESCAPED: Final = (*range(0x20), 0x22, 0x5C, 0x7F)
_SHORT_ESCAPES: Final = {0x22: '"', 0x5C: "\\", 0x08: "b", 0x0C: "f", 0x0A: "n", 0x0D: "r", 0x09: "t"}


def json_unit(c: int) -> str:
    """The one JSON spelling used here for code point `c` inside a string (canonical)."""
    if c in _SHORT_ESCAPES:
        return "\\" + _SHORT_ESCAPES[c]
    if c < 0x20 or c == 0x7F or 0xD800 <= c <= 0xDFFF:  # lone surrogates only as escapes
        return f"\\u{c:04x}"
    return chr(c)


def json_string(text: str) -> str:
    """`text` as a JSON string literal, canonically spelled (see `json_unit`)."""
    return '"' + "".join(json_unit(ord(c)) for c in text) + '"'


# ---- grammar atoms ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Lit:
    """Literal text (non-empty)."""

    text: str


@dataclass(frozen=True, slots=True)
class Chars:
    """One character of a set; no ranges: matches nothing."""

    ranges: Ranges


@dataclass(frozen=True, slots=True)
class Ref:
    """A reference to a rule."""

    name: str


@dataclass(frozen=True, slots=True)
class Rep:
    """`atom{lo,hi}` (hi None: unbounded); the atom is never one that can match the empty text."""

    atom: Lit | Chars | Ref
    lo: int
    hi: int | None


Atom = Lit | Chars | Ref | Rep
Seq = tuple[Atom, ...]
NEVER: Final = Chars(())


def seq(*parts: Atom | Seq) -> Seq:
    """A sequence of atoms and sequences, flattened, adjacent literals merged."""
    out: list[Atom] = []
    for part in parts:
        for atom in (part,) if not isinstance(part, tuple) else part:
            if isinstance(atom, Lit) and out and isinstance(out[-1], Lit):
                out[-1] = Lit(out[-1].text + atom.text)
            else:
                out.append(atom)
    return tuple(out)


def _hex(c: int) -> str:
    if c < 0x100:
        return f"\\x{c:02X}"
    if c < 0x10000:
        return f"\\u{c:04X}"
    return f"\\U{c:08X}"


def gbnf_literal(text: str) -> str:
    """`text` as a GBNF literal, in ASCII (llama.cpp's escapes: \\" \\\\ \\xHH \\uHHHH \\UHHHHHHHH)."""
    out = ['"']
    for ch in text:
        c = ord(ch)
        if ch in '"\\':
            out.append("\\" + ch)
        elif 0x20 <= c < 0x7F:
            out.append(ch)
        else:
            out.append(_hex(c))
    out.append('"')
    return "".join(out)


def _class_char(c: int) -> str:
    return chr(c) if chr(c).isascii() and chr(c).isalnum() else _hex(c)


def gbnf_class(ranges: Ranges) -> str:
    """A GBNF character class; an empty set becomes a class nothing matches."""
    if not ranges:
        return "[^\\x00-\\UFFFFFFFF]"  # llama.cpp compares 32-bit values, invalid UTF-8 included
    parts = [_class_char(lo) if lo == hi else f"{_class_char(lo)}-{_class_char(hi)}" for lo, hi in ranges]
    return "[" + "".join(parts) + "]"


def _atom_text(atom: Atom) -> str:
    if isinstance(atom, Lit):
        return gbnf_literal(atom.text)
    if isinstance(atom, Chars):
        return gbnf_class(atom.ranges)
    if isinstance(atom, Ref):
        return atom.name
    lo, hi = atom.lo, atom.hi
    suffix = (
        "?"
        if (lo, hi) == (0, 1)
        else "*"
        if (lo, hi) == (0, None)
        else "+"
        if (lo, hi) == (1, None)
        else f"{{{lo}}}"
        if lo == hi
        else f"{{{lo},}}"
        if hi is None
        else f"{{{lo},{hi}}}"
    )
    return _atom_text(atom.atom) + suffix


def _elements(atom: Atom) -> int:
    """llama.cpp grammar elements for `atom` once its repetitions are expanded."""
    if isinstance(atom, Lit):
        return len(atom.text)
    if isinstance(atom, Chars):
        return max(1, 2 * len(atom.ranges))
    if isinstance(atom, Ref):
        return 1
    inner = _elements(atom.atom)
    return atom.lo * inner + _rep_rules(atom) * (inner + 3)


def _rep_rules(atom: Rep) -> int:
    """Rules llama.cpp generates for a repetition: S' rules for the optional part."""
    if atom.hi is None:
        return 1
    return atom.hi - atom.lo


# ---- the grammar ------------------------------------------------------------------------------


_BUILTINS: Final[dict[str, tuple[Seq, ...]]] = {
    # Models pretty-print JSON; a newline and indentation are allowed where one space is, as
    # llama.cpp's current converter does. Bounded, so no stack grows with it.
    "space": ((), (Lit(" "),), (Lit("\n"), Rep(Chars(((9, 9), (32, 32))), 0, 20))),
    "char": ((Chars(RAW),), (Lit("\\"), Ref("escape"))),
    "escape": ((Chars(chars('"\\/bfnrt')),), (Lit("u"), Rep(Chars(chars("0123456789abcdefABCDEF")), 4, 4))),
    "string": ((Lit('"'), Rep(Ref("char"), 0, None), Lit('"')),),
    "int-part": ((Lit("0"),), (Chars(((0x31, 0x39),)), Rep(Chars(((0x30, 0x39),)), 0, 15))),
    "integer": ((Rep(Lit("-"), 0, 1), Ref("int-part")),),
    # Exponents of at most two digits keep every number finite as a double.
    "number": ((Ref("integer"), Rep(Ref("fraction"), 0, 1), Rep(Ref("exponent"), 0, 1)),),
    "fraction": ((Lit("."), Rep(Chars(((0x30, 0x39),)), 1, 16)),),
    "exponent": ((Chars(chars("eE")), Rep(Chars(chars("+-")), 0, 1), Rep(Chars(((0x30, 0x39),)), 1, 2)),),
    "boolean": ((Lit("true"),), (Lit("false"),)),
    "null": ((Lit("null"),),),
    "value": tuple((Ref(n),) for n in ("object", "array", "string", "number", "boolean", "null")),
    "object": ((Lit("{"), Ref("space"), Rep(Ref("members"), 0, 1), Lit("}")),),
    "members": ((Ref("member"), Rep(Ref("more-members"), 0, None)),),
    "more-members": ((Lit(","), Ref("space"), Ref("member")),),
    "member": ((Ref("string"), Ref("space"), Lit(":"), Ref("space"), Ref("value"), Ref("space")),),
    "array": ((Lit("["), Ref("space"), Rep(Ref("elements"), 0, 1), Lit("]")),),
    "elements": ((Ref("value"), Ref("space"), Rep(Ref("more-elements"), 0, None)),),
    "more-elements": ((Lit(","), Ref("space"), Ref("value"), Ref("space")),),
    "never": ((NEVER,),),
}
_BUILTIN_ORIGIN: Final = Origin("", lambda: "#")


class _Node:
    __slots__ = ("children", "end", "tail")

    def __init__(self, tail: list[str | Atom] | None = None) -> None:
        self.children: dict[str | Atom, _Node] = {}
        self.end = False
        self.tail = tail  # the rest of one alternative, not split yet (the node has no children then)


class Grammar:
    """Rules under construction; `render` checks the limits and writes GBNF."""

    def __init__(self) -> None:
        self._rules: dict[str, tuple[Seq, ...]] = {}
        self._origins: dict[str, Origin] = {}
        self._by_body: dict[tuple[Seq, ...], str] = {}
        self._serial = itertools.count(1)
        self._weights: dict[str, int] = {}
        self.origin = _BUILTIN_ORIGIN  # set by the caller: where new rules come from

    def weigh(self, ref: Ref, states: int) -> None:
        """Mark a pattern's rule with its states: patterns that may be matched at once add up."""
        self._weights[ref.name] = max(states, self._weights.get(ref.name, 0))

    def builtin(self, name: str) -> Ref:
        """A reference to one of the fixed rules (value, string, number, space, ...)."""
        pending = [name]
        while pending:
            current = pending.pop()
            if current in self._rules:
                continue
            body = _BUILTINS[current]
            self._rules[current] = body
            self._origins[current] = _BUILTIN_ORIGIN
            pending.extend(r for alt in body for r in _refs(alt) if r in _BUILTINS)
        return Ref(name)

    def reserve(self, hint: str) -> str:
        """A fresh rule name, to be given its body with `define` (for recursive references)."""
        name = f"{_sanitize(hint)}-{next(self._serial)}"
        self._origins[name] = self.origin
        return name

    def define(self, name: str, alts: Sequence[Seq]) -> None:
        """The body of a reserved rule; no alternatives: it matches nothing."""
        self._rules[name] = tuple(alts) if alts else ((NEVER,),)

    def named(self, alts: Sequence[Seq], hint: str) -> Ref:
        """A reference standing for `alts`: an existing rule with the same body, or a new one."""
        alts = tuple(dict.fromkeys(alts))
        if not alts:
            return self.builtin("never")
        if len(alts) == 1 and len(alts[0]) == 1 and isinstance(alts[0][0], Ref):
            return alts[0][0]  # an alias: the rule itself
        existing = self._by_body.get(alts)
        if existing is not None:
            return Ref(existing)
        name = self.reserve(hint)
        self._rules[name] = alts
        self._by_body[alts] = name
        return Ref(name)

    def inline(self, alts: Sequence[Seq], hint: str) -> Seq:
        """One sequence for `alts`: itself when single, else a reference to their rule."""
        unique = tuple(dict.fromkeys(alts))
        if len(unique) == 1:
            return unique[0]
        return (self.named(unique, hint),)

    def atom(self, body: Seq, hint: str) -> Lit | Chars | Ref:
        """`body` as one atom to repeat: small atoms as they are, anything else as a rule."""
        if len(body) == 1:
            only = body[0]
            if isinstance(only, Ref | Chars) or (isinstance(only, Lit) and len(only.text) <= 6):
                return only
        return self.named([body], hint)

    def factor(self, alts: Sequence[Seq], hint: str) -> list[Seq]:
        """`alts` with common prefixes shared (a trie), so that llama.cpp follows few at once.

        Branches whose rest is the same and that differ in one character become one class
        (`"a" | "b"` -> `[ab]`). Iterative: values may be long and many.
        """
        unique = list(dict.fromkeys(alts))
        if len(unique) <= 1:
            return unique
        heads = {_head(alt) for alt in unique}
        if len(heads) == len(unique):  # no two share a first symbol: nothing to share
            return _merge_heads(unique)
        # A trie whose unshared rests stay whole until another alternative needs them split:
        # the work follows the shared prefixes, not the length of the alternatives.
        root = _Node()
        for alt in unique:
            symbols = _symbols(alt)
            node, i = root, 0
            while True:
                if node.tail is not None:  # make way: the waiting rest moves down one symbol
                    waiting, node.tail = node.tail, None
                    moved = node.children[waiting[0]] = _Node(waiting[1:] or None)
                    moved.end = len(waiting) == 1
                if i == len(symbols):
                    node.end = True
                    break
                child = node.children.get(symbols[i])
                if child is None:
                    new = node.children[symbols[i]] = _Node(symbols[i + 1 :] or None)
                    new.end = i + 1 == len(symbols)
                    break
                node, i = child, i + 1
        # Only nodes where paths meet or end get rules; chains between them become sequences.
        order: list[_Node] = []
        pending = [root]
        while pending:
            node = pending.pop()
            order.append(node)
            stops = (_chain_end(child)[1] for child in node.children.values())
            pending.extend(stop for stop in stops if _forks(stop))
        done: dict[int, list[Seq]] = {}
        for node in reversed(order):
            if id(node) in done:
                continue
            branches: list[Seq] = [()] if node.end else []
            if node.tail is not None:
                branches.append(_symbols_seq(node.tail))
            for symbol, child in node.children.items():
                path, stop = _chain_end(child)
                rest: Seq = (
                    self.inline(done[id(stop)], hint)
                    if _forks(stop)
                    else _symbols_seq(stop.tail)
                    if stop.tail is not None
                    else ()
                )
                branches.append(seq(_symbols_seq([symbol, *path]), rest))
            done[id(node)] = _merge_heads(branches)
        return done[id(root)]

    def render(self, root: Sequence[Seq]) -> str:
        """The GBNF text, rule `root` first, once every limit holds (GrammarLimitError otherwise)."""
        self._rules["root"] = tuple(root) if root else ((NEVER,),)
        self._origins.setdefault("root", self.origin)
        reachable = self._reachable()
        _Analysis(reachable, self._origins, self._weights).check()
        # An empty alternative is written `""`, and first: after a bare trailing `|` (or `::=`)
        # llama.cpp reads on past the newline and takes the next rule's name as part of this one.
        lines = [
            f"{name} ::= "
            + " | ".join(
                " ".join(_atom_text(a) for a in alt) if alt else '""' for alt in sorted(alts, key=bool)
            )
            for name, alts in reachable.items()
        ]
        text = "\n".join(lines) + "\n"
        if len(text) > MAX_GRAMMAR_BYTES:
            raise GrammarLimitError(
                f"the grammar would be {len(text):,} bytes; the most this server "
                f"allows is {MAX_GRAMMAR_BYTES:,}",
                None,
                MAX_GRAMMAR_BYTES,
            )
        return text

    def _reachable(self) -> dict[str, tuple[Seq, ...]]:
        out: dict[str, tuple[Seq, ...]] = {"root": self._rules["root"]}
        pending = deque(["root"])
        while pending:
            for alt in out[pending.popleft()]:
                for ref in _refs(alt):
                    if ref not in out:
                        out[ref] = self._rules[ref]
                        pending.append(ref)
        return out


def _sanitize(hint: str) -> str:
    clean = "".join(c if c.isascii() and (c.isalnum() or c == "-") else "-" for c in hint.lower())[:24]
    return clean.strip("-") or "r"


def _refs(alt: Seq) -> Iterable[str]:
    for atom in alt:
        inner = atom.atom if isinstance(atom, Rep) else atom
        if isinstance(inner, Ref):
            yield inner.name


def _head(alt: Seq) -> str | Atom | None:
    if not alt:
        return None
    first = alt[0]
    return first.text[0] if isinstance(first, Lit) else first


def _symbols(alt: Seq) -> list[str | Atom]:
    out: list[str | Atom] = []
    for atom in alt:
        if isinstance(atom, Lit):
            out.extend(atom.text)
        else:
            out.append(atom)
    return out


def _forks(node: _Node) -> bool:
    """True when more than one way goes on from `node` (it needs alternatives of its own)."""
    return bool(node.children) or (node.end and node.tail is not None)


def _chain_end(node: _Node) -> tuple[list[str | Atom], _Node]:
    """Follow single-child nodes that end nothing; the symbols on the way and where it stops."""
    path: list[str | Atom] = []
    while not node.end and node.tail is None and len(node.children) == 1:
        symbol, node = next(iter(node.children.items()))
        path.append(symbol)
    return path, node


def _symbols_seq(symbols: list[str | Atom]) -> Seq:
    """Trie symbols as atoms: runs of characters joined into one literal (in linear time)."""
    out: list[Atom] = []
    run: list[str] = []
    for symbol in symbols:
        if isinstance(symbol, str):
            run.append(symbol)
            continue
        if run:
            out.append(Lit("".join(run)))
            run = []
        out.append(symbol)
    if run:
        out.append(Lit("".join(run)))
    return tuple(out)


def _merge_heads(branches: list[Seq]) -> list[Seq]:
    """Branches `c rest` with the same rest and a one-character head c: one class for the heads."""
    groups: dict[Seq, list[int]] = {}
    out: list[Seq] = []
    for branch in branches:
        head = branch[0] if branch else None
        if isinstance(head, Lit):
            rest = seq(Lit(head.text[1:]) if len(head.text) > 1 else (), branch[1:])
            groups.setdefault(rest, []).append(ord(head.text[0]))
        else:
            out.append(branch)
    for rest, heads in groups.items():
        first: Atom = Lit(chr(heads[0])) if len(heads) == 1 else Chars(norm((c, c) for c in heads))
        out.append(seq(first, rest))
    return out


class _Analysis:
    """What llama.cpp will do with the rules: expansion sizes, left recursion, stacks at once."""

    def __init__(
        self, rules: dict[str, tuple[Seq, ...]], origins: dict[str, Origin], weights: dict[str, int]
    ) -> None:
        self.rules = rules
        self.origins = origins
        self.weights = weights
        self.states: dict[str, int] = {}  # pattern states that may start with a rule
        self.nullable: dict[str, bool] = dict.fromkeys(rules, False)
        self.first: dict[str, int] = {}
        self.cont_from: dict[str, tuple[str, Seq, int]] = {}  # where a rule's largest continuation comes from

    def fail(self, name: str, message: str, limit: int | None) -> GrammarLimitError:
        return GrammarLimitError(message, self.origins.get(name), limit)

    def check(self) -> None:
        self._sizes()
        self._nullable()
        self._leftmost()
        self._stacks()

    def _sizes(self) -> None:
        rules = elements = 0
        for alts in self.rules.values():
            rules += 1
            for alt in alts:
                elements += 1 + sum(_elements(a) for a in alt)
                rules += sum(_rep_rules(a) for a in alt if isinstance(a, Rep))
        if rules > MAX_GRAMMAR_RULES:
            raise GrammarLimitError(
                f"the grammar would have {rules:,} rules once repetitions are expanded; "
                f"the most this server allows is {MAX_GRAMMAR_RULES:,}",
                None,
                MAX_GRAMMAR_RULES,
            )
        if elements > MAX_GRAMMAR_ELEMENTS:
            raise GrammarLimitError(
                f"the grammar would have {elements:,} elements once repetitions are "
                "expanded; the most this server allows is "
                f"{MAX_GRAMMAR_ELEMENTS:,}",
                None,
                MAX_GRAMMAR_ELEMENTS,
            )

    def atom_nullable(self, atom: Atom) -> bool:
        if isinstance(atom, Ref):
            return self.nullable[atom.name]
        if isinstance(atom, Rep):
            return atom.lo == 0 or self.atom_nullable(atom.atom)
        return False

    def _nullable(self) -> None:
        users: dict[str, set[str]] = {name: set() for name in self.rules}
        for name, alts in self.rules.items():
            for alt in alts:
                for ref in _refs(alt):
                    users[ref].add(name)
        pending = list(self.rules)
        while pending:
            name = pending.pop()
            if not self.nullable[name] and any(all(map(self.atom_nullable, alt)) for alt in self.rules[name]):
                self.nullable[name] = True
                pending.extend(users[name])

    def atom_first(self, atom: Atom) -> int:
        if isinstance(atom, Ref):
            return self.first[atom.name]
        if isinstance(atom, Rep):
            return self.atom_first(atom.atom)
        return 1

    def _leftmost_refs(self, name: str) -> list[str]:
        out = []
        for alt in self.rules[name]:
            for atom in alt:
                inner = atom.atom if isinstance(atom, Rep) else atom
                if isinstance(inner, Ref):
                    out.append(inner.name)
                if not self.atom_nullable(atom):
                    break
        return out

    def _leftmost(self) -> None:
        """First sets and depth along leftmost references, which must not loop (left recursion)."""
        depth: dict[str, int] = {}
        state: dict[str, int] = {}  # 1: on the path, 2: done
        for start in self.rules:
            if start in state:
                continue
            state[start] = 1
            path = [(start, iter(self._leftmost_refs(start)))]
            while path:
                name, refs = path[-1]
                nxt = next(refs, None)
                if nxt is None:
                    path.pop()
                    state[name] = 2
                    self.first[name] = sum(self._seq_first(alt) for alt in self.rules[name])
                    leftmost = self._leftmost_refs(name)
                    self.states[name] = self.weights.get(name) or sum(self.states[r] for r in leftmost)
                    if self.states[name] > MAX_PATTERN_STATES:
                        raise self._too_many_states(name, self.states[name])
                    depth[name] = 1 + max((depth[r] for r in leftmost), default=0)
                    if depth[name] > MAX_GRAMMAR_DEPTH:
                        raise self.fail(
                            name,
                            f"the grammar would nest more than {MAX_GRAMMAR_DEPTH} rules "
                            "before its first character",
                            MAX_GRAMMAR_DEPTH,
                        )
                elif state.get(nxt) == 1:
                    raise self.fail(
                        nxt, "the schema refers back to itself before any value begins (left recursion)", None
                    )
                elif nxt not in state:
                    state[nxt] = 1
                    path.append((nxt, iter(self._leftmost_refs(nxt))))

    def _seq_first(self, alt: Seq) -> int:
        total = 0
        for atom in alt:
            total += self.atom_first(atom)
            if not self.atom_nullable(atom):
                break
        return total

    def _too_many_states(self, name: str, count: int) -> GrammarLimitError:
        culprit = name
        if self.origins.get(name) is _BUILTIN_ORIGIN or name not in self.weights:
            weighted = [r for r in self._leftmost_refs(name) if self.states.get(r)]
            culprit = max(weighted, key=self.states.__getitem__, default=name)
        return self.fail(
            culprit,
            f"patterns that may be matched at once would have {count:,} states; the "
            f"most this server allows is {MAX_PATTERN_STATES:,}",
            MAX_PATTERN_STATES,
        )

    def _suffixes(self, alt: Seq) -> list[tuple[int, bool, int]]:
        """Per position of `alt` and its end: the stacks starting there, whether the rest may be
        empty, and the pattern states starting there."""
        out = [(0, True, 0)] * (len(alt) + 1)
        for i in range(len(alt) - 1, -1, -1):
            first, empty, states = out[i + 1]
            atom = alt[i]
            inner = atom.atom if isinstance(atom, Rep) else atom
            own = self.states[inner.name] if isinstance(inner, Ref) else 0
            if self.atom_nullable(atom):
                out[i] = (self.atom_first(atom) + first, empty, own + states)
            else:
                out[i] = (self.atom_first(atom), False, own)
        return out

    def _stacks(self) -> None:
        """The most alternatives followed at once: after any atom, what may come next, including
        what follows the rule (its continuation, the most over its uses) when the rest is empty."""
        cont: dict[str, int] = dict.fromkeys(self.rules, 0)
        cont["root"] = 1  # the end of the reply
        # References, with what may follow each; positions whose rest may be empty (they need cont).
        # The rest of a sequence is kept as (sequence, index): slicing every position is quadratic.
        sites: dict[str, list[tuple[str, int, bool, Seq, int]]] = {}
        tails: list[tuple[str, int, Seq, int]] = []
        for name, alts in self.rules.items():
            own: list[tuple[str, int, bool, Seq, int]] = []
            for alt in alts:
                suffix = self._suffixes(alt)
                if suffix[0][2] > MAX_PATTERN_STATES:
                    raise self._too_many_states(name, suffix[0][2])
                for i, atom in enumerate(alt):
                    first, empty, _ = suffix[i + 1]
                    inner = atom.atom if isinstance(atom, Rep) else atom
                    again = self.atom_first(inner) if isinstance(atom, Rep) and atom.hi != 1 else 0
                    if isinstance(inner, Ref):
                        own.append((inner.name, first + again, empty, alt, i + 1))
                    if empty:
                        tails.append((name, first + again, alt, i + 1))
                    elif first + again > MAX_GRAMMAR_CHOICES:
                        raise self._too_many(name, first + again, alt[i + 1 :])
            sites[name] = own
            if self.first[name] > MAX_GRAMMAR_CHOICES:
                raise self._too_many(name, self.first[name], self._leftmost_atoms(name))
        pending = list(self.rules)
        while pending:
            name = pending.pop()
            for ref, first, empty, alt, at in sites[name]:
                after = first + (cont[name] if empty else 0)
                if after > cont[ref]:
                    if after > MAX_GRAMMAR_CHOICES:
                        raise self._too_many(name, after, alt[at:])
                    cont[ref] = after
                    self.cont_from[ref] = (name, alt, at)
                    pending.append(ref)
        worst = self.first["root"] + (1 if self.nullable["root"] else 0)
        if worst > MAX_GRAMMAR_CHOICES:
            raise self._too_many("root", worst, self._leftmost_atoms("root"))
        for name, first, alt, at in tails:
            if first + cont[name] > MAX_GRAMMAR_CHOICES:
                raise self._too_many(name, first + cont[name], alt[at:])

    def _biggest(self, atoms: Sequence[Atom]) -> str | None:
        best, culprit = 0, None
        pending = list(atoms)
        seen: set[str] = set()
        while pending:
            atom = pending.pop()
            inner = atom.atom if isinstance(atom, Rep) else atom
            if not isinstance(inner, Ref) or inner.name in seen:
                continue
            seen.add(inner.name)
            if self.origins.get(inner.name) is _BUILTIN_ORIGIN:
                continue
            if self.first[inner.name] > best:
                best, culprit = self.first[inner.name], inner.name
        return culprit

    def _leftmost_atoms(self, name: str) -> list[Atom]:
        return [atom for alt in self.rules[name] for atom in alt]

    def _too_many(self, name: str, count: int, atoms: Sequence[Atom]) -> GrammarLimitError:
        """The error, blamed on the rule that brings the most alternatives (not a built-in one): one
        of those that may come next, else the rule itself, else where its continuation comes from."""
        culprit = None
        visited: set[str] = set()
        while culprit is None and name not in visited:
            visited.add(name)
            culprit = self._biggest(atoms)
            if culprit is None and self.origins.get(name) is not _BUILTIN_ORIGIN:
                culprit = name
            elif culprit is None and name in self.cont_from:
                name, alt, at = self.cont_from[name]
                atoms = alt[at:]
        return self.fail(
            culprit or name,
            f"the grammar would offer {count:,} alternatives at one point of "
            "the reply (enum values, anyOf branches, types and optional properties add up); the "
            f"most this server allows is {MAX_GRAMMAR_CHOICES}",
            MAX_GRAMMAR_CHOICES,
        )


# ---- characters of a set, as JSON string text -------------------------------------------------


def set_atom(g: Grammar, ranges: Ranges) -> Atom:
    """One atom matching the JSON spelling of one character of `ranges` (raw, or escaped where JSON must)."""
    raw = intersect(ranges, RAW)
    escaped = [c for c in ESCAPED if contains(ranges, c)]
    if not escaped:
        return Lit(chr(raw[0][0])) if len(raw) == 1 and raw[0][0] == raw[0][1] else Chars(raw)
    if not raw and len(escaped) == 1:
        return Lit(json_unit(escaped[0]))
    alts: list[Seq] = [(Chars(raw),)] if raw else []
    if len(escaped) == 1:
        alts.append((Lit(json_unit(escaped[0])),))
    else:
        alts.append((Lit("\\"), g.named(escape_tails(escaped), "esc")))
    return g.named(alts, "set")


def escape_tails(escaped: list[int]) -> list[Seq]:
    """What may follow a backslash to spell one of `escaped` (code points JSON must escape)."""
    letters = [ord(_SHORT_ESCAPES[c]) for c in escaped if c in _SHORT_ESCAPES]
    tails: list[Seq] = [(Chars(norm((c, c) for c in letters)),)] if letters else []
    by_high: dict[str, list[int]] = {}
    for c in escaped:
        if c not in _SHORT_ESCAPES:
            by_high.setdefault(f"u00{c >> 4:x}", []).append(ord(f"{c & 15:x}"))
    for head, lows in by_high.items():
        if len(lows) == 1:
            tails.append((Lit(head + chr(lows[0])),))
        else:
            tails.append((Lit(head), Chars(norm((c, c) for c in lows))))
    return tails
