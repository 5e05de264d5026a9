"""Reading the YAML file: bounded, UTF-8, duplicate keys refused, every problem reported at once."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import yaml

from edgellmd.files import FileTooLarge, NotRegularFile, read_regular
from edgellmd.settings.declare import (
    TOP_LEVEL,
    Checker,
    ConfigError,
    join_path,
    read_section,
)
from edgellmd.settings.sections import (
    MAX_CONFIG_BYTES,
    Settings,
)


def parse_settings(data: object, *, base_dir: Path) -> Settings:
    """Validate already-parsed YAML data into Settings, raising ConfigError with every problem."""
    checker = Checker()
    settings: Settings = read_section(checker, Settings, data, TOP_LEVEL, base_dir.absolute(), null_ok=False)
    if checker.problems:
        raise ConfigError(checker.problems)
    return settings


def _duplicate_keys(root: yaml.Node) -> list[str]:
    """Problems for keys repeated in one mapping, which yaml.safe_load silently collapses."""
    problems: list[tuple[int, str]] = []
    seen_nodes: set[int] = set()  # aliases share nodes; visit each once
    pending: list[tuple[yaml.Node, str]] = [(root, TOP_LEVEL)]
    while pending:
        node, path = pending.pop()
        if id(node) in seen_nodes:
            continue
        seen_nodes.add(id(node))
        if isinstance(node, yaml.SequenceNode):
            pending.extend((item, f"{path}[{i}]") for i, item in enumerate(node.value))
        elif isinstance(node, yaml.MappingNode):
            first_line: dict[tuple[str, str], int] = {}
            for key_node, value_node in node.value:
                if not isinstance(key_node, yaml.ScalarNode):
                    continue
                child = join_path(path, key_node.value)
                line = key_node.start_mark.line + 1
                key = (key_node.tag, key_node.value)
                if key in first_line:
                    problems.append((line, f"{child}: duplicate key (lines {first_line[key]} and {line})"))
                else:
                    first_line[key] = line
                pending.append((value_node, child))
    return [problem for _, problem in sorted(problems)]


def _read_yaml(path: Path) -> tuple[object, list[str]]:
    """The file's parsed YAML and any problems with the file itself."""
    where = str(path)
    try:
        raw = read_regular(path, MAX_CONFIG_BYTES)  # a FIFO in its place never blocks the start
    except FileTooLarge:
        return None, [f"{where}: config file is larger than {MAX_CONFIG_BYTES} bytes"]
    except NotRegularFile as exc:
        reason = "Is a directory" if exc.kind == "a directory" else exc.describe("it")
        return None, [f"{where}: cannot read config file: {reason}"]
    except OSError as exc:
        return None, [f"{where}: cannot read config file: {exc.strerror or type(exc).__name__}"]
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        return None, [f"{where}: config file is not UTF-8 (bad byte at offset {exc.start})"]
    try:
        data = yaml.safe_load(text)
        duplicates = _duplicate_keys(node) if (node := yaml.compose(text, yaml.SafeLoader)) else []
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        # e.g. context "while parsing a flow sequence", problem "expected ',' or ']', but ..."
        reason = _show_reason("; ".join(part for part in (exc.context, exc.problem) if part))
        # A constructor error is well-formed YAML that safe_load refuses (a !!python tag).
        refused = isinstance(exc, yaml.constructor.ConstructorError)
        kind = "unsupported YAML" if refused else "YAML syntax error"
        return None, [f"{where}: {kind}{at}: {reason}"]
    except yaml.YAMLError as exc:
        return None, [f"{where}: YAML error: {_show_reason(str(exc).splitlines()[0])}"]
    except (ValueError, TypeError, AttributeError) as exc:
        # Well-formed YAML whose value PyYAML cannot build: an integer literal past
        # sys.get_int_max_str_digits(), a date that does not exist (2027-02-30), a bad !!timestamp.
        return None, [f"{where}: YAML error: a value YAML cannot read ({_show_reason(str(exc))})"]
    except RecursionError:
        return None, [f"{where}: YAML error: nested too deeply"]
    if data is None:
        return None, [f"{where}: config file is empty (expected a mapping with a 'models' list)"]
    return data, duplicates


def _show_reason(reason: str) -> str:
    # PyYAML's reasons quote at most a character or a token; cap them anyway.
    return reason if len(reason) <= 120 else reason[:117] + "..."


def load_settings(path: str | Path) -> Settings:
    """Read and validate a YAML config file, raising ConfigError with every problem."""
    source = Path(path).absolute()
    data, problems = _read_yaml(Path(path))
    if data is None:
        raise ConfigError(problems)
    try:
        settings = parse_settings(data, base_dir=source.parent)
    except ConfigError as exc:
        raise ConfigError(problems + exc.problems) from None
    if problems:
        raise ConfigError(problems)
    return replace(settings, source=source)


def check_config(path: str | Path) -> list[str]:
    """The problems with a config file: [] when it is valid."""
    try:
        load_settings(path)
    except ConfigError as exc:
        return exc.problems
    return []
