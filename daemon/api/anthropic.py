"""Anthropic's Messages API: POST /v1/messages and /v1/messages/count_tokens, in Anthropic's shapes."""

from __future__ import annotations

from aiohttp import web


def setup_anthropic(app: web.Application) -> None:
    """Install the Messages API routes and its error envelope for them."""
    del app
