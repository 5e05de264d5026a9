"""edgellmd: the edgellm daemon that serves GGUF models over an OpenAI-compatible API."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("edgellm")  # written once, in pyproject.toml
except PackageNotFoundError:  # pragma: no cover - run from a checkout that was never installed
    __version__ = "0+unknown"
