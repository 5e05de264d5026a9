"""One table of API errors, rendered as OpenAI's error envelope with the matching HTTP status."""

from __future__ import annotations

from typing import Any, ClassVar, Final

from edgellmd.redaction import redact


class ApiError(Exception):
    """An error a client should see; subclasses fix the status, `type` and default `code`."""

    status: ClassVar[int] = 400
    type: ClassVar[str] = "invalid_request_error"
    default_code: ClassVar[str | None] = None

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code if code is not None else self.default_code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        """OpenAI's error envelope."""
        return envelope(self.message, self.type, self.param, self.code)


class InvalidRequest(ApiError):
    """400: the request is malformed or asks for something out of range."""


class UnsupportedParameter(ApiError):
    """400: a parameter that is not implemented here, and ignoring it would change the answer."""

    default_code = "unsupported_parameter"


class AuthenticationFailed(ApiError):
    """401: no usable bearer token."""

    status = 401
    type = "authentication_error"
    default_code = "invalid_api_key"


class PermissionDenied(ApiError):
    """403: the key is valid but lacks the scope."""

    status = 403
    type = "permission_error"
    default_code = "insufficient_scope"


class AddressNotAllowed(ApiError):
    """403: admin endpoints are limited to listed networks and the peer is outside them."""

    status = 403
    type = "permission_error"
    default_code = "address_not_allowed"


class RateLimited(ApiError):
    """429: the key is over one of its limits; Retry-After says when to come back."""

    status = 429
    type = "rate_limit_error"
    default_code = "rate_limit_exceeded"


class QuotaExceeded(RateLimited):
    """429: the key spent a day or month budget; Retry-After and x-quota-reset say when it refills."""

    default_code = "quota_exceeded"


class ContextLengthExceeded(ApiError):
    """400: the prompt does not fit in a slot's context."""

    default_code = "context_length_exceeded"


class NotFound(ApiError):
    """404: no such route or model."""

    status = 404
    default_code = "not_found"


class ModelNotFound(NotFound):
    """404: the `model` names no served model."""

    default_code = "model_not_found"


class MethodNotAllowed(ApiError):
    """405: the route exists for other methods."""

    status = 405
    default_code = "method_not_allowed"


class PayloadTooLarge(ApiError):
    """413: the body is over `server.max_body_bytes`."""

    status = 413
    default_code = "payload_too_large"


class ExpectationFailed(ApiError):
    """417: an `Expect` header other than 100-continue (the only expectation HTTP/1.1 defines)."""

    status = 417
    default_code = "expectation_failed"


class UnsupportedMediaType(ApiError):
    """415: POST bodies must be JSON."""

    status = 415
    default_code = "unsupported_media_type"


class ServerOverloaded(ApiError):
    """429: every slot is busy and the model's wait queue is full; come back shortly."""

    status = 429
    type = "rate_limit_error"
    default_code = "server_overloaded"


class ServiceUnavailable(ApiError):
    """503: the model is not loaded (yet); try again later."""

    status = 503
    type = "server_error"
    default_code = "model_not_ready"


class EngineFailed(ServiceUnavailable):
    """503: the model's engine stopped by itself and restarts; retry after Retry-After."""

    default_code = "engine_failed"


class ServerShuttingDown(ServiceUnavailable):
    """503: the server is shutting down; the request was cut (or never started)."""

    default_code = "server_shutting_down"


class KeyRevoked(ApiError):
    """401: the key was revoked, disabled or expired while its request was running or waiting."""

    status = 401
    type = "authentication_error"
    default_code = "invalid_api_key"


class GenerationTimeout(ApiError):
    """504: the model produced nothing within server.progress_timeout_s."""

    status = 504
    type = "server_error"
    default_code = "timeout"


class RequestTimeout(ApiError):
    """408: the request's body did not arrive within server.body_timeout_s."""

    status = 408
    default_code = "request_timeout"


class MalformedRequest(ApiError):
    """400: aiohttp's parser refused the request's bytes."""

    default_code = "malformed_request"


class InternalError(ApiError):
    """500: something broke on our side; the message never carries details."""

    status = 500
    type = "server_error"
    default_code = "internal_error"


UNSHOWN: Final = "(unprintable)"


def shown(value: object, *, limit: int = 64, quote: bool = False, placeholder: str = UNSHOWN) -> str:
    """A client's value, fit to put in a message: itself when short and printable, else a placeholder.

    The one way untrusted text reaches an error message or a log line: a model name, a
    field name, a number (a 4,000-digit integer stays out), a lockfile member. Anything
    shaped like an API key has its secret taken out (a key pasted into `model`).
    """
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        return placeholder
    try:
        text = value if isinstance(value, str) else str(value)
    except ValueError:  # an integer past sys.get_int_max_str_digits()
        return placeholder
    if len(text) > limit or not text.isprintable():
        return placeholder
    text = redact(text)
    return repr(text) if quote and isinstance(value, str) else text


def escaped(text: str) -> str:
    """`text` with every character that is not printable written as its escape (`\\x0a`,
    `\\u202e`): line breaks, terminal controls, bidirectional overrides, zero-width marks. The
    one escaping of untrusted text kept whole where a reader sees it (a text log line, a
    terminal listing)."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else _escape(ord(c)) for c in text)


def _escape(code: int) -> str:
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def envelope(message: str, type_: str, param: str | None, code: str | None) -> dict[str, Any]:
    """Build `{"error": {"message", "type", "param", "code"}}`."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
