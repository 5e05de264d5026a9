"""edgellmctl: operator tooling for edgellm appliances."""

from __future__ import annotations

from edgellmd import __version__  # one distribution, one version: pyproject.toml's

__all__ = ["__version__"]
