"""edgellmd: the edgellm daemon that serves GGUF models over an OpenAI-compatible API."""

from __future__ import annotations

__version__ = "0.1.0"
