"""Declare once: each setting's default, range and doc in its field; docs/configuration.md made from them."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
import typing
from pathlib import Path
from typing import Any, Final

import pytest
import yaml

from edgellmd import settings as settings_mod
from edgellmd.settings import (
    GPU_LAYERS_AUTO,
    README_BEGIN,
    README_END,
    About,
    LifecycleSettings,
    ModelSettings,
    ServerSettings,
    Settings,
    main,
    parse_settings,
    reference_markdown,
    with_reference,
)

REPO: Final = Path(__file__).resolve().parent.parent
CONFIGURATION: Final = REPO / "docs" / "configuration.md"
NOT_SETTINGS: Final = {(Settings, "source")}  # where a config was read from is no key of it


def _sections() -> dict[str, type]:
    """Each top-level section and its settings class, in declaration order (models: one entry's)."""
    out: dict[str, type] = {}
    hints = typing.get_type_hints(Settings)
    for field in dataclasses.fields(Settings):
        if (Settings, field.name) in NOT_SETTINGS:
            continue
        hint = hints[field.name]
        out[field.name] = typing.get_args(hint)[0] if typing.get_origin(hint) is tuple else hint
    return out


SECTIONS: Final = _sections()


def _nested(cls: type) -> list[type]:
    """A section's own sections (a model's `speculative`), depth first."""
    hints = typing.get_type_hints(cls)
    inner = [hints[f.name] for f in dataclasses.fields(cls) if dataclasses.is_dataclass(hints[f.name])]
    return [c for i in inner for c in (i, *_nested(i))]


ALL_CLASSES: Final = [c for cls in SECTIONS.values() for c in (cls, *_nested(cls))]


def _about(field: dataclasses.Field[Any]) -> About | None:
    return next((v for v in field.metadata.values() if isinstance(v, About)), None)


def _declared() -> list[tuple[str, dataclasses.Field[Any], About]]:
    """(key, field, declaration) of every setting, in the reference's order; sections nest."""
    out: list[tuple[str, dataclasses.Field[Any], About]] = []

    def walk(cls: type, prefix: str) -> None:
        hints = typing.get_type_hints(cls)
        for field in dataclasses.fields(cls):
            about = _about(field)
            assert about is not None, f"{cls.__name__}.{field.name} is not declared with setting()"
            if dataclasses.is_dataclass(hints[field.name]):
                walk(hints[field.name], f"{prefix}.{field.name}")
            else:
                out.append((f"{prefix}.{field.name}", field, about))

    for section, cls in SECTIONS.items():
        walk(cls, f"{section}{'[]' if cls is ModelSettings else ''}")
    return out


def _default(field: dataclasses.Field[Any]) -> Any:
    return None if field.default is dataclasses.MISSING else field.default


def _shown(value: Any) -> str:
    """A value as a reader of the reference expects it (YAML's words, whole numbers without .0)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, tuple):
        return "[" + ", ".join(_shown(v) for v in value) + "]"
    return str(value)


def _configuration() -> str:
    """The generated reference in docs/configuration.md: its YAML block and its table."""
    text = CONFIGURATION.read_text(encoding="utf-8")
    return text[text.index(README_BEGIN) : text.index(README_END)]


def _yaml_block() -> str:
    found = re.search(r"```yaml\n(.*?)```", _configuration(), re.DOTALL)
    assert found, "docs/configuration.md's reference has no YAML block"
    return found.group(1)


def _rows() -> dict[str, list[str]]:
    """The reference table's rows: key -> its other cells."""
    rows = {}
    for line in _configuration().splitlines():
        cells = re.match(r"\| `([^`]+)` \| (.*) \|$", line)
        if cells:
            rows[cells.group(1)] = re.split(r" (?<!\\)\| ", cells.group(2))
    return rows


# ---- the declarations -----------------------------------------------------------------------------


def test_every_field_of_every_section_is_a_declared_setting() -> None:
    for cls in (Settings, *ALL_CLASSES):
        for field in dataclasses.fields(cls):
            about = _about(field)
            if (cls, field.name) in NOT_SETTINGS:
                assert about is None
                continue
            assert about is not None, f"{cls.__name__}.{field.name}"
            assert about.doc, field.name
            assert "\n" not in about.doc, field.name
            assert "|" not in about.doc, field.name
            assert not about.doc.endswith("."), field.name  # a phrase, as a YAML comment reads
            assert field.default_factory is dataclasses.MISSING, field.name


def _owner(field: dataclasses.Field[Any]) -> type:
    return next(cls for cls in ALL_CLASSES if field in dataclasses.fields(cls))


def _hint(field: dataclasses.Field[Any]) -> Any:
    return typing.get_type_hints(_owner(field))[field.name]


def test_integers_are_declared_with_their_range() -> None:
    for key, field, about in _declared():
        hint = _hint(field)
        if hint is int or int in typing.get_args(hint):
            assert about.bounds is not None or about.read is not None, key


def test_defaults_other_modules_name_are_the_declared_ones() -> None:
    assert settings_mod.DEFAULT_SHUTDOWN_TIMEOUT_S == ServerSettings().shutdown_timeout_s == 30.0
    assert settings_mod.DEFAULT_PRELOAD_DIR == LifecycleSettings().preload_dir == Path("/dev/shm/edgellm")
    assert GPU_LAYERS_AUTO == "auto"
    assert not any(
        isinstance(v, int) and v == -2 for v in vars(settings_mod).values() if not isinstance(v, bool)
    ), "gpu_layers has no -2 sentinel any more"


def test_gpu_layers_auto_is_kept_as_written() -> None:
    data = {
        "models": [{"name": "m", "file": "m.gguf", "gpu_layers": "auto"}],
        "lock": {"allow_unsigned": True},
    }
    assert parse_settings(data, base_dir=Path("/srv")).models[0].gpu_layers == "auto"


# ---- docs/configuration.md ----------------------------------------------------------------------


def test_the_configuration_page_carries_the_reference_generated_from_the_declarations() -> None:
    page = CONFIGURATION.read_text(encoding="utf-8")
    assert page.count(README_BEGIN) == 1
    assert page.count(README_END) == 1
    assert with_reference(page) == page, (
        "docs/configuration.md's reference is stale: run "
        "`python -m edgellmd.settings --markdown --readme docs/configuration.md`"
    )


def test_the_readme_points_to_the_reference_and_does_not_copy_it() -> None:
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert README_BEGIN not in readme
    assert "docs/configuration.md" in readme


@pytest.mark.parametrize(("key", "field", "about"), _declared(), ids=[key for key, _, _ in _declared()])
def test_each_setting_has_a_table_row_with_its_default_and_doc(
    key: str, field: dataclasses.Field[Any], about: About
) -> None:
    rows = _rows()
    assert key in rows, f"docs/configuration.md's table has no row for {key}"
    default, _accepts, meaning = rows[key]
    if field.default is dataclasses.MISSING and type(None) not in typing.get_args(_hint(field)):
        assert default == "required", key
    else:
        assert default == f"`{_shown(_default(field))}`", key
    assert meaning.startswith(about.doc), key
    if about.more:
        assert meaning.endswith(about.more.replace("|", "\\|")), key


def test_no_table_row_names_a_setting_that_does_not_exist() -> None:
    declared = {key for key, _, _ in _declared()}
    assert set(_rows()) - declared == set()


def test_the_yaml_block_lists_every_setting_with_its_default_and_doc() -> None:
    block = _yaml_block()
    path: list[tuple[int, str]] = []  # (indent, key) of the sections the line is in
    seen: set[str] = set()
    docs = {key: about for key, _, about in _declared()}
    sections = {key.rsplit(".", 1)[0] for key in docs}
    for line in block.splitlines():
        entry = re.match(r"( *)(?:- )?(\w+):(?: ([^\s#].*?))?\s+# (.*)$", line)
        assert entry, f"not a `key: value  # doc` line: {line!r}"
        indent = len(entry.group(1)) + (2 if "- " in line[: len(entry.group(1)) + 2] else 0)
        while path and path[-1][0] >= indent:
            path.pop()
        name = entry.group(2) + ("[]" if not path and entry.group(2) == "models" else "")
        key = ".".join([*(k for _, k in path), name])
        if entry.group(3) is None:  # a section: its keys follow, deeper
            assert key in sections or key in SECTIONS, f"the YAML block names section {key}, which is none"
            path.append((indent, name))
            continue
        assert key in docs, f"the YAML block names {key}, which is no setting"
        about = docs[key]
        if about.example is None:
            assert entry.group(4) == about.doc, key
        else:  # a value that is not the default says so, and what the default is
            assert entry.group(4).startswith(about.doc + " (an example; "), key
        seen.add(key)
    assert seen == set(docs)


def test_the_yaml_block_is_a_valid_config_of_the_defaults(tmp_path: Path) -> None:
    # Every value in it is the declared default, but for the few a config must give (an
    # example stands in); and the whole of it passes validation.
    data = yaml.safe_load(_yaml_block())
    parsed = parse_settings(data, base_dir=tmp_path)
    for section, cls in SECTIONS.items():
        written = data[section][0] if cls is ModelSettings else data[section]
        assert list(written) == [f.name for f in dataclasses.fields(cls)], section
        for field in dataclasses.fields(cls):
            about = _about(field)
            assert about is not None
            if about.example is not None:
                assert written[field.name] == yaml.safe_load(about.example), field.name
                continue
            parsed_section = parsed.models[0] if cls is ModelSettings else getattr(parsed, section)
            value = getattr(parsed_section, field.name)
            assert value == _default(field), f"{section}.{field.name}"


def test_the_script_prints_the_reference() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "edgellmd.settings", "--markdown"],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    assert result.stdout == reference_markdown()


def test_the_script_rewrites_a_stale_page_in_place(tmp_path: Path) -> None:
    readme = tmp_path / "configuration.md"
    readme.write_text(f"# x\n\n{README_BEGIN}\nstale\n{README_END}\n\nafter\n", encoding="utf-8")
    assert main(["--markdown", "--readme", str(readme)]) == 0
    text = readme.read_text(encoding="utf-8")
    assert text == f"# x\n\n{README_BEGIN}\n{reference_markdown()}{README_END}\n\nafter\n"
    assert main(["--markdown", "--readme", str(readme)]) == 0
    assert readme.read_text(encoding="utf-8") == text  # a second run changes nothing
    readme.write_text("no markers\n", encoding="utf-8")
    assert main(["--markdown", "--readme", str(readme)]) == 1
