"""Reranking: POST /v1/rerank (also /rerank and /v2/rerank), in the shape Jina's and Cohere's
clients send, answered by a model configured with `kind: rerank`.

Each document is scored with the query by the model's rank head (one llama.cpp pass per pair,
on the model's own thread, queued with the other requests' pairs), the results sorted by
score, highest first. Every bound is named in the 400 that enforces it.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final

from aiohttp import web

from edgellmd.api.context import TOKENS_USED, USER_TAG, context, tenant
from edgellmd.api.fields import Fields, reject_unknown, unsupported
from edgellmd.api.jsontext import read_json_object
from edgellmd.api.session import pooled_call, user_tag
from edgellmd.errors import InvalidRequest

MAX_RERANK_DOCUMENTS: Final = 1000  # documents per request (Cohere's advice for its own API)
# Tokens of every query-document pair of one request together: the work one request may ask
# of the model (a pair is at most the model's context_size on top of this).
MAX_RERANK_TOKENS: Final = 262_144
MAX_TOKENS_PER_DOC: Final = 1_048_576  # the largest `max_tokens_per_doc` read (a model's context is less)
PATHS: Final = ("/v1/rerank", "/rerank", "/v2/rerank")  # Jina's and llama-server's; Cohere's v2 client

_FIELDS: Final = frozenset(
    {
        "model",
        "query",
        "documents",
        "top_n",
        "return_documents",
        "max_tokens_per_doc",
        "rank_fields",
        "max_chunks_per_doc",
        "relevant_spans",
        "priority",
        "user",
    }
)


@dataclass(frozen=True, slots=True)
class RerankRequest:
    model: str
    query: str
    documents: tuple[str, ...]
    top_n: int | None
    return_documents: bool
    max_tokens_per_doc: int | None
    user: str | None


def parse_rerank(data: Mapping[str, Any]) -> RerankRequest:
    """Validate a rerank body: Jina's fields and Cohere's (v1 and v2)."""
    reject_unknown(data, _FIELDS)
    f = Fields(data)
    for name in ("rank_fields", "max_chunks_per_doc", "relevant_spans"):
        if data.get(name) is not None:
            raise unsupported(name)
    model = f.string("model", required=True, nonempty=True)
    query = f.string("query", required=True, nonempty=True)
    assert model is not None  # noqa: S101 - required=True guarantees it
    assert query is not None  # noqa: S101 - likewise
    f.integer("priority", lo=0, hi=1_000_000)  # Cohere's scheduling hint: checked, then one class here
    return RerankRequest(
        model=model,
        query=query,
        documents=_documents(data.get("documents")),
        top_n=f.integer("top_n", lo=1),
        return_documents=f.boolean("return_documents", default=False),
        max_tokens_per_doc=f.integer("max_tokens_per_doc", lo=1, hi=MAX_TOKENS_PER_DOC),
        user=f.string("user"),
    )


def _documents(value: Any) -> tuple[str, ...]:
    """Strings, or objects whose `text` is one (Jina's and Cohere v1's object form)."""
    if value is None:
        raise InvalidRequest("'documents' is required", param="documents")
    if not isinstance(value, list) or not value:
        raise InvalidRequest("'documents' must be a non-empty list", param="documents")
    if len(value) > MAX_RERANK_DOCUMENTS:
        raise InvalidRequest(
            f"'documents' holds {len(value)} documents; at most {MAX_RERANK_DOCUMENTS} per request",
            param="documents",
        )
    texts: list[str] = []
    for i, given in enumerate(value):
        item = given.get("text") if isinstance(given, Mapping) and set(given) <= {"text"} else given
        if not isinstance(item, str):
            raise InvalidRequest(
                f"'documents[{i}]' must be a string or an object with a string 'text' and nothing else",
                param="documents",
            )
        texts.append(item)
    return tuple(texts)


async def rerank(request: web.Request) -> web.Response:
    """POST /v1/rerank: the documents' relevance to the query, most relevant first."""
    body = parse_rerank(await read_json_object(request))
    tag = user_tag(body.user)
    if tag is not None:
        request[USER_TAG] = tag
    ctx = context(request)
    async with ctx.registry.lease(body.model) as handle:
        handle.ranker  # noqa: B018 - refuses other models before tokenizing
        limit = handle.settings.context_size
        if body.max_tokens_per_doc is not None and body.max_tokens_per_doc > limit:
            raise InvalidRequest(
                f"'max_tokens_per_doc' is {body.max_tokens_per_doc}; this model ranks at most {limit} "
                "tokens per document",
                param="max_tokens_per_doc",
            )
        pairs = await handle.rerank_prompts(body.query, body.documents, body.max_tokens_per_doc)
        n_tokens = sum(len(p) for p in pairs)
        if n_tokens > MAX_RERANK_TOKENS:
            raise InvalidRequest(
                f"the documents with the query make {n_tokens} tokens; at most {MAX_RERANK_TOKENS} "
                "per request (send fewer or shorter documents, or several requests)",
                param="documents",
            )
        request[TOKENS_USED] = n_tokens
        whose = tenant(request)
        scores = await pooled_call(request, handle, n_tokens, lambda model: model.rank(pairs, tenant=whose))
    order = sorted(range(len(scores)), key=lambda i: (-scores[i], i))[: body.top_n]
    results: list[dict[str, Any]] = []
    for i in order:
        result: dict[str, Any] = {"index": i, "relevance_score": scores[i]}
        if body.return_documents:
            result["document"] = {"text": body.documents[i]}
        results.append(result)
    return web.json_response(
        {
            "id": f"rerank-{uuid.uuid4().hex}",
            "object": "list",
            "model": handle.name,
            "results": results,
            "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens},
            # Cohere's clients read usage here; a search unit is a request of up to 100 documents.
            "meta": {
                "billed_units": {"search_units": -(-len(scores) // 100)},
                "tokens": {"input_tokens": n_tokens},
            },
        },
        dumps=_compact,
    )


def _compact(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"))


Route = tuple[str, str, Callable[[web.Request], Any]]
ROUTES: Final[tuple[Route, ...]] = tuple(("POST", path, rerank) for path in PATHS)


def setup_rerank(app: web.Application) -> None:
    """Install the rerank routes."""
    for method, path, handler in ROUTES:
        app.router.add_route(method, path, handler)
