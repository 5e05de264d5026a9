"""The OpenAI-compatible endpoints over real sockets: response shapes, the bad-input table, sampling."""

from __future__ import annotations

import gzip
import json
import re
import time
import zlib
from dataclasses import dataclass, field
from typing import Any, Final

import aiohttp
import pytest

from tests.ggufmodels import N_VOCAB
from tests.serving import RunningDaemon

CHAT: Final = "/v1/chat/completions"
COMPLETIONS: Final = "/v1/completions"
HELLO: Final = [{"role": "user", "content": "hello"}]
# Coupled to tests/conftest.py: `tiny` has 256 tokens of context per slot, the server a
# max_tokens_limit of 512 and max_body_bytes of 65536.
TINY_CONTEXT: Final = 256
MAX_BODY_BYTES: Final = 65536
# The tiny template renders "<s><|user|>hello\n<|assistant|>": BOS, then one token per byte.
HELLO_CHAT_PROMPT_TOKENS: Final = 1 + len(b"<|user|>hello\n<|assistant|>")
HELLO_TEXT_PROMPT_TOKENS: Final = 1 + len(b"hello")  # BOS, then one token per byte
GENERATED_ID: Final = re.compile(r"[0-9a-f]{32}")


def counts(usage: dict[str, Any]) -> dict[str, Any]:
    """The token counts of a usage object; its details (cached, drafted) depend on earlier requests."""
    assert isinstance(usage["prompt_tokens_details"]["cached_tokens"], int)
    assert usage["completion_tokens_details"] == {
        "accepted_prediction_tokens": 0,
        "rejected_prediction_tokens": 0,
    }  # no speculation configured here
    return {k: v for k, v in usage.items() if not k.endswith("_details")}


def chat_body(**fields: Any) -> dict[str, Any]:
    """A valid chat body for `tiny`, with `fields` added or replaced."""
    return {"model": "tiny", "messages": HELLO, **fields}


def completion_body(**fields: Any) -> dict[str, Any]:
    """A valid completion body for `tiny`, with `fields` added or replaced."""
    return {"model": "tiny", "prompt": "hello", **fields}


def without(body: dict[str, Any], key: str) -> dict[str, Any]:
    """`body` less one key."""
    return {k: v for k, v in body.items() if k != key}


def nested(depth: int) -> Any:
    """A JSON value `depth` lists deep."""
    value: Any = []
    for _ in range(depth - 1):
        value = [value]
    return value


def assert_envelope(body: Any) -> dict[str, Any]:
    """Check OpenAI's error envelope shape and return its `error` object."""
    assert isinstance(body, dict)
    assert set(body) == {"error"}
    error: dict[str, Any] = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str)
    assert error["message"]
    return error


# ---- response shapes ----------------------------------------------------------------------


def test_chat_completion_shape(daemon: RunningDaemon) -> None:
    before = time.time()
    status, body = daemon.post(CHAT, chat_body(max_tokens=8, ignore_eos=True, temperature=0))
    assert status == 200
    assert set(body) >= {"id", "object", "created", "model", "choices", "usage"}
    assert body["id"].startswith("chatcmpl-")
    assert len(body["id"]) > len("chatcmpl-")
    assert body["object"] == "chat.completion"
    assert isinstance(body["created"], int)
    assert before - 2 <= body["created"] <= time.time() + 2
    assert body["model"] == "tiny"
    [choice] = body["choices"]
    assert choice["index"] == 0
    assert choice["message"]["role"] == "assistant"
    assert isinstance(choice["message"]["content"], str)
    assert choice["message"]["content"]
    assert choice["finish_reason"] == "length"
    assert counts(body["usage"]) == {
        "prompt_tokens": HELLO_CHAT_PROMPT_TOKENS,
        "completion_tokens": 8,
        "total_tokens": HELLO_CHAT_PROMPT_TOKENS + 8,
    }


def test_text_completion_shape(daemon: RunningDaemon) -> None:
    before = time.time()
    status, body = daemon.post(COMPLETIONS, completion_body(max_tokens=8, ignore_eos=True, temperature=0))
    assert status == 200
    assert body["id"].startswith("cmpl-")
    assert len(body["id"]) > len("cmpl-")
    assert body["object"] == "text_completion"
    assert isinstance(body["created"], int)
    assert before - 2 <= body["created"] <= time.time() + 2
    assert body["model"] == "tiny"
    [choice] = body["choices"]
    assert choice["index"] == 0
    assert isinstance(choice["text"], str)
    assert choice["text"]
    assert "message" not in choice
    assert choice["finish_reason"] == "length"
    assert counts(body["usage"]) == {
        "prompt_tokens": HELLO_TEXT_PROMPT_TOKENS,
        "completion_tokens": 8,
        "total_tokens": HELLO_TEXT_PROMPT_TOKENS + 8,
    }


def test_ids_are_unique_per_response(daemon: RunningDaemon) -> None:
    ids = {daemon.post(COMPLETIONS, completion_body(max_tokens=1))[1]["id"] for _ in range(3)}
    assert len(ids) == 3


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_without_ignore_eos_the_generation_may_stop_early(daemon: RunningDaemon, path: str) -> None:
    body = chat_body(max_tokens=20) if path == CHAT else completion_body(max_tokens=20)
    status, answer = daemon.post(path, body)
    assert status == 200
    usage = answer["usage"]
    assert 0 <= usage["completion_tokens"] <= 20
    assert usage["prompt_tokens"] + usage["completion_tokens"] == usage["total_tokens"]
    reason = answer["choices"][0]["finish_reason"]
    assert reason in {"stop", "length"}
    assert (reason == "length") == (usage["completion_tokens"] == 20)


def test_completions_default_to_16_tokens(daemon: RunningDaemon) -> None:
    # OpenAI's documented default for the legacy endpoint.
    status, body = daemon.post(COMPLETIONS, completion_body(ignore_eos=True))
    assert status == 200
    assert body["usage"]["completion_tokens"] == 16
    assert body["choices"][0]["finish_reason"] == "length"


def test_chat_without_max_tokens_runs_until_the_context_is_full(daemon: RunningDaemon) -> None:
    status, body = daemon.post(CHAT, chat_body(ignore_eos=True))
    assert status == 200
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["prompt_tokens"] == HELLO_CHAT_PROMPT_TOKENS
    assert TINY_CONTEXT - 1 <= body["usage"]["total_tokens"] <= TINY_CONTEXT


def test_builtin_template_model_serves_chat(daemon: RunningDaemon) -> None:
    status, body = daemon.post(CHAT, chat_body(model="builtin", max_tokens=4, ignore_eos=True))
    assert status == 200
    assert body["model"] == "builtin"
    # llama.cpp's chatml; the tiny vocabulary has no <|im_start|> token, so every byte is one.
    rendered = "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    assert counts(body["usage"]) == {
        "prompt_tokens": 1 + len(rendered.encode()),
        "completion_tokens": 4,
        "total_tokens": 1 + len(rendered.encode()) + 4,
    }


async def test_request_id_header_on_answers_and_errors(daemon: RunningDaemon) -> None:
    async with aiohttp.ClientSession() as session:
        async with session.post(daemon.url + CHAT, json=chat_body(max_tokens=1)) as resp:
            assert resp.status == 200
            first = resp.headers["X-Request-Id"]
            await resp.read()
        async with session.post(daemon.url + COMPLETIONS, json=completion_body(max_tokens=1)) as resp:
            assert resp.status == 200
            second = resp.headers["X-Request-Id"]
            await resp.read()
        async with session.get(daemon.url + "/v1/nothing") as resp:
            assert resp.status == 404
            third = resp.headers["X-Request-Id"]
            assert resp.content_type == "application/json"
            await resp.read()
        async with session.post(daemon.url + CHAT, json=chat_body(temperature=-1)) as resp:
            assert resp.status == 400
            fourth = resp.headers["X-Request-Id"]
            await resp.read()
    ids = [first, second, third, fourth]
    assert all(GENERATED_ID.fullmatch(i) for i in ids)
    assert len(set(ids)) == 4


@pytest.mark.parametrize(
    ("given", "echoed"),
    [
        ("client-id_1.2", True),
        ("a" * 64, True),
        ("a" * 65, False),  # too long
        ("bad id!", False),  # outside [A-Za-z0-9._-]
        ("", False),
    ],
)
async def test_client_request_id_is_kept_only_when_sane(
    daemon: RunningDaemon, given: str, echoed: bool
) -> None:
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            daemon.url + COMPLETIONS, json=completion_body(max_tokens=1), headers={"X-Request-Id": given}
        ) as resp,
    ):
        assert resp.status == 200
        rid = resp.headers["X-Request-Id"]
        await resp.read()
    if echoed:
        assert rid == given
    else:
        assert GENERATED_ID.fullmatch(rid)


# ---- models and probes --------------------------------------------------------------------


def test_models_lists_every_served_model(daemon: RunningDaemon) -> None:
    status, body = daemon.get("/v1/models")
    assert status == 200
    assert body["object"] == "list"
    assert [m["id"] for m in body["data"]] == ["tiny", "notemplate", "builtin"]
    for model in body["data"]:
        assert model["object"] == "model"
        assert model["owned_by"] == "edgellm"
        assert isinstance(model["created"], int)
        assert model["created"] <= time.time() + 2


def test_healthz(daemon: RunningDaemon) -> None:
    assert daemon.get("/healthz") == (200, {"status": "ok"})


def test_readyz(daemon: RunningDaemon) -> None:
    status, body = daemon.get("/readyz")
    assert status == 200
    assert body["status"] == "ready"
    assert body["models"] == {name: {"state": "ready"} for name in ("tiny", "notemplate", "builtin")}


# ---- the bad-input table ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Req:
    """One request of the bad-input table: JSON `body`, or `raw` bytes as they go on the wire."""

    path: str = CHAT
    body: Any = None
    raw: bytes | None = None
    content_type: str = "application/json"
    method: str = "POST"
    headers: dict[str, str] = field(default_factory=dict)


Expected = tuple[int, str, str | None, str | None]  # status, error type, param, code


def bad(
    case_id: str,
    req: Req,
    status: int,
    param: str | None,
    code: str | None = None,
    *,
    type_: str = "invalid_request_error",
) -> Any:
    """One row: the request and the envelope it must get."""
    expected: Expected = (status, type_, param, code)
    return pytest.param(req, expected, id=case_id)


UNSUPPORTED: Final = "unsupported_parameter"
IMAGE_PART: Final = {"type": "image_url", "image_url": {"url": "http://127.0.0.1/x.png"}}
# A 1x1 PNG as a data: URL.
PNG_PART: Final = {
    "type": "image_url",
    "image_url": {
        "url": "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAIAAACQd1PeAAAADElEQVR4"
        "nGNgYGAAAAAEAAH2FzhVAAAAAElFTkSuQmCC"
    },
}
TOOL: Final = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


def _tool_taking(parameters: Any) -> dict[str, Any]:
    return {"type": "function", "function": {"name": "f", "parameters": parameters}}


BAD_INPUTS: Final = [
    # The body itself.
    bad("malformed-json", Req(raw=b'{"model": "tiny",'), 400, None),
    bad("empty-body", Req(raw=b""), 400, None),
    bad("body-is-array", Req(raw=b'[{"model": "tiny"}]'), 400, None),
    bad("body-is-string", Req(raw=b'"tiny"'), 400, None),
    bad(
        "content-type-text-plain",
        Req(raw=json.dumps(chat_body()).encode(), content_type="text/plain"),
        415,
        None,
        "unsupported_media_type",
    ),
    bad(
        "charset-latin-1",  # JSON is UTF-8: a body said to be another charset is not read as UTF-8
        Req(raw=json.dumps(chat_body()).encode(), content_type="application/json; charset=latin-1"),
        415,
        None,
        "unsupported_media_type",
    ),
    bad(
        "content-encoding-unknown",  # aiohttp would hand the bytes on undecoded
        Req(raw=json.dumps(chat_body()).encode(), headers={"Content-Encoding": "bogus"}),
        415,
        None,
        "unsupported_media_type",
    ),
    bad(
        "content-encoding-stacked",
        Req(raw=json.dumps(chat_body()).encode(), headers={"Content-Encoding": "gzip, deflate"}),
        415,
        None,
        "unsupported_media_type",
    ),
    bad(
        "invalid-utf8",
        Req(raw=b'{"model": "tiny", "messages": [{"role": "user", "content": "\xff\xfe"}]}'),
        400,
        None,
    ),
    bad("nesting-100-deep", Req(body=chat_body(metadata=nested(100))), 400, None),
    bad("nesting-30000-deep", Req(raw=b'{"metadata": ' + b"[" * 30000 + b"]" * 30000 + b"}"), 400, None),
    bad(
        "body-over-limit",
        Req(body=chat_body(user="x" * (MAX_BODY_BYTES + 100))),
        413,
        None,
        "payload_too_large",
    ),
    # An integer literal longer than Python's int-conversion limit (4300 digits).
    bad(
        "integer-literal-5000-digits",
        Req(
            raw=b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "seed": 1'
            + b"0" * 5000
            + b"}"
        ),
        400,
        None,
    ),
    bad("unknown-field", Req(body=chat_body(frobnicate=1)), 400, "frobnicate", "unknown_parameter"),
    # model
    bad("model-missing", Req(body=without(chat_body(), "model")), 400, "model"),
    bad("model-wrong-type", Req(body=chat_body(model=5)), 400, "model"),
    bad("model-empty", Req(body=chat_body(model="")), 400, "model"),
    bad("model-unknown", Req(body=chat_body(model="nope")), 404, "model", "model_not_found"),
    bad(
        "model-unknown-completions",
        Req(COMPLETIONS, completion_body(model="nope")),
        404,
        "model",
        "model_not_found",
    ),
    # messages
    bad("messages-missing", Req(body=without(chat_body(), "messages")), 400, "messages"),
    bad("messages-empty", Req(body=chat_body(messages=[])), 400, "messages"),
    bad("messages-not-a-list", Req(body=chat_body(messages="hello")), 400, "messages"),
    bad("message-not-an-object", Req(body=chat_body(messages=["hello"])), 400, "messages[0]"),
    bad(
        "role-wizard",
        Req(body=chat_body(messages=[{"role": "wizard", "content": "hi"}])),
        400,
        "messages[0].role",
    ),
    bad("role-missing", Req(body=chat_body(messages=[{"content": "hi"}])), 400, "messages[0].role"),
    bad(
        "role-is-a-list",
        Req(body=chat_body(messages=[{"role": ["user"], "content": "hi"}])),
        400,
        "messages[0].role",
    ),
    bad(
        "second-message-bad-role",
        Req(body=chat_body(messages=[*HELLO, {"role": "wizard", "content": "hi"}])),
        400,
        "messages[1].role",
    ),
    bad(
        "content-wrong-type",
        Req(body=chat_body(messages=[{"role": "user", "content": 5}])),
        400,
        "messages[0].content",
    ),
    bad("content-missing", Req(body=chat_body(messages=[{"role": "user"}])), 400, "messages[0].content"),
    bad(  # an http(s) image URL is fetched only from the hosts media.fetch_hosts lists (none here)
        "content-image-url-not-fetched",
        Req(body=chat_body(messages=[{"role": "user", "content": [IMAGE_PART]}])),
        400,
        "messages[0].content[0].image_url.url",
        "invalid_image",
    ),
    bad(
        "content-image-in-a-system-message",
        Req(body=chat_body(messages=[{"role": "system", "content": [IMAGE_PART]}, *HELLO])),
        400,
        "messages[0].content[0].type",
        UNSUPPORTED,
    ),
    bad(
        "content-image-on-a-text-model",
        Req(body=chat_body(messages=[{"role": "user", "content": [PNG_PART]}])),
        400,
        "messages",
        "model_not_supported",
    ),
    bad(
        "content-part-without-type",
        Req(body=chat_body(messages=[{"role": "user", "content": [{"text": "hi"}]}])),
        400,
        "messages[0].content[0]",
    ),
    bad(
        "content-part-text-wrong-type",
        Req(body=chat_body(messages=[{"role": "user", "content": [{"type": "text", "text": 1}]}])),
        400,
        "messages[0].content[0].text",
    ),
    bad(
        "message-unknown-field",
        Req(body=chat_body(messages=[{"role": "user", "content": "hi", "mood": "sunny"}])),
        400,
        "messages[0].mood",
    ),
    bad(
        "tool-message-without-call-id",
        Req(body=chat_body(messages=[*HELLO, {"role": "tool", "content": "42"}])),
        400,
        "messages[1].tool_call_id",
    ),
    bad(
        "user-tool-calls",
        Req(body=chat_body(messages=[{"role": "user", "content": "", "tool_calls": []}])),
        400,
        "messages[0].tool_calls",
    ),
    bad(
        "chat-template-missing",
        Req(body=chat_body(model="notemplate")),
        400,
        "messages",
        "chat_template_missing",
    ),
    bad(
        "chat-prompt-over-context",
        Req(body=chat_body(messages=[{"role": "user", "content": "a" * 400}])),
        400,
        "messages",
        "context_length_exceeded",
    ),
    # sampling
    bad("temperature-negative", Req(body=chat_body(temperature=-1)), 400, "temperature"),
    bad("temperature-string", Req(body=chat_body(temperature="hot")), 400, "temperature"),
    bad("temperature-over-2", Req(body=chat_body(temperature=2.5)), 400, "temperature"),
    bad("temperature-bool", Req(body=chat_body(temperature=True)), 400, "temperature"),
    bad(
        "temperature-nan",
        Req(raw=b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "temperature": NaN}'),
        400,
        "temperature",
    ),
    bad("top-p-2", Req(body=chat_body(top_p=2)), 400, "top_p"),
    bad("top-p-negative", Req(body=chat_body(top_p=-0.1)), 400, "top_p"),
    bad("presence-penalty-3", Req(body=chat_body(presence_penalty=3)), 400, "presence_penalty"),
    bad("frequency-penalty-minus-3", Req(body=chat_body(frequency_penalty=-3)), 400, "frequency_penalty"),
    bad("seed-string", Req(body=chat_body(seed="42")), 400, "seed"),
    bad("ignore-eos-string", Req(body=chat_body(ignore_eos="yes")), 400, "ignore_eos"),
    # max_tokens
    bad("max-tokens-0", Req(body=chat_body(max_tokens=0)), 400, "max_tokens"),
    bad("max-tokens-float", Req(body=chat_body(max_tokens=1.5)), 400, "max_tokens"),
    bad("max-tokens-bool", Req(body=chat_body(max_tokens=True)), 400, "max_tokens"),
    bad("max-tokens-over-server-limit", Req(body=chat_body(max_tokens=100000)), 400, "max_tokens"),
    bad("max-tokens-limit-plus-one", Req(body=chat_body(max_tokens=513)), 400, "max_tokens"),
    bad(
        "max-completion-tokens-0", Req(body=chat_body(max_completion_tokens=0)), 400, "max_completion_tokens"
    ),
    bad(
        "max-completion-tokens-over-limit",
        Req(body=chat_body(max_completion_tokens=100000)),
        400,
        "max_completion_tokens",
    ),
    # stop
    bad("stop-5-strings", Req(body=chat_body(stop=["a", "b", "c", "d", "e"])), 400, "stop"),
    bad("stop-number", Req(body=chat_body(stop=5)), 400, "stop"),
    bad("stop-list-with-number", Req(body=chat_body(stop=["a", 1])), 400, "stop"),
    bad("stop-too-long", Req(body=chat_body(stop="x" * 257)), 400, "stop"),
    # streaming
    bad("stream-string", Req(body=chat_body(stream="yes")), 400, "stream"),
    bad(
        "stream-options-without-stream",
        Req(body=chat_body(stream_options={"include_usage": True})),
        400,
        "stream_options",
    ),
    bad(
        "stream-options-unknown-key",
        Req(body=chat_body(stream=True, stream_options={"include_usage": True, "x": 1})),
        400,
        "stream_options",
    ),
    bad(
        "stream-options-not-object",
        Req(body=chat_body(stream=True, stream_options=True)),
        400,
        "stream_options",
    ),
    # not implemented: refused rather than silently ignored
    bad("n-17", Req(body=chat_body(n=17)), 400, "n"),
    bad("n-0", Req(body=chat_body(n=0)), 400, "n"),
    bad("top-logprobs-without-logprobs", Req(body=chat_body(top_logprobs=2)), 400, "top_logprobs"),
    bad("top-logprobs-21", Req(body=chat_body(logprobs=True, top_logprobs=21)), 400, "top_logprobs"),
    bad("tools-not-a-list", Req(body=chat_body(tools={"a": 1})), 400, "tools"),
    bad(
        "tool-bad-name",
        Req(body=chat_body(tools=[{"type": "function", "function": {"name": "a b"}}])),
        400,
        "tools[0].function.name",
    ),
    *[
        bad(
            f"tool-parameters-{label}",
            Req(body=chat_body(tools=[_tool_taking(schema)])),
            400,
            "tools[0].function.parameters",
        )
        for label, schema in (
            ("integer", {"type": "integer"}),
            ("string", {"type": "string"}),
            ("null", {"type": "null"}),
            ("list", []),
            ("type-list", {"type": ["object", "null"]}),
        )
    ],
    bad("ignored-store-string", Req(body=chat_body(store="yes")), 400, "store"),
    bad(
        "ignored-parallel-tool-calls-number",
        Req(body=chat_body(parallel_tool_calls=1)),
        400,
        "parallel_tool_calls",
    ),
    bad("ignored-reasoning-effort-number", Req(body=chat_body(reasoning_effort=3)), 400, "reasoning_effort"),
    bad("ignored-prediction-string", Req(body=chat_body(prediction="x")), 400, "prediction"),
    bad("ignored-metadata-list", Req(body=chat_body(metadata=[1])), 400, "metadata"),
    bad("ignored-metadata-number-value", Req(body=chat_body(metadata={"k": 1})), 400, "metadata"),
    bad(
        "ignored-metadata-17-keys",
        Req(body=chat_body(metadata={f"k{i}": "v" for i in range(17)})),
        400,
        "metadata",
    ),
    bad("ignored-verbosity-object", Req(body=chat_body(verbosity={})), 400, "verbosity"),
    bad("tool-choice-without-tools", Req(body=chat_body(tool_choice="auto")), 400, "tool_choice"),
    bad(
        "tool-choice-unknown-name",
        Req(body=chat_body(tools=[TOOL], tool_choice={"type": "function", "function": {"name": "g"}})),
        400,
        "tool_choice",
    ),
    bad(
        "tool-parameters-unsupported-keyword",
        Req(
            body=chat_body(
                tools=[
                    {
                        "type": "function",
                        # strict: held to the exact subset (a tool that is not strict is relaxed)
                        "function": {
                            "name": "f",
                            "strict": True,
                            "parameters": {"type": "object", "patternProperties": {}},
                        },
                    }
                ]
            )
        ),
        400,
        "tools[0].function.parameters",
        UNSUPPORTED,
    ),
    bad("functions", Req(body=chat_body(functions=[TOOL["function"]])), 400, "functions", UNSUPPORTED),
    bad(
        "response-format-xml",
        Req(body=chat_body(response_format={"type": "xml"})),
        400,
        "response_format.type",
    ),
    bad("response-format-not-object", Req(body=chat_body(response_format="json")), 400, "response_format"),
    bad(
        "response-format-schema-missing-name",
        Req(
            body=chat_body(
                response_format={"type": "json_schema", "json_schema": {"schema": {"type": "object"}}}
            )
        ),
        400,
        "response_format.json_schema",
    ),
    bad(
        "response-format-unsupported-keyword",
        Req(
            body=chat_body(
                response_format={
                    "type": "json_schema",
                    "json_schema": {
                        "name": "x",
                        "schema": {"type": "object", "properties": {"a": {"type": "string", "minLength": 2}}},
                    },
                }
            )
        ),
        400,
        "response_format.json_schema.schema",
        UNSUPPORTED,
    ),
    bad(
        "response-format-with-tools-still-checked",
        Req(body=chat_body(tools=[TOOL], tool_choice="required", response_format={"type": "yaml"})),
        400,
        "response_format.type",
    ),
    bad("logit-bias-not-a-token", Req(body=chat_body(logit_bias={"a": 5})), 400, "logit_bias"),
    bad("logit-bias-too-big", Req(body=chat_body(logit_bias={"1": 500})), 400, "logit_bias"),
    bad("logit-bias-beyond-vocab", Req(body=chat_body(logit_bias={"99999": 5})), 400, "logit_bias"),
    bad("modalities-audio", Req(body=chat_body(modalities=["audio"])), 400, "modalities", UNSUPPORTED),
    # /v1/completions
    bad(
        "completions-prompt-over-context",
        Req(COMPLETIONS, completion_body(prompt="a" * 400)),
        400,
        "prompt",
        "context_length_exceeded",
    ),
    bad(
        "completions-token-prompt-over-context",
        Req(COMPLETIONS, completion_body(prompt=[65] * 300)),
        400,
        "prompt",
        "context_length_exceeded",
    ),
    bad("completions-echo", Req(COMPLETIONS, completion_body(echo=True)), 400, "echo", UNSUPPORTED),
    bad("completions-suffix", Req(COMPLETIONS, completion_body(suffix="!")), 400, "suffix", UNSUPPORTED),
    bad("completions-best-of-2", Req(COMPLETIONS, completion_body(best_of=2)), 400, "best_of", UNSUPPORTED),
    bad("completions-logprobs-6", Req(COMPLETIONS, completion_body(logprobs=6)), 400, "logprobs"),
    bad("completions-prompt-missing", Req(COMPLETIONS, without(completion_body(), "prompt")), 400, "prompt"),
    bad("completions-prompt-number", Req(COMPLETIONS, completion_body(prompt=5)), 400, "prompt"),
    bad("completions-prompt-empty-list", Req(COMPLETIONS, completion_body(prompt=[])), 400, "prompt"),
    bad(
        "completions-two-prompts",
        Req(COMPLETIONS, completion_body(prompt=["a", "b"])),
        400,
        "prompt",
        UNSUPPORTED,
    ),
    bad(
        "completions-two-token-prompts",
        Req(COMPLETIONS, completion_body(prompt=[[65], [66]])),
        400,
        "prompt",
        UNSUPPORTED,
    ),
    bad("completions-negative-token", Req(COMPLETIONS, completion_body(prompt=[65, -1])), 400, "prompt"),
    bad(
        "completions-token-past-vocab", Req(COMPLETIONS, completion_body(prompt=[65, N_VOCAB])), 400, "prompt"
    ),
    bad("completions-bool-tokens", Req(COMPLETIONS, completion_body(prompt=[True])), 400, "prompt"),
    bad(
        "completions-max-completion-tokens",
        Req(COMPLETIONS, completion_body(max_completion_tokens=4)),
        400,
        "max_completion_tokens",
        "unknown_parameter",
    ),
    bad(
        "completions-messages",
        Req(COMPLETIONS, completion_body(messages=HELLO)),
        400,
        "messages",
        "unknown_parameter",
    ),
    bad("chat-prompt-field", Req(body=chat_body(prompt="hi")), 400, "prompt", "unknown_parameter"),
    # routing
    bad("unknown-route-get", Req("/v1/nothing", method="GET"), 404, None, "not_found"),
    bad("unknown-route-post", Req("/v1/nothing", chat_body()), 404, None, "not_found"),
    bad("get-chat-completions", Req(CHAT, method="GET"), 405, None, "method_not_allowed"),
    bad("get-completions", Req(COMPLETIONS, method="GET"), 405, None, "method_not_allowed"),
    bad("post-models", Req("/v1/models", {}), 405, None, "method_not_allowed"),
]


@pytest.mark.parametrize(("req", "expected"), BAD_INPUTS)
def test_bad_input(daemon: RunningDaemon, req: Req, expected: Expected) -> None:
    if req.method == "GET":
        got_status, body = daemon.get(req.path)
    else:
        raw = req.raw if req.raw is not None else json.dumps(req.body).encode()
        got_status, body = daemon.post(
            req.path, None, raw=raw, headers={"Content-Type": req.content_type, **req.headers}
        )
    error = assert_envelope(body)
    assert (got_status, error["type"], error["param"], error["code"]) == expected
    assert len(error["message"]) < 200
    assert error["message"].isprintable()


UNPRINTABLE: Final = "\x1b[2J\x00\u202e"
HUGE_NAME: Final = "k" * 10_000


@pytest.mark.parametrize(
    ("path", "body"),
    [
        pytest.param(CHAT, chat_body(**{HUGE_NAME: 1}), id="huge-field-name"),
        pytest.param(CHAT, chat_body(**{UNPRINTABLE: 1}), id="unprintable-field-name"),
        pytest.param(COMPLETIONS, completion_body(**{HUGE_NAME: 1}), id="huge-field-name-completions"),
        pytest.param(
            CHAT,
            chat_body(messages=[{"role": "user", "content": "hi", HUGE_NAME: 1}]),
            id="huge-message-field-name",
        ),
        pytest.param(
            CHAT,
            chat_body(messages=[{"role": "user", "content": "hi", UNPRINTABLE: 1}]),
            id="unprintable-message-field-name",
        ),
        pytest.param(CHAT, chat_body(model=HUGE_NAME), id="huge-model-name"),
        pytest.param(CHAT, chat_body(model=UNPRINTABLE), id="unprintable-model-name"),
        pytest.param(
            CHAT,
            chat_body(messages=[{"role": "user", "content": [{"type": HUGE_NAME}]}]),
            id="huge-content-part-type",
        ),
        pytest.param(
            CHAT, chat_body(response_format={"type": UNPRINTABLE}), id="unprintable-response-format"
        ),
        pytest.param(CHAT, chat_body(max_tokens=10**4000), id="huge-max-tokens-number"),
        pytest.param(CHAT, chat_body(seed=10**4000), id="huge-seed-number"),
    ],
)
def test_errors_never_echo_huge_or_unprintable_input(
    daemon: RunningDaemon, path: str, body: dict[str, Any]
) -> None:
    status, answer = daemon.post(path, body)
    assert status in {400, 404}
    error = assert_envelope(answer)
    assert len(error["message"]) < 200
    assert error["message"].isprintable()
    assert HUGE_NAME[:100] not in error["message"]
    assert UNPRINTABLE not in error["message"]
    if error["param"] is not None:
        assert len(error["param"]) < 100
        assert error["param"].isprintable()


# ---- accepted input -----------------------------------------------------------------------


def greedy_text(daemon: RunningDaemon, path: str, body: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """POST a request that must succeed; its text and the whole answer."""
    status, answer = daemon.post(path, body)
    assert status == 200, answer
    choice = answer["choices"][0]
    text = choice["message"]["content"] if path == CHAT else choice["text"]
    assert isinstance(text, str)
    return text, answer


GREEDY: Final = {"temperature": 0, "max_tokens": 12, "ignore_eos": True}


@pytest.mark.parametrize(
    ("coding", "charset"),
    [("gzip", None), ("deflate", None), ("identity", None), (None, "utf-8"), (None, "UTF8")],
)
def test_a_body_in_a_coding_aiohttp_decodes_or_said_to_be_utf8_is_read(
    daemon: RunningDaemon, coding: str | None, charset: str | None
) -> None:
    raw = json.dumps(chat_body(**GREEDY)).encode()
    headers = {"Content-Type": "application/json" + (f"; charset={charset}" if charset else "")}
    if coding is not None:
        headers["Content-Encoding"] = coding
        raw = gzip.compress(raw) if coding == "gzip" else zlib.compress(raw) if coding == "deflate" else raw
    status, answer = daemon.post(CHAT, None, raw=raw, headers=headers)
    assert status == 200, answer
    assert answer["usage"]["completion_tokens"] == 12


def test_ignored_fields_change_nothing(daemon: RunningDaemon) -> None:
    plain, _ = greedy_text(daemon, CHAT, chat_body(**GREEDY))
    extras = {
        "user": "u-1",
        "store": False,
        "metadata": {"k": "v"},
        "service_tier": "auto",
        "parallel_tool_calls": False,
        "tool_choice": "none",
        "n": 1,
        "logprobs": False,
        "logit_bias": {},
        "response_format": {"type": "text"},
        "modalities": ["text"],
        "stream": False,
        "stop": [],
    }
    text, answer = greedy_text(daemon, CHAT, chat_body(**GREEDY, **extras))
    assert text == plain
    assert answer["usage"]["completion_tokens"] == 12
    text, _ = greedy_text(
        daemon, COMPLETIONS, completion_body(**GREEDY, user="u-1", best_of=1, echo=False, logprobs=None)
    )
    assert text == greedy_text(daemon, COMPLETIONS, completion_body(**GREEDY))[0]


def test_null_optional_fields_mean_defaults(daemon: RunningDaemon) -> None:
    nulls = {
        "max_tokens": None,
        "temperature": None,
        "top_p": None,
        "stop": None,
        "seed": None,
        "stream": None,
        "stream_options": None,
        "n": None,
    }
    status, answer = daemon.post(COMPLETIONS, completion_body(**nulls, ignore_eos=True))
    assert status == 200
    assert answer["usage"]["completion_tokens"] == 16


def test_developer_role_is_rendered_as_system(daemon: RunningDaemon) -> None:
    def messages(role: str) -> list[dict[str, str]]:
        return [{"role": role, "content": "brief"}, *HELLO]

    developer, dev_answer = greedy_text(daemon, CHAT, chat_body(messages=messages("developer"), **GREEDY))
    system, sys_answer = greedy_text(daemon, CHAT, chat_body(messages=messages("system"), **GREEDY))
    assert developer == system
    # No spaces: llama's tokenizer turns a space into U+2581, three byte tokens here.
    rendered = "<|system|>brief\n<|user|>hello\n<|assistant|>"
    assert (
        dev_answer["usage"]["prompt_tokens"]
        == sys_answer["usage"]["prompt_tokens"]
        == 1 + len(rendered.encode())
    )


def test_content_as_text_parts_equals_the_joined_string(daemon: RunningDaemon) -> None:
    parts = [{"type": "text", "text": "hel"}, {"type": "text", "text": "lo"}]
    text, answer = greedy_text(
        daemon, CHAT, chat_body(messages=[{"role": "user", "content": parts}], **GREEDY)
    )
    assert answer["usage"]["prompt_tokens"] == HELLO_CHAT_PROMPT_TOKENS
    assert text == greedy_text(daemon, CHAT, chat_body(**GREEDY))[0]


def test_token_id_prompt_equals_the_text_prompt(daemon: RunningDaemon) -> None:
    tokens = [1, *(3 + b for b in b"hello")]  # BOS, then the byte tokens <0x68> ...
    text, answer = greedy_text(daemon, COMPLETIONS, completion_body(prompt=tokens, **GREEDY))
    assert answer["usage"]["prompt_tokens"] == HELLO_TEXT_PROMPT_TOKENS
    assert text == greedy_text(daemon, COMPLETIONS, completion_body(**GREEDY))[0]


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_stop_string_truncates_the_output(daemon: RunningDaemon, path: str) -> None:
    make = chat_body if path == CHAT else completion_body
    long = {"temperature": 0, "max_tokens": 40, "ignore_eos": True}
    full, _ = greedy_text(daemon, path, make(**long))
    assert len(full) >= 20
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    expected = full[: full.index(stop)]  # the first occurrence is where it stops
    text, answer = greedy_text(daemon, path, make(**long, stop=[stop]))
    assert text == expected
    assert answer["choices"][0]["finish_reason"] == "stop"
    assert answer["usage"]["completion_tokens"] < 40
    # A stop string given as a plain string works the same; stops that never occur change nothing.
    assert greedy_text(daemon, path, make(**long, stop=stop))[0] == expected
    never = "\u2603never\u2603"
    assert never not in full
    text, answer = greedy_text(daemon, path, make(**long, stop=[never]))
    assert text == full
    assert answer["choices"][0]["finish_reason"] == "length"


def test_max_tokens_is_clamped_to_the_room_left_in_the_context(daemon: RunningDaemon) -> None:
    status, answer = daemon.post(
        COMPLETIONS, completion_body(prompt="a" * 199, max_tokens=500, ignore_eos=True)
    )
    assert status == 200
    usage = answer["usage"]
    assert usage["prompt_tokens"] == 200
    assert answer["choices"][0]["finish_reason"] == "length"
    assert TINY_CONTEXT - 1 <= usage["prompt_tokens"] + usage["completion_tokens"] <= TINY_CONTEXT
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def test_prompt_that_just_fits_leaves_room_for_one_token(daemon: RunningDaemon) -> None:
    # 255 tokens (BOS + 254 bytes) fit in 256; 256 do not.
    status, answer = daemon.post(
        COMPLETIONS, completion_body(prompt="a" * 254, max_tokens=10, ignore_eos=True)
    )
    assert status == 200
    assert counts(answer["usage"]) == {"prompt_tokens": 255, "completion_tokens": 1, "total_tokens": 256}
    assert answer["choices"][0]["finish_reason"] == "length"
    status, answer = daemon.post(COMPLETIONS, completion_body(prompt="a" * 255, max_tokens=10))
    assert status == 400
    assert assert_envelope(answer)["code"] == "context_length_exceeded"


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_greedy_is_deterministic(daemon: RunningDaemon, path: str) -> None:
    make = chat_body if path == CHAT else completion_body
    first, _ = greedy_text(daemon, path, make(temperature=0, max_tokens=24, ignore_eos=True))
    second, _ = greedy_text(daemon, path, make(temperature=0, max_tokens=24, ignore_eos=True))
    assert first == second
    assert first


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_seeded_sampling_is_reproducible(daemon: RunningDaemon, path: str) -> None:
    make = chat_body if path == CHAT else completion_body

    def sample(seed: int) -> str:
        return greedy_text(daemon, path, make(temperature=1, seed=seed, max_tokens=24, ignore_eos=True))[0]

    assert sample(42) == sample(42)
    # Different seeds draw different text (24 draws over ~40 candidates each: a tie is negligible).
    assert sample(42) != sample(43)


@pytest.mark.parametrize("path", ["/healthz", "/v1/models", "/v1/nothing"])
def test_security_headers_on_every_answer(daemon: RunningDaemon, path: str) -> None:
    import urllib.error  # noqa: PLC0415
    import urllib.request  # noqa: PLC0415

    try:
        with urllib.request.urlopen(daemon.url + path, timeout=10) as resp:  # noqa: S310 - loopback
            headers = resp.headers
    except urllib.error.HTTPError as exc:
        with exc:
            headers = exc.headers
    assert headers["X-Content-Type-Options"] == "nosniff"
    assert headers["X-Frame-Options"] == "DENY"
    assert headers["Referrer-Policy"] == "no-referrer"
    assert "default-src 'none'" in headers["Content-Security-Policy"]
    assert headers["Cache-Control"] == "no-store"
    assert headers["Server"] == "edgellm"  # no software versions
    assert "Access-Control-Allow-Origin" not in headers  # no CORS unless configured
