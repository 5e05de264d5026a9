"""Daemon configuration: one YAML file validated once into frozen dataclasses.

Declare once: every setting is one dataclass field made by `setting()` (`declare`), which
carries its default, its range or choices and a one-line doc; the sections are those
dataclasses (`sections`). One generic reader parses every section from the declarations,
`edgellmd --check-config` prints every problem it finds (`load`), and `python -m
edgellmd.settings --markdown` writes the configuration reference in docs/configuration.md from
the same declarations (`reference`; tests/test_settings_reference.py holds the page to it).
"""

from edgellmd.settings.declare import (
    About,
    ConfigError,
    about,
    setting,
)
from edgellmd.settings.load import (
    check_config,
    load_settings,
    parse_settings,
)
from edgellmd.settings.reference import (
    README_BEGIN,
    README_END,
    main,
    reference_markdown,
    with_reference,
)
from edgellmd.settings.sections import (
    DEFAULT_BODY_TIMEOUT_S,
    DEFAULT_HEADER_TIMEOUT_S,
    DEFAULT_KEEPALIVE_TIMEOUT_S,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_MAX_CONNECTIONS_PER_CLIENT,
    DEFAULT_PRELOAD_DIR,
    DEFAULT_SHUTDOWN_TIMEOUT_S,
    GPU_LAYERS_ALL,
    GPU_LAYERS_AUTO,
    MAX_CONFIG_BYTES,
    MODEL_NAME,
    AuthSettings,
    ConsoleSettings,
    HostSettings,
    LifecycleSettings,
    LockSettings,
    LoggingSettings,
    MediaSettings,
    ModelSettings,
    ResponsesSettings,
    ServerSettings,
    Settings,
    SpeculativeSettings,
    TelemetrySettings,
)

__all__ = [
    "DEFAULT_BODY_TIMEOUT_S",
    "DEFAULT_HEADER_TIMEOUT_S",
    "DEFAULT_KEEPALIVE_TIMEOUT_S",
    "DEFAULT_MAX_CONNECTIONS",
    "DEFAULT_MAX_CONNECTIONS_PER_CLIENT",
    "DEFAULT_PRELOAD_DIR",
    "DEFAULT_SHUTDOWN_TIMEOUT_S",
    "GPU_LAYERS_ALL",
    "GPU_LAYERS_AUTO",
    "MAX_CONFIG_BYTES",
    "MODEL_NAME",
    "README_BEGIN",
    "README_END",
    "About",
    "AuthSettings",
    "ConfigError",
    "ConsoleSettings",
    "HostSettings",
    "LifecycleSettings",
    "LockSettings",
    "LoggingSettings",
    "MediaSettings",
    "ModelSettings",
    "ResponsesSettings",
    "ServerSettings",
    "Settings",
    "SpeculativeSettings",
    "TelemetrySettings",
    "about",
    "check_config",
    "load_settings",
    "main",
    "parse_settings",
    "reference_markdown",
    "setting",
    "with_reference",
]
