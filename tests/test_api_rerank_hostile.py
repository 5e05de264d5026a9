"""POST /v1/rerank (and /rerank, /v2/rerank) under a hostile client that holds a valid key.

Odd and oversized values in every field, Unicode that is hard to carry (NUL, lone surrogates,
marks, 4-byte emoji, text that spells the model's markup or the template's placeholders),
bodies that are not JSON objects or too large, stalled and abandoned connections, concurrent
load beside a chat model, and keys without the scope or past their limits on every spelling of
the path. What a careful operator expects: a client's mistake is a 4xx naming the field in a
short message (no huge input echoed back), never a 500, and the daemon keeps answering.
"""

from __future__ import annotations

import gzip
import http.client
import json
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Final

import pytest

from edgellmctl.keys import create_key
from edgellmd.engine.remote import RemoteEngine
from edgellmd.http import appkeys
from tests.ggufmodels import (
    TinyModelSpec,
    TinyReranker,
    write_tiny_model,
    write_tiny_reranker,
)
from tests.serving import RunningDaemon, running, settings_for, wait_for
from tests.test_api_rerank import pair_tokens

# Daemons, engine processes or many seconds: left out of ./dev test --quick.
pytestmark = pytest.mark.slow

CONTEXT: Final = 512
PATHS: Final = ("/v1/rerank", "/rerank", "/v2/rerank")
TOLERANCE: Final = 5e-3
MAX_MESSAGE: Final = 400  # an error message longer than this echoes the client's input
BASE: Final[dict[str, Any]] = {"model": "rr", "query": "which animal purrs", "documents": ["a cat"]}


@dataclass
class Served:
    daemon: RunningDaemon
    model: TinyReranker
    token: str  # inference scope, no limits
    metrics_only: str
    admin_only: str
    rpm: dict[str, str]  # per path: a key allowed 2 requests a minute
    quota: dict[str, str]  # per path: a key allowed 2 requests a day


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    base = tmp_path_factory.mktemp("hostile")
    rr = base / "rr.gguf"
    model = write_tiny_reranker(rr, seed=7)
    chat = write_tiny_model(base / "chat.gguf", TinyModelSpec(seed=5))
    keys = base / "keys.yaml"
    _, token = create_key(keys, "app", ["inference"], limits={})
    _, metrics_only = create_key(keys, "metrics", ["metrics"], limits={})
    _, admin_only = create_key(keys, "admin", ["admin"], limits={})
    rpm = {p: create_key(keys, f"rpm{i}", ["inference"], limits={"rpm": 2})[1] for i, p in enumerate(PATHS)}
    quota = {
        p: create_key(keys, f"quota{i}", ["inference"], limits={}, quota={"requests_per_day": 2})[1]
        for i, p in enumerate(PATHS)
    }
    common = {"file": str(rr), "kind": "rerank", "context_size": CONTEXT, "threads": 1}
    models = [
        {"name": "rr", **common, "slots": 2},
        # One call at a time and none waiting: a second concurrent call is a 429.
        {"name": "rr1", **common, "slots": 1, "queue_size": 0},
        {"name": "rr1t", **common, "slots": 1, "queue_size": 0, "isolation": "thread"},
        {"name": "chat", "file": str(chat), "slots": 1, "context_size": 256, "threads": 1},
    ]
    settings = settings_for(
        models,
        server={"body_timeout_s": 1.0, "header_timeout_s": 1.0},
        auth={"keys_file": str(keys)},
    )
    with running(settings) as daemon:
        yield Served(daemon, model, token, metrics_only, admin_only, rpm, quota)


# ---- clients ------------------------------------------------------------------------------------


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    raw: bytes

    @property
    def json(self) -> Any:
        def no_constant(name: str) -> Any:
            raise AssertionError(f"the answer holds {name}, which is not JSON")

        return json.loads(self.raw, parse_constant=no_constant)


def request(
    daemon: RunningDaemon,
    path: str,
    body: bytes | None,
    *,
    token: str | None = None,
    method: str = "POST",
    content_type: str | None = "application/json",
    headers: dict[str, str] | None = None,
) -> Answer:
    """Any request, by http.client (which sends what it is given); never a 500 or a traceback."""
    hdrs = dict(headers or {})
    if token is not None:
        hdrs["Authorization"] = f"Bearer {token}"
    if content_type is not None:
        hdrs["Content-Type"] = content_type
    conn = http.client.HTTPConnection("127.0.0.1", daemon.port, timeout=60)
    try:
        conn.request(method, path, body=body, headers=hdrs)
        response = conn.getresponse()
        answer = Answer(response.status, {k.lower(): v for k, v in response.getheaders()}, response.read())
    finally:
        conn.close()
    assert answer.status < 500, (path, answer.status, answer.raw[:2000])
    assert b"Traceback" not in answer.raw, answer.raw[:2000]
    return answer


def post(served: Served, body: Any, path: str = "/v1/rerank", token: str | None = None) -> Answer:
    return request(served.daemon, path, json.dumps(body).encode(), token=token or served.token)


def post_raw(served: Served, raw: bytes, content_type: str | None = "application/json") -> Answer:
    return request(served.daemon, "/v1/rerank", raw, token=served.token, content_type=content_type)


def assert_client_error(answer: Answer, status: int = 400, param: str | None = None, words: str = "") -> None:
    assert answer.status == status, (answer.status, answer.raw[:1000])
    error = answer.json["error"]
    assert len(error["message"]) <= MAX_MESSAGE, (
        f"the message echoes the input: {len(error['message'])} chars"
    )
    if param is not None:
        assert error["param"] == param, error
    assert words in error["message"], error


def assert_alive(served: Served) -> None:
    answer = post(served, BASE)
    assert answer.status == 200, answer.raw[:1000]


def check_results(answer: Answer, n_documents: int, top_n: int | None = None) -> list[dict[str, Any]]:
    """A valid answer: finite scores in [0, 1], sorted, the indexes distinct and in range."""
    assert answer.status == 200, answer.raw[:1000]
    body = answer.json
    results: list[dict[str, Any]] = body["results"]
    indexes = [r["index"] for r in results]
    assert len(set(indexes)) == len(indexes), indexes
    assert all(isinstance(i, int) and 0 <= i < n_documents for i in indexes), indexes
    assert len(indexes) == min(n_documents, top_n or n_documents)
    scores = [r["relevance_score"] for r in results]
    assert all(isinstance(s, float) and 0.0 <= s <= 1.0 for s in scores), scores
    keys = [(-r["relevance_score"], r["index"]) for r in results]
    assert keys == sorted(keys)
    return results


# ---- field values -------------------------------------------------------------------------------

HUGE_INT: Final = int("9" * 4000)  # json.loads reads it; a message must not print it


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"top_n": -5}, "top_n"),
        ({"top_n": 0}, "top_n"),
        ({"top_n": "2"}, "top_n"),
        ({"top_n": 2.5}, "top_n"),
        ({"top_n": 2.0}, "top_n"),
        ({"top_n": [1]}, "top_n"),
        ({"top_n": {"n": 1}}, "top_n"),
        ({"top_n": -HUGE_INT}, "top_n"),
        ({"max_tokens_per_doc": 0}, "max_tokens_per_doc"),
        ({"max_tokens_per_doc": True}, "max_tokens_per_doc"),
        ({"max_tokens_per_doc": False}, "max_tokens_per_doc"),
        ({"max_tokens_per_doc": "10"}, "max_tokens_per_doc"),
        ({"max_tokens_per_doc": 10**30}, "max_tokens_per_doc"),
        ({"max_tokens_per_doc": HUGE_INT}, "max_tokens_per_doc"),
        ({"max_tokens_per_doc": -HUGE_INT}, "max_tokens_per_doc"),
        ({"priority": HUGE_INT}, "priority"),
        ({"priority": 1.5}, "priority"),
        ({"return_documents": "true"}, "return_documents"),
        ({"return_documents": 1}, "return_documents"),
        ({"query": {"text": "q"}}, "query"),
        ({"query": 5}, "query"),
        ({"query": ""}, "query"),
        ({"model": 5}, "model"),
        ({"model": ["rr"]}, "model"),
        ({"user": 5}, "user"),
        ({"documents": {"text": "a"}}, "documents"),
        ({"documents": [None]}, "documents"),
        ({"documents": [["a"]]}, "documents"),
        ({"documents": [{"text": ["a"]}]}, "documents"),
        ({"documents": [{"text": {"text": "a"}}]}, "documents"),
        ({"documents": [{"text": 5}]}, "documents"),
        ({"documents": [{}]}, "documents"),
        ({"documents": [{"title": "a"}]}, "documents"),
        ({"documents": ["a"] * 1001}, "documents"),
        ({"documents": ["a", "b" * 100_000]}, "documents"),  # too long: named, not echoed
        ({"query": "q" * 500_000}, "query"),
        ({"rank_fields": []}, "rank_fields"),
        ({"max_chunks_per_doc": 0}, "max_chunks_per_doc"),
        ({"relevant_spans": False}, "relevant_spans"),
        ({"x" * 100_000: 1}, None),  # an unknown field with a huge name: not echoed
    ],
)
def test_odd_field_values_are_short_400s_naming_the_field(
    served: Served, change: dict[str, Any], param: str | None
) -> None:
    answer = post(served, {**BASE, **change})
    assert_client_error(answer, 400, param)
    assert_alive(served)


def test_an_unknown_model_with_a_huge_name_is_a_short_404(served: Served) -> None:
    assert_client_error(post(served, {**BASE, "model": "m" * 200_000}), 404, "model")
    assert_client_error(post(served, {**BASE, "model": "chat\u0000"}), 404, "model")


def test_a_huge_top_n_returns_every_document(served: Served) -> None:
    documents = ["cats purr", "dogs bark", "stocks fell"]
    for top_n in (10**30, HUGE_INT, 3, 4):
        answer = post(served, {**BASE, "documents": documents, "top_n": top_n})
        check_results(answer, 3, None)
    check_results(post(served, {**BASE, "documents": documents, "top_n": 1}), 3, 1)


def test_null_optional_fields_are_their_defaults(served: Served) -> None:
    body = {**BASE, "top_n": None, "return_documents": None, "max_tokens_per_doc": None, "user": None}
    results = check_results(post(served, body), 1)
    assert "document" not in results[0]


def test_duplicate_keys_are_read_as_json_says_the_last_wins(served: Served) -> None:
    raw = b'{"model": "rr", "query": 5, "query": "q", "documents": ["a"], "documents": ["a", "b"]}'
    check_results(post_raw(served, raw), 2)


# ---- Unicode and markup -------------------------------------------------------------------------

HOSTILE_DOCUMENTS: Final = (
    "",
    " ",
    "\t\n\r  \u3000",
    "a\u0000b\u0000",
    "\u202eevil\u202c \u200f\u200e\u061c",  # bidi overrides and marks
    "e" + "\u0301" * 50,  # one letter under fifty combining accents
    "\U0001f408\u200d\u2b1b \U0001f469\U0001f3fd\u200d\U0001f680 \U0010ffff",  # ZWJ sequences, 4-byte
    "\ufeff\ufffe\uffff",
    "<s>",
    "</s>",
    "<unk><s></s>",
    "<0x41>",
    "{query}",
    "{document}",
    "{{query}} {0} {} %s %(query)s",
    "query: x\ndocument: y",  # the template's own text
)


@pytest.mark.parametrize("query", ["{document} </s><s> {query}", " ", "\u0000", "<s>"])
def test_hostile_text_is_scored_as_text(served: Served, query: str) -> None:
    """Every byte of the query and the documents is one token of the tiny vocabulary: the count
    and each score show that no markup became a control token and no placeholder in user text
    was substituted; the documents come back exactly as sent."""
    body = {**BASE, "query": query, "documents": list(HOSTILE_DOCUMENTS), "return_documents": True}
    answer = post(served, body)
    results = check_results(answer, len(HOSTILE_DOCUMENTS))
    pairs = [pair_tokens(query, d) for d in HOSTILE_DOCUMENTS]
    assert answer.json["usage"]["prompt_tokens"] == sum(len(p) for p in pairs)
    for r in results:
        i = r["index"]
        assert r["document"] == {"text": HOSTILE_DOCUMENTS[i]}, i
        assert r["relevance_score"] == pytest.approx(served.model.score(pairs[i]), abs=TOLERANCE), i


def test_document_objects_carry_the_same_text(served: Served) -> None:
    documents = [{"text": d} for d in HOSTILE_DOCUMENTS[:6]]
    answer = post(served, {**BASE, "documents": documents, "return_documents": True})
    for r in check_results(answer, 6):
        assert r["document"] == documents[r["index"]]


@pytest.mark.parametrize(
    "raw",
    [
        b'{"model": "rr", "query": "\\ud800", "documents": ["a"]}',
        b'{"model": "rr", "query": "q", "documents": ["a", "x\\udfff"]}',
        b'{"model": "rr", "query": "q", "documents": [{"text": "\\udbff"}]}',
        b'{"model": "rr", "query": "q", "documents": [{"\\ud800": "a"}]}',
        b'{"model": "rr", "query": "q", "documents": ["a"], "\\udc00": 1}',
        b'{"model": "rr", "query": "q", "documents": ["a"], "user": "\\ud83d"}',
    ],
)
def test_lone_surrogates_are_400s(served: Served, raw: bytes) -> None:
    assert_client_error(post_raw(served, raw), 400, None, "surrogate")


def test_a_paired_surrogate_escape_is_the_emoji(served: Served) -> None:
    raw = b'{"model": "rr", "query": "q", "documents": ["\\ud83d\\udc08"], "return_documents": true}'
    results = check_results(post_raw(served, raw), 1)
    assert results[0]["document"]["text"] == "\U0001f408"


# ---- bodies -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"{",
        b"not json",
        b"null",
        b"true",
        b"1",
        b'"a string"',
        b"[]",
        b'[{"model": "rr", "query": "q", "documents": ["a"]}]',
        b"\xef\xbb\xbf" + json.dumps(BASE).encode(),  # a UTF-8 BOM
        b'{"model": "rr", "query": "\xff\xfe", "documents": ["a"]}',  # not UTF-8
        b'{"model": "rr", "query": "q", "documents": ["a"], "top_n": NaN}',
        b'{"model": "rr", "query": "q", "documents": ["a"], "top_n": Infinity}',
        b'{"model": "rr", "query": "q", "documents": ["a"], "top_n": 1e400}',
        b'{"model": "rr", "query": "q", "documents": ["a"], "top_n": ' + b"9" * 5000 + b"}",
        b'{"model": "rr", "query": "q", "documents": [' + b"[" * 100 + b"]" * 100 + b"]}",
        b'{"model": "rr", "query": "q", "documents": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
        json.dumps(BASE).encode() + b" trailing",
        json.dumps(BASE).encode().replace(b'"q', b"'q"),
    ],
)
def test_bodies_that_are_not_a_json_object_are_400s(served: Served, raw: bytes) -> None:
    assert_client_error(post_raw(served, raw), 400)
    assert_alive(served)


@pytest.mark.parametrize(
    "content_type",
    [None, "text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"],
)
def test_a_body_that_is_not_declared_json_is_a_415(served: Served, content_type: str | None) -> None:
    assert_client_error(post_raw(served, json.dumps(BASE).encode(), content_type), 415)


def test_a_body_past_max_body_bytes_is_a_413(served: Served) -> None:
    limit = served.daemon.settings.server.max_body_bytes
    documents = ["x" * 1000] * (limit // 1000 + 10)
    assert_client_error(post(served, {**BASE, "documents": documents}), 413)
    assert_alive(served)


def test_a_chunked_body_past_max_body_bytes_is_a_413(served: Served) -> None:
    limit = served.daemon.settings.server.max_body_bytes
    chunk = b"x" * 65536
    with socket.create_connection(("127.0.0.1", served.daemon.port), timeout=30) as sock:
        sock.sendall(
            b"POST /v1/rerank HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
            + f"Authorization: Bearer {served.token}\r\nTransfer-Encoding: chunked\r\n\r\n".encode()
        )
        try:
            for _ in range(limit // len(chunk) + 4):
                sock.sendall(b"%x\r\n" % len(chunk) + chunk + b"\r\n")
        except OSError:
            pass  # it stopped reading: the answer is waiting
        head = _read_head(sock)
    assert head.startswith(b"HTTP/1.1 413"), head[:200]
    assert_alive(served)


def _read_head(sock: socket.socket) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data:
        try:
            more = sock.recv(65536)
        except OSError:
            break
        if not more:
            break
        data += more
    return data


# ---- limits -------------------------------------------------------------------------------------


def test_a_thousand_documents_are_ranked_and_one_more_is_refused(served: Served) -> None:
    documents = [f"{i % 7}" for i in range(1000)]
    answer = post(served, {**BASE, "documents": documents, "top_n": 5, "return_documents": True})
    results = check_results(answer, 1000, 5)
    assert answer.json["meta"]["billed_units"]["search_units"] == 10
    for r in results:
        assert r["document"]["text"] == documents[r["index"]]
    assert_client_error(
        post(served, {**BASE, "documents": [*documents, "x"]}), 400, "documents", "at most 1000"
    )


def test_empty_documents_are_ranked(served: Served) -> None:
    check_results(post(served, {**BASE, "documents": ["", "", ""]}), 3)


def test_a_pair_of_exactly_the_context_is_ranked_one_more_token_is_not(served: Served) -> None:
    room = CONTEXT - len(pair_tokens(BASE["query"], ""))
    answer = post(served, {**BASE, "documents": ["x" * room]})
    check_results(answer, 1)
    assert answer.json["usage"]["prompt_tokens"] == CONTEXT
    too_long = post(served, {**BASE, "documents": ["ok", "x" * (room + 1)]})
    assert_client_error(too_long, 400, "documents", "document 1")


def test_the_total_tokens_of_a_request_are_bounded(served: Served) -> None:
    documents = ["x" * 450] * 600  # each pair fits; together about 295,000 tokens
    assert_client_error(post(served, {**BASE, "documents": documents}), 400, "documents", "262144")
    assert_alive(served)


def test_max_tokens_per_doc_cuts_a_document_within_the_context(served: Served) -> None:
    answer = post(served, {**BASE, "documents": ["x" * 2000], "max_tokens_per_doc": 10})
    check_results(answer, 1)
    assert answer.json["usage"]["prompt_tokens"] == len(pair_tokens(BASE["query"], "x" * 10))


def test_max_tokens_per_doc_cuts_a_document_far_past_the_context(served: Served) -> None:
    """Cohere's max_tokens_per_doc exists for long documents: one of 10,000 characters cut to 10
    tokens fits any context, so it is ranked, as one of 2,000 characters is."""
    answer = post(served, {**BASE, "documents": ["x" * 10_000], "max_tokens_per_doc": 10})
    check_results(answer, 1)
    assert answer.json["usage"]["prompt_tokens"] == len(pair_tokens(BASE["query"], "x" * 10))


# ---- keys and methods ---------------------------------------------------------------------------


@pytest.mark.parametrize("path", PATHS)
def test_every_spelling_needs_a_key_with_the_inference_scope(served: Served, path: str) -> None:
    body = json.dumps(BASE).encode()
    daemon = served.daemon
    assert request(daemon, path, body).status == 401
    assert request(daemon, path, body, headers={"Authorization": "Bearer nonsense"}).status == 401
    assert request(daemon, path, body, headers={"Authorization": "Basic " + served.token}).status == 401
    assert request(daemon, path, body, headers={"x-api-key": "sk-nope"}).status == 401
    assert request(daemon, path, body, token=served.metrics_only).status == 403
    assert request(daemon, path, body, token=served.admin_only).status == 403
    assert request(daemon, path, body, headers={"x-api-key": served.token}).status == 200
    for method in ("GET", "PUT", "DELETE", "PATCH"):
        assert request(daemon, path, None, method=method).status == 401, method
        answer = request(daemon, path, None, token=served.token, method=method)
        assert answer.status == 405, (method, answer.raw[:300])


def test_near_spellings_are_not_a_way_around_the_key(served: Served) -> None:
    body = json.dumps(BASE).encode()
    for path in ("/v1/rerank/", "/%72erank", "/v2/%72erank", "/v1//rerank", "/rerank?x=1", "/v2/rerank#x"):
        answer = request(served.daemon, path, body)
        assert answer.status in (400, 401, 404), (path, answer.status, answer.raw[:300])


@pytest.mark.parametrize("path", PATHS)
def test_every_spelling_counts_against_the_keys_rate_limit(served: Served, path: str) -> None:
    key = served.rpm[path]
    statuses = [post(served, BASE, path, key).status for _ in range(3)]
    assert statuses == [200, 200, 429], (path, statuses)


@pytest.mark.parametrize("path", PATHS)
def test_every_spelling_counts_against_the_keys_quota(served: Served, path: str) -> None:
    key = served.quota[path]
    statuses = [post(served, BASE, path, key).status for _ in range(3)]
    assert statuses == [200, 200, 429], (path, statuses)


# ---- connections and load -----------------------------------------------------------------------


def test_a_stalled_body_is_cut_and_others_are_answered_meanwhile(served: Served) -> None:
    sockets = []
    try:
        for _ in range(8):
            sock = socket.create_connection(("127.0.0.1", served.daemon.port), timeout=10)
            sock.sendall(
                b"POST /v1/rerank HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                + f"Authorization: Bearer {served.token}\r\nContent-Length: 100000\r\n\r\n".encode()
                + b'{"model": "rr", "query": "q", "documents": ["'
            )
            sockets.append(sock)
        half_head = socket.create_connection(("127.0.0.1", served.daemon.port), timeout=10)
        sockets.append(half_head)
        half_head.sendall(b"POST /v1/rerank HTTP/1.1\r\nHost: local")
        started = time.monotonic()
        assert_alive(served)
        assert time.monotonic() - started < 1.0  # not behind the stalled ones
        heads = [_read_head(s) for s in sockets[:-1]]
        assert all(h.startswith(b"HTTP/1.1 408") for h in heads), [h[:40] for h in heads]
        assert half_head.recv(100) == b""  # closed, unanswered
    finally:
        for sock in sockets:
            sock.close()
    assert_alive(served)


def test_concurrent_reranks_beside_a_chat_model(served: Served) -> None:
    documents = [f"document {i}: the cat purrs" for i in range(60)]
    statuses: list[int] = []
    chats: list[int] = []

    def rerank() -> None:
        answer = post(served, {**BASE, "documents": documents, "top_n": 3})
        if answer.status == 200:
            check_results(answer, 60, 3)
        statuses.append(answer.status)

    def chat() -> None:
        body = {"model": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        chats.append(post(served, body, "/v1/chat/completions").status)

    threads = [threading.Thread(target=rerank) for _ in range(12)] + [
        threading.Thread(target=chat) for _ in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert set(chats) <= {200, 429}, chats
    assert 200 in chats, chats
    assert set(statuses) <= {200, 429}, statuses
    assert 200 in statuses, statuses
    assert_alive(served)


@pytest.mark.parametrize("model", ["rr1", "rr1t"])
def test_a_model_with_one_slot_and_no_queue_refuses_a_second_concurrent_rerank(
    served: Served, model: str
) -> None:
    """slots: 1, queue_size: 0: one call runs, the others are 429 server_overloaded at once,
    whichever isolation the model runs in."""
    documents = [f"document {i}: " + "the cat purrs " * 10 for i in range(150)]
    statuses: list[int] = []
    gate = threading.Barrier(4)

    def rerank() -> None:
        gate.wait()
        statuses.append(post(served, {**BASE, "model": model, "documents": documents}).status)

    threads = [threading.Thread(target=rerank) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert 200 in statuses, statuses
    assert 429 in statuses, statuses


LONG_DOCUMENTS: Final = tuple(f"document {i}: " + "the cat purrs " * 10 for i in range(900))  # ~3 s


def _send_rerank(served: Served, sock: socket.socket, body: dict[str, Any]) -> None:
    raw = json.dumps(body).encode()
    sock.sendall(
        b"POST /v1/rerank HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
        + f"Authorization: Bearer {served.token}\r\nContent-Length: {len(raw)}\r\n\r\n".encode()
        + raw
    )


@pytest.mark.parametrize("model", ["rr", "rr1t"])  # isolation process, thread
def test_an_abandoned_rerank_stops_and_fails_nothing(
    served: Served, monkeypatch: pytest.MonkeyPatch, model: str
) -> None:
    """A client that sends a long rerank and hangs up: its handler is cancelled; the model
    should stop scoring its pairs soon, and no thread may die of an exception on the way."""
    failures: list[str] = []
    monkeypatch.setattr(
        threading, "excepthook", lambda args: failures.append(f"{args.thread}: {args.exc_type.__name__}")
    )
    daemon = served.daemon
    assert daemon.app is not None
    engine = daemon.app[appkeys.REGISTRY].get(model).engine

    def scoring() -> bool:
        if isinstance(engine, RemoteEngine):  # a call to its process, until the process answers it
            return bool(engine._embeds)
        return not engine.idle  # in the daemon: its job queue

    with socket.create_connection(("127.0.0.1", daemon.port), timeout=10) as sock:
        _send_rerank(served, sock, {**BASE, "model": model, "documents": list(LONG_DOCUMENTS)})
        wait_for(scoring, what="the rerank to reach the engine")
        time.sleep(0.3)
        assert scoring()  # its pairs are being scored, past the tokenizing
    hung_up = time.monotonic()
    wait_for(lambda: not scoring(), timeout=30, what="the scoring to end")
    still_scoring_s = time.monotonic() - hung_up
    time.sleep(0.1)
    assert_alive(served)
    problems = [f"threads died: {failures}"] if failures else []
    if still_scoring_s > 1.0:
        problems.append(f"the model scored a hung-up client's pairs for {still_scoring_s:.1f} s more")
    assert not problems, problems


def test_a_rerank_longer_than_the_engine_call_timeout_is_answered(
    served: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rerank within every documented limit may take minutes on a real model (262,144 tokens
    on a CPU, or behind other reranks that take turns with it); the engine process shows
    progress all along. Simulated here with a 0.5 s call timeout and a 3 s rerank: it must be
    answered, and whatever happens, not with a bare 500."""
    monkeypatch.setattr("edgellmd.engine.remote.CALL_TIMEOUT_S", 0.5)
    answer = post(served, {**BASE, "documents": list(LONG_DOCUMENTS), "top_n": 2})
    check_results(answer, len(LONG_DOCUMENTS), 2)


def test_a_compressed_body_that_inflates_past_the_limit_is_refused(served: Served) -> None:
    bomb = gzip.compress(b'{"model": "rr", "query": "q", "documents": ["' + b"x" * 50_000_000 + b'"]}')
    answer = request(
        served.daemon, "/v1/rerank", bomb, token=served.token, headers={"Content-Encoding": "gzip"}
    )
    assert answer.status == 413, answer.raw[:300]
    garbage = request(
        served.daemon,
        "/v1/rerank",
        b"not gzip at all",
        token=served.token,
        headers={"Content-Encoding": "gzip"},
    )
    assert garbage.status == 400, garbage.raw[:300]
    assert_alive(served)


def test_a_declared_length_past_the_limit_is_refused_without_waiting_for_it(served: Served) -> None:
    with socket.create_connection(("127.0.0.1", served.daemon.port), timeout=10) as sock:
        sock.sendall(
            b"POST /v1/rerank HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
            + f"Authorization: Bearer {served.token}\r\nContent-Length: {10**12}\r\n\r\n".encode()
        )
        started = time.monotonic()
        head = _read_head(sock)
    assert head.startswith(b"HTTP/1.1 413"), head[:200]
    assert time.monotonic() - started < 0.9  # before body_timeout_s
