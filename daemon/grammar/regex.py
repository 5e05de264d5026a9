"""JSON-schema `pattern`s (an ECMA-262 regex subset) as rules for the JSON text of the strings they match.

Supported: literals, escapes (\\d \\w \\s \\D \\W \\S, \\n \\r \\t \\f \\v \\0, \\xHH, \\uHHHH,
\\u{H...}, \\cX, escaped punctuation), classes with ranges and negation, `.` (no line
terminators), groups `(...)` and `(?:...)`, alternation, `* + ? {m} {m,} {m,n}` greedy or
lazy, `^`/`$` at the start/end of the pattern or of a top-level alternative. A pattern
matches anywhere in the string unless anchored. Code points, not UTF-16 units, as with the
u flag. Refused with the feature named: back-references, lookaround, named groups, other
`(?...)` forms, word boundaries, Unicode property escapes, octal escapes, lone surrogates,
unbalanced brackets, anchors elsewhere, a quantifier with nothing to repeat or after another,
`{`, `}` and `]` standing for themselves (escape them, as the u flag requires).

Limits: MAX_PATTERN_LENGTH characters, MAX_PATTERN_NESTING groups deep, quantifier bounds up
to MAX_REPETITION, and MAX_PATTERN_STATES positions once counted repetitions are written out
(grammar.rules: llama.cpp keeps one stack per repetition count an ambiguous text leaves open). A
repeated part that can match "" is repeated without its empty match ((a?)* is (a)*), which
llama.cpp would otherwise follow along every count at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from edgellmd.grammar.rules import (
    MAX_CODE_POINT,
    MAX_PATTERN_STATES,
    MAX_REPETITION,
    Grammar,
    Lit,
    Ranges,
    Rep,
    Seq,
    complement,
    norm,
    seq,
    set_atom,
)

MAX_PATTERN_LENGTH: Final = 1_000  # characters of one `pattern`
MAX_PATTERN_NESTING: Final = 16  # groups inside groups in one `pattern`


class PatternError(Exception):
    """A `pattern` outside the supported regex subset or its limits; the message names the feature."""

    def __init__(self, message: str, *, limit: int | None = None, unsupported: bool = False) -> None:
        super().__init__(message)
        self.message = message
        self.limit = limit
        self.unsupported = unsupported


# ---- regexes ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, eq=False)
class _Set:
    ranges: Ranges


@dataclass(frozen=True, slots=True, eq=False)
class _Cat:
    items: tuple[_Re, ...]


@dataclass(frozen=True, slots=True, eq=False)
class _Alt:
    options: tuple[_Re, ...]


@dataclass(frozen=True, slots=True, eq=False)
class _Rep:
    item: _Re
    lo: int
    hi: int | None


_Re = _Set | _Cat | _Alt | _Rep

DIGIT: Final = ((0x30, 0x39),)
WORD: Final = norm([(0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A)])
SPACE: Final = norm(
    [
        (0x09, 0x0D),
        (0x20, 0x20),
        (0xA0, 0xA0),
        (0x1680, 0x1680),
        (0x2000, 0x200A),
        (0x2028, 0x2029),
        (0x202F, 0x202F),
        (0x205F, 0x205F),
        (0x3000, 0x3000),
        (0xFEFF, 0xFEFF),
    ]
)
DOT: Final = complement(norm([(0x0A, 0x0A), (0x0D, 0x0D), (0x2028, 0x2029)]))  # no line terminators
_CLASS_ESCAPES: Final = {
    "d": DIGIT,
    "D": complement(DIGIT),
    "w": WORD,
    "W": complement(WORD),
    "s": SPACE,
    "S": complement(SPACE),
}
_CONTROL_ESCAPES: Final = {"n": 0x0A, "r": 0x0D, "t": 0x09, "f": 0x0C, "v": 0x0B}
_HEX: Final = frozenset("0123456789abcdefABCDEF")


@dataclass(slots=True)
class _Frame:
    options: list[list[_Re]]
    items: list[_Re]
    quantified: bool = False  # the last item carries a quantifier already


@dataclass(frozen=True, slots=True)
class Branch:
    """A top-level alternative of a pattern and whether `^`/`$` anchor it."""

    node: _Re
    start: bool
    end: bool


class _Parser:
    def __init__(self, pattern: str) -> None:
        if len(pattern) > MAX_PATTERN_LENGTH:
            raise PatternError(
                f"is {len(pattern):,} characters long; the most this server allows is {MAX_PATTERN_LENGTH:,}",
                limit=MAX_PATTERN_LENGTH,
            )
        self.p = pattern
        self.i = 0

    def error(self, what: str, *, unsupported: bool = False) -> PatternError:
        return PatternError(f"{what} (at character {self.i + 1})", unsupported=unsupported)

    def parse(self) -> list[Branch]:
        p = self.p
        frames = [_Frame([], [])]
        branches: list[Branch] = []
        start = end = False
        while self.i < len(p):
            c = p[self.i]
            frame = frames[-1]
            if c == "(":
                frames.append(_Frame([], []))
                self.i += self._group_opening()
                if len(frames) - 1 > MAX_PATTERN_NESTING:
                    raise PatternError(
                        f"nests groups {len(frames) - 1} deep (at character {self.i + 1}); "
                        f"the most this server allows is {MAX_PATTERN_NESTING}",
                        limit=MAX_PATTERN_NESTING,
                    )
                continue
            if c == ")":
                if len(frames) == 1:
                    raise self.error("has an unbalanced ')'")
                frames.pop()
                frames[-1].items.append(_alternation([*frame.options, frame.items]))
                frames[-1].quantified = False
            elif c == "|":
                if len(frames) == 1:
                    branches.append(Branch(_Cat(tuple(frame.items)), start, end))
                    frame.items, start, end = [], False, False
                else:
                    frame.options.append(frame.items)
                    frame.items = []
                frame.quantified = False
            elif c in "*+?{":
                self._quantifier(frame)
                continue
            elif c == "^":
                if len(frames) > 1 or frame.items or start:
                    raise self.error(
                        "'^' is supported only at the start of the pattern or of a top-level alternative",
                        unsupported=True,
                    )
                start = True
            elif c == "$":
                if len(frames) > 1 or (self.i + 1 < len(p) and p[self.i + 1] != "|"):
                    raise self.error(
                        "'$' is supported only at the end of the pattern or of a top-level alternative",
                        unsupported=True,
                    )
                end = True
                self.i += 1
                if self.i < len(p):  # the '|' that follows
                    branches.append(Branch(_Cat(tuple(frame.items)), start, end))
                    frame.items, start, end = [], False, False
                    self.i += 1
                continue
            else:
                frame.items.append(self._atom())
                frame.quantified = False
                continue
            self.i += 1
        if len(frames) > 1:
            raise self.error("has an unbalanced '('")
        branches.append(Branch(_Cat(tuple(frames[0].items)), start, end))
        return branches

    def _group_opening(self) -> int:
        rest = self.p[self.i : self.i + 4]
        if not rest.startswith("(?"):
            return 1
        if rest.startswith("(?:"):
            return 3
        if rest.startswith(("(?=", "(?!", "(?<=", "(?<!")):
            raise self.error("lookaround assertions are not supported", unsupported=True)
        if rest.startswith("(?<"):
            raise self.error("named groups are not supported", unsupported=True)
        raise self.error("'(?' forms other than '(?:' (flags, modifiers) are not supported", unsupported=True)

    def _quantifier(self, frame: _Frame) -> None:
        p = self.p
        c = p[self.i]
        if c == "{":
            lo, hi, length = self._braces()
        else:
            lo, hi, length = {"*": (0, None, 1), "+": (1, None, 1), "?": (0, 1, 1)}[c]
        if not frame.items:
            raise self.error("has a quantifier with nothing to repeat")
        if frame.quantified:
            raise self.error("has a quantifier after a quantifier")
        self.i += length
        if self.i < len(p) and p[self.i] == "?":
            self.i += 1  # lazy: the same strings
        frame.items[-1] = _Rep(frame.items[-1], lo, hi)
        frame.quantified = True

    def _braces(self) -> tuple[int, int | None, int]:
        p, i = self.p, self.i + 1
        numbers: list[str] = [""]
        while i < len(p) and ((p[i].isdigit() and p[i].isascii()) or (p[i] == "," and len(numbers) == 1)):
            if p[i] == ",":
                numbers.append("")
            else:
                numbers[-1] += p[i]
            i += 1
        if i >= len(p) or p[i] != "}" or not numbers[0]:
            raise self.error("'{' must start a quantifier {m}, {m,} or {m,n} (write \\{ for the character)")
        for number in numbers:
            if len(number) > 7 or (number and int(number) > MAX_REPETITION):
                shown = f"{int(number):,}" if len(number) <= 7 else "over 9,999,999"
                raise PatternError(
                    f"has a quantifier bound of {shown} (at character {self.i + 1}); the most "
                    f"this server allows is {MAX_REPETITION:,}",
                    limit=MAX_REPETITION,
                )
        lo = int(numbers[0])
        hi = lo if len(numbers) == 1 else int(numbers[1]) if numbers[1] else None
        if hi is not None and hi < lo:
            raise self.error("has a quantifier {m,n} with n < m")
        return lo, hi, i + 1 - self.i

    def _atom(self) -> _Re:
        c = self.p[self.i]
        if c == ".":
            self.i += 1
            return _Set(DOT)
        if c == "[":
            return _Set(self._class())
        if c == "\\":
            return _Set(self._escape(in_class=False))
        if c in "]}":
            raise self.error(f"has an unbalanced '{c}' (write \\{c} for the character)")
        self.i += 1
        return _Set(self._code_point(c))

    def _code_point(self, c: str) -> Ranges:
        if 0xD800 <= ord(c) <= 0xDFFF:
            raise self.error("has a lone surrogate")
        return ((ord(c), ord(c)),)

    def _class(self) -> Ranges:
        p = self.p
        self.i += 1
        negate = self.i < len(p) and p[self.i] == "^"
        self.i += negate
        parts: list[tuple[int, int]] = []
        while True:
            if self.i >= len(p):
                raise self.error("has an unbalanced '['")
            if p[self.i] == "]":
                self.i += 1
                break
            lo_set = self._class_atom()
            if self.i + 1 < len(p) and p[self.i] == "-" and p[self.i + 1] != "]":
                self.i += 1
                hi_set = self._class_atom()
                if not _single(lo_set) or not _single(hi_set):
                    raise self.error("has a class range whose end is a class escape such as \\d")
                if hi_set[0][0] < lo_set[0][0]:
                    raise self.error("has a class range out of order")
                parts.append((lo_set[0][0], hi_set[0][0]))
            else:
                parts.extend(lo_set)
        ranges = norm(parts)
        if negate:
            ranges = complement(ranges)
        if not ranges:
            raise self.error("has an empty class, which matches nothing")
        return ranges

    def _class_atom(self) -> Ranges:
        c = self.p[self.i]
        if c == "\\":
            return self._escape(in_class=True)
        self.i += 1
        return self._code_point(c)

    def _escape(self, *, in_class: bool) -> Ranges:
        p, i = self.p, self.i
        if i + 1 >= len(p):
            raise self.error("ends with a lone '\\'")
        c = p[i + 1]
        self.i += 2
        if c in _CLASS_ESCAPES:
            return _CLASS_ESCAPES[c]
        if c == "b" and in_class:
            return ((8, 8),)
        if c in "bB":
            raise self.error("word-boundary assertions (\\b, \\B) are not supported", unsupported=True)
        if c in _CONTROL_ESCAPES:
            return ((_CONTROL_ESCAPES[c],) * 2,)
        if c == "0":
            if self.i < len(p) and p[self.i].isdigit():
                raise self.error("octal escapes are not supported", unsupported=True)
            return ((0, 0),)
        if c in "123456789":
            raise self.error("back-references are not supported", unsupported=True)
        if c == "k":
            raise self.error("named back-references are not supported", unsupported=True)
        if c in "pP":
            raise self.error("Unicode property escapes (\\p, \\P) are not supported", unsupported=True)
        if c == "x":
            return self._point(self._hex_digits(2))
        if c == "u":
            return self._unicode_escape()
        if c == "c":
            if self.i < len(p) and p[self.i].isascii() and p[self.i].isalpha():
                self.i += 1
                return ((ord(p[self.i - 1]) % 32,) * 2,)
            raise self.error("has \\c without a control letter")
        if c.isascii() and c.isalnum():
            raise self.error(f"has an unknown escape \\{c}")
        return self._code_point(c)

    def _hex_digits(self, count: int) -> int:
        digits = self.p[self.i : self.i + count]
        if len(digits) != count or not set(digits) <= _HEX:
            raise self.error(f"has an escape that needs {count} hex digits")
        self.i += count
        return int(digits, 16)

    def _point(self, c: int) -> Ranges:
        if c > MAX_CODE_POINT:
            raise self.error("has an escape past U+10FFFF")
        if 0xD800 <= c <= 0xDFFF:
            raise self.error("has a lone surrogate")
        return ((c, c),)

    def _unicode_escape(self) -> Ranges:
        p = self.p
        if self.i < len(p) and p[self.i] == "{":
            end = p.find("}", self.i)
            digits = p[self.i + 1 : end] if end > 0 else ""
            if not digits or len(digits) > 6 or not set(digits) <= _HEX:
                raise self.error("has a \\u{...} escape without 1 to 6 hex digits")
            self.i = end + 1
            return self._point(int(digits, 16))
        c = self._hex_digits(4)
        if 0xD800 <= c <= 0xDBFF and p.startswith("\\u", self.i):  # a pair in two escapes
            saved = self.i
            self.i += 2
            low = self._hex_digits(4)
            if 0xDC00 <= low <= 0xDFFF:
                return self._point(0x10000 + ((c - 0xD800) << 10) + (low - 0xDC00))
            self.i = saved
        return self._point(c)


def _single(ranges: Ranges) -> bool:
    return len(ranges) == 1 and ranges[0][0] == ranges[0][1]


def _alternation(options: list[list[_Re]]) -> _Re:
    nodes = [_Cat(tuple(items)) for items in options]
    return nodes[0] if len(nodes) == 1 else _Alt(tuple(nodes))


def parse_pattern(pattern: str) -> list[Branch]:
    """Parse a `pattern` (PatternError outside the subset or its limits); its top-level alternatives."""
    branches = _Parser(pattern).parse()
    count = sum(states(b.node) for b in branches)
    if count > MAX_PATTERN_STATES:
        raise PatternError(
            f"has {count:,} states once its counted repetitions are written out (x{{m,n}} "
            f"counts n times x, nested ones multiply); the most this server allows is "
            f"{MAX_PATTERN_STATES:,}",
            limit=MAX_PATTERN_STATES,
        )
    return branches


def states(node: _Re) -> int:
    """Positions of `node` once llama.cpp writes out its repetitions (recursion: one level per group)."""
    if isinstance(node, _Set):
        return 1
    if isinstance(node, _Cat):
        return sum(states(n) for n in node.items)
    if isinstance(node, _Alt):
        return sum(states(n) for n in node.options)
    copies = node.hi if node.hi is not None else node.lo + 1
    return max(copies, 1) * states(node.item) if node.hi != 0 else 0


class _Converter:
    """Regex nodes as grammar sequences; any part that can match "" is never repeated as such."""

    def __init__(self, g: Grammar) -> None:
        self.g = g
        self._nullable: dict[int, bool] = {}

    def nullable(self, node: _Re) -> bool:
        key = id(node)
        if key not in self._nullable:
            if isinstance(node, _Set):
                value = False
            elif isinstance(node, _Cat):
                value = all(self.nullable(n) for n in node.items)
            elif isinstance(node, _Alt):
                value = any(self.nullable(n) for n in node.options)
            else:
                value = node.lo == 0 or node.hi == 0 or self.nullable(node.item)
            self._nullable[key] = value
        return self._nullable[key]

    def alts(self, node: _Re) -> list[Seq]:
        if isinstance(node, _Set):
            return [(set_atom(self.g, node.ranges),)]
        if isinstance(node, _Cat):
            return [seq(*(self.one(item) for item in node.items))]
        if isinstance(node, _Alt):
            return [alt for option in node.options for alt in self.alts(option)]
        return [self._repeat(node)]

    def one(self, node: _Re) -> Seq:
        return self.g.inline(self.alts(node), "re")

    def _repeat(self, node: _Rep) -> Seq:
        lo, hi = node.lo, node.hi
        if hi == 0:
            return ()
        if self.nullable(node.item):
            if hi == 1:
                return self.one(node.item)  # (x)? is x when x matches ""
            nonempty = self.nonempty(node.item)
            if not nonempty:
                return ()
            lo, body = 0, self.g.inline(nonempty, "re")
        else:
            body = self.one(node.item)
        atom = self.g.atom(body, "re")
        return (atom,) if (lo, hi) == (1, 1) else (Rep(atom, lo, hi),)

    def nonempty(self, node: _Re) -> list[Seq]:
        """Alternatives for the non-empty strings `node` matches."""
        if not self.nullable(node):
            return self.alts(node)
        if isinstance(node, _Alt):
            return [alt for option in node.options for alt in self.nonempty(option)]
        if isinstance(node, _Rep):
            if node.hi == 0:
                return []
            inner = self.nonempty(node.item)
            if not inner:
                return []
            atom = self.g.atom(self.g.inline(inner, "re"), "re")
            if node.hi == 1:
                return [(atom,)]
            return [(atom, Rep(atom, 0, None if node.hi is None else node.hi - 1))]
        if not isinstance(node, _Cat):  # pragma: no cover - a _Set never matches ""
            return self.alts(node)
        # x1 x2 ... xk, each able to match "": the first non-empty one is some xi, then the
        # rest as it is. The rests are rules chained from the end, so the size stays linear.
        out: list[Seq] = []
        tail: Seq = ()
        for item in reversed(node.items):
            out.extend(seq(alt, tail) for alt in self.nonempty(item))
            whole = seq(self.one(item), tail)
            tail = whole if len(whole) <= 1 else (self.g.named([whole], "re"),)
        return out


def pattern_alternatives(g: Grammar, pattern: str) -> list[Seq]:
    """Alternatives for the JSON text (quotes included) of the strings `pattern` matches.

    ECMA-262 semantics: a pattern matches anywhere in the string unless anchored by `^`/`$`.
    """
    branches = parse_pattern(pattern)
    anything = Rep(g.builtin("char"), 0, None)
    converter = _Converter(g)
    bodies: list[Seq] = []
    for branch in branches:
        bodies.extend(
            seq(() if branch.start else (anything,), body, () if branch.end else (anything,))
            for body in converter.alts(branch.node)
        )
    # One rule for the whole pattern, weighed with its states (see MAX_PATTERN_STATES).
    rule = g.named(g.factor(bodies, "pattern"), "pattern")
    g.weigh(rule, sum(states(b.node) for b in branches))
    return [(Lit('"'), rule, Lit('"'))]
