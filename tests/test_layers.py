"""The daemon's architecture, held: layers as folders, imports only pointing down, no private names shared.

http -> api -> models -> engine, with host, settings and the leaves (grammar, errors, files) below them
all (DESIGN.md, "The daemon"). Imports under `if TYPE_CHECKING:` and inside functions count
too: a layer that needs another's types to be annotated depends on it.
"""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Final

import pytest

DAEMON: Final = Path(__file__).resolve().parent.parent / "daemon"
# Higher may import lower (and its own layer), never the other way.
RANKS: Final = {
    "__main__": 7,
    "http": 6,
    "api": 5,
    "models": 4,
    "engine": 3,
    "settings": 2,  # reads host's CPU-list syntax
    "host": 1,
    "grammar": 0,  # a leaf: the schema and regex to GBNF compiler imports nothing of edgellmd
    "keys": 0,  # the keys file: read by the front door and written by edgellmctl, which has none
    "ledger": 0,  # usage, quotas and the audit chain in SQLite: written by the daemon, verified by edgellmctl
    "errors": 0,
    "files": 0,
    "redaction": 0,
    "": 0,  # the package itself: its version
}


def _module(path: Path, root: Path = DAEMON) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(("edgellmd", *parts))


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _imports(path: Path, root: Path = DAEMON) -> list[tuple[int, str, list[str]]]:
    """(line, module, names) of every edgellmd import in a file; relative imports resolved."""
    tree = ast.parse(path.read_text(), filename=str(path))
    here = _module(path, root).split(".")
    package = here if path.name == "__init__.py" else here[:-1]
    out: list[tuple[int, str, list[str]]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name, []) for a in node.names if a.name.startswith("edgellmd")]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            if base.startswith("edgellmd"):
                names = [a.name for a in node.names]
                out.append((node.lineno, base, names))
                # `from edgellmd.host import cpu` imports the module edgellmd.host.cpu
                out += [
                    (node.lineno, f"{base}.{n}", [])
                    for n in names
                    if (root / Path(*f"{base}.{n}".split(".")[1:])).with_suffix(".py").exists()
                ]
    return out


SOURCES: Final = sorted(DAEMON.rglob("*.py"))


def test_every_module_belongs_to_a_known_layer() -> None:
    unknown = {_module(p) for p in SOURCES if _layer(_module(p)) not in RANKS}
    assert not unknown, f"modules outside the layers of DESIGN.md: {sorted(unknown)}"


def test_the_layers_are_the_folders_of_design_md() -> None:
    folders = {p.name for p in DAEMON.iterdir() if p.is_dir() and not p.name.startswith(("_", "."))}
    # ledger/: usage, quotas and the audit chain, a leaf like grammar/ (DESIGN.md plans SQLite for them)
    assert folders == {"http", "api", "models", "engine", "host", "grammar", "ledger", "settings"}


def test_no_two_modules_import_each_other_even_by_a_detour() -> None:
    """No import circles, counting imports under TYPE_CHECKING and inside functions: a circle
    hidden that way is still two modules that cannot be read apart."""
    known = {_module(p) for p in SOURCES}
    graph = {_module(p): {t for _, t, _ in _imports(p) if t in known and t != _module(p)} for p in SOURCES}
    circles: list[list[str]] = []
    for start in sorted(graph):
        stack: list[tuple[str, list[str]]] = [(start, [start])]
        seen: set[str] = set()
        while stack:
            node, path = stack.pop()
            for nxt in sorted(graph[node]):
                if nxt == start:
                    circles.append(path)
                elif nxt not in seen and nxt > start:  # each circle once, from its least module
                    seen.add(nxt)
                    stack.append((nxt, [*path, nxt]))
    # A package's __init__ that re-exports its modules is not a circle with them.
    circles = [c for c in circles if not any(other.startswith(m + ".") for m in c for other in c)]
    assert not circles, "import circles:\n" + "\n".join(" -> ".join(c) for c in circles)


FAMILIES: Final = ("openai", "responses", "anthropic")


def test_api_families_do_not_import_each_other() -> None:
    """Each family decodes into api/request.py's model and encodes from api/session.py's parts:
    a field of one family is changed in its own folder."""
    wrong = []
    for family in FAMILIES:
        for path in sorted((DAEMON / "api" / family).rglob("*.py")):
            for line, target, _ in _imports(path):
                parts = target.split(".")
                if len(parts) > 2 and parts[1] == "api" and parts[2] in FAMILIES and parts[2] != family:
                    wrong.append(f"{path.relative_to(DAEMON.parent)}:{line}: {target}")
    assert not wrong, "API families importing each other:\n" + "\n".join(wrong)


def test_the_shared_middle_imports_no_family() -> None:
    shared = [
        DAEMON / "api" / name for name in ("request.py", "session.py", "context.py", "reply.py", "fields.py")
    ]
    wrong = [
        f"{path.relative_to(DAEMON.parent)}:{line}: {target}"
        for path in shared
        for line, target, _ in _imports(path)
        if len(target.split(".")) > 2 and target.split(".")[2] in FAMILIES
    ]
    assert not wrong, wrong


def test_the_grammar_compiler_imports_nothing_outside_itself() -> None:
    wrong = [
        f"{path.relative_to(DAEMON.parent)}:{line}: {target}"
        for path in sorted((DAEMON / "grammar").rglob("*.py"))
        for line, target, _ in _imports(path)
        if not target.startswith("edgellmd.grammar")
    ]
    assert not wrong, "the grammar package is a leaf:\n" + "\n".join(wrong)


def test_the_operator_tool_does_not_import_the_front_door() -> None:
    ops = DAEMON.parent / "ops"
    wrong = [
        f"{path.relative_to(DAEMON.parent)}:{line}: {target}"
        for path in sorted(ops.rglob("*.py"))
        for line, target, _ in _imports(path, ops)
        if _layer(target) == "http"
    ]
    assert not wrong, "edgellmctl imports the daemon's HTTP layer:\n" + "\n".join(wrong)


def test_the_console_lives_in_one_place() -> None:
    """The web console's door, pages, stream, sessions and static files: one folder, http/console/."""
    root = DAEMON / "http" / "console"
    elsewhere = [
        str(p.relative_to(DAEMON))
        for p in DAEMON.rglob("*")
        if "console" in p.name and root not in (p, *p.parents) and "__pycache__" not in p.parts
    ]
    assert not elsewhere, f"console code outside daemon/http/console/: {elsewhere}"
    assert {p.name for p in (root / "static").iterdir()} >= {"index.html", "app.js", "app.css"}


def test_every_package_is_in_the_wheel(tmp_path: Path) -> None:
    """pyproject.toml's package list covers every package of both trees: the wheel holds them all."""
    import tomllib  # noqa: PLC0415
    import zipfile  # noqa: PLC0415

    root = DAEMON.parent
    expected = {
        ".".join((name, *p.parent.relative_to(root / tree).parts))
        for name, tree in (("edgellmd", "daemon"), ("edgellmctl", "ops"))
        for p in (root / tree).rglob("__init__.py")
    }
    listed = set(tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    assert expected <= listed, f"packages missing from pyproject.toml: {sorted(expected - listed)}"
    source = tmp_path / "source"  # built from a copy: the build leaves nothing in the checkout
    for tree in ("daemon", "ops"):
        shutil.copytree(root / tree, source / tree, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(root / name, source / name)
    wheel_build = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"]
    subprocess.run([*wheel_build, "-w", str(tmp_path), str(source)], check=True, capture_output=True)
    (wheel,) = tmp_path.glob("edgellm*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = sorted(p for p in expected if p.replace(".", "/") + "/__init__.py" not in names)
    assert not missing, f"packages missing from the wheel: {missing}"


def _upward(paths: list[Path], root: Path = DAEMON) -> list[str]:
    wrong = []
    for path in paths:
        importer = _module(path, root)
        for line, target, _ in _imports(path, root):
            if RANKS[_layer(target)] > RANKS[_layer(importer)]:
                wrong.append(f"{path.relative_to(root.parent)}:{line}: {importer} imports {target}")
    return wrong


def test_imports_only_point_down() -> None:
    wrong = _upward(SOURCES)
    assert not wrong, "imports that point up a layer:\n" + "\n".join(wrong)


def test_an_upward_import_is_found_wherever_it_hides(tmp_path: Path) -> None:
    root = tmp_path / "daemon"
    (root / "engine").mkdir(parents=True)
    (root / "http").mkdir()
    (root / "http" / "appkeys.py").write_text("")
    module = root / "engine" / "chat.py"
    module.write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
        "    from edgellmd.http.appkeys import SETTINGS\n"
        "def later() -> None:\n    from ..http import appkeys\n"
    )
    assert len(_upward([module], root)) == 3  # the module, and `appkeys` imported from the package


def test_no_module_imports_another_modules_private_names() -> None:
    wrong = []
    for path in SOURCES:
        importer = _module(path)
        for line, target, names in _imports(path):
            if target == importer:
                continue
            private = [n for n in names if n.startswith("_") and not re.fullmatch(r"__\w+__", n)]
            if private:
                wrong.append(f"{path.relative_to(DAEMON.parent)}:{line}: {', '.join(private)} from {target}")
    assert not wrong, "private names imported from other modules:\n" + "\n".join(wrong)


def test_only_the_engine_package_imports_llama_cpp() -> None:
    # House rule: the native dependency is quarantined; everything else uses edgellmd.engine.
    root = Path(__file__).resolve().parents[1]
    importers = sorted(
        str(path.relative_to(root))
        for tree in ("daemon", "ops")
        for path in (root / tree).rglob("*.py")
        if re.search(r"^\s*(import llama_cpp|from llama_cpp)", path.read_text(), re.MULTILINE)
    )
    assert importers, "the engine imports llama_cpp somewhere"
    assert all(p.startswith("daemon/engine/") for p in importers), importers


@pytest.mark.parametrize(
    ("importer", "target", "allowed"),
    [
        ("edgellmd.http.app", "edgellmd.api.openai.routes", True),
        ("edgellmd.api.openai.routes", "edgellmd.http.appkeys", False),
        ("edgellmd.models.registry", "edgellmd.engine", True),
        ("edgellmd.engine.scheduler", "edgellmd.models.handle", False),
        ("edgellmd.host.metrics", "edgellmd.models.registry", False),
        ("edgellmd.settings", "edgellmd.host.cpu", True),
    ],
)
def test_the_rule_itself(importer: str, target: str, allowed: bool) -> None:
    assert (RANKS[_layer(target)] <= RANKS[_layer(importer)]) is allowed


# The modules that load llama.cpp: the in-process engines and an engine process's own code.
NATIVE: Final = frozenset(
    f"edgellmd.engine.{m}" for m in ("native", "scheduler", "sampling", "embedding", "draft_model", "worker")
)


def _module_level_imports(path: Path) -> set[str]:
    """edgellmd modules a file imports when it is imported: not in functions, not for types."""
    tree = ast.parse(path.read_text(), filename=str(path))
    here = _module(path).split(".")
    package = here if path.name == "__init__.py" else here[:-1]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            return  # runs when called, not at import
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            return
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("edgellmd"))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            if base.startswith("edgellmd"):
                found.add(base)
                found.update(f"{base}.{a.name}" for a in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def _functions_imports(path: Path) -> set[str]:
    return {t for _, t, _ in _imports(path)} - _module_level_imports(path)


def test_the_daemon_imports_no_native_module_at_start() -> None:
    """Models in engine processes: the daemon never loads llama.cpp. Only an in-process engine
    (`isolation: thread`) imports a native module, inside the function that builds it."""
    modules = {_module(p): p for p in SOURCES}
    reached, todo = set(), ["edgellmd.__main__", "edgellmd.http.app"]
    while todo:
        name = todo.pop()
        if name in reached or name not in modules:
            continue
        reached.add(name)
        todo += sorted(_module_level_imports(modules[name]))
        # A package's import runs its __init__ first.
        parts = name.split(".")
        todo += [".".join(parts[:i]) for i in range(2, len(parts))]
    assert len(reached) > 40, sorted(reached)  # the walk found the daemon
    assert not reached & NATIVE, sorted(reached & NATIVE)


def test_a_native_import_at_module_level_is_found(tmp_path: Path) -> None:
    path = DAEMON / "models" / "handle.py"
    assert "edgellmd.engine.scheduler" in _functions_imports(path)  # the thread engine, built lazily
    assert "edgellmd.engine.scheduler" not in _module_level_imports(path)


def test_importing_the_daemon_loads_no_llama_cpp() -> None:
    """The same in a fresh interpreter, third-party imports included."""
    code = (
        "import sys, edgellmd.__main__, edgellmd.http.app, edgellmd.api.admin, edgellmd.engine.remote\n"
        "print(sorted(m for m in sys.modules if m.startswith(('llama_cpp', 'edgellmd.engine.'))))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    loaded = ast.literal_eval(done.stdout.strip())
    assert "edgellmd.engine.remote" in loaded  # it ran
    assert not [m for m in loaded if m.startswith("llama_cpp") or m in NATIVE], loaded
