"""Images and audio clips in requests, as every API family's decoder reads them: bounded and counted.

The families spell media differently (OpenAI chat's `image_url` and `input_audio` parts,
Responses' `input_image` and `input_audio`, Anthropic's `image` blocks); each decoder hands
what it found to one `MediaReader`, which checks what is cheap to check before anything is
decoded (a data URL's shape, base64, the byte size, how many a request holds, whether a
URL's host may be fetched) and turns it into the engine's `MediaInput`. Decoding and the
pixel and duration bounds happen where the model's engine runs (`engine.media`). A message's
text and media in order become one `ChatMessage` through `Content`.

URLs other than `data:` are fetched only from the hosts an operator listed
(`media.fetch_hosts`), by `fetch_media`, before the prompt is made: no redirect is followed
and at most `media.max_image_bytes` is read within `media.fetch_timeout_s`.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import re
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Final
from urllib.parse import urlsplit

import aiohttp

from edgellmd.engine.chat import ChatMessage
from edgellmd.engine.config import MediaInput, MediaLimits
from edgellmd.engine.media import AUDIO_FORMATS, IMAGE_FORMATS, format_name
from edgellmd.errors import InvalidRequest
from edgellmd.settings import MediaSettings

_DATA_URL: Final = re.compile(
    r"data:([A-Za-z0-9.+/-]{0,100})((?:;[A-Za-z0-9=._-]{1,64}){0,8}),", re.ASCII | re.IGNORECASE
)
_WHITESPACE: Final = re.compile(rb"\s+")


@dataclass(frozen=True, slots=True)
class MediaRules:
    """The request-level bounds on media (settings `media.*`)."""

    max_images: int = 8
    max_image_bytes: int = 10_485_760
    max_clips: int = 4
    max_audio_bytes: int = 26_214_400
    fetch_hosts: frozenset[str] = frozenset()
    limits: MediaLimits = field(default_factory=MediaLimits)  # what the engine checks once decoded

    @classmethod
    def of(cls, media: MediaSettings) -> MediaRules:
        """The rules the settings give."""
        return cls(
            max_images=media.max_images,
            max_image_bytes=media.max_image_bytes,
            max_clips=media.max_clips,
            max_audio_bytes=media.max_audio_bytes,
            fetch_hosts=frozenset(h.lower() for h in media.fetch_hosts),
            limits=MediaLimits(
                max_pixels=media.max_image_pixels,
                max_side=media.max_image_side,
                max_audio_seconds=media.max_audio_seconds,
            ),
        )


class MediaReader:
    """One request's images and clips as its decoder meets them: checked, counted, bounded."""

    def __init__(self, rules: MediaRules) -> None:
        self.rules = rules
        self.images = 0
        self.clips = 0

    def _count(self, kind: str, param: str) -> None:
        if kind == "image":
            self.images += 1
            if self.images > self.rules.max_images:
                raise InvalidRequest(
                    f"a request may hold at most {self.rules.max_images} images (media.max_images)",
                    param=param,
                    code="invalid_image",
                )
        else:
            self.clips += 1
            if self.clips > self.rules.max_clips:
                raise InvalidRequest(
                    f"a request may hold at most {self.rules.max_clips} audio clips (media.max_clips)",
                    param=param,
                    code="invalid_audio",
                )

    def _bytes(self, kind: str, text: str, param: str) -> bytes:
        """Strict base64 of one item, its size checked before and after decoding."""
        most, setting = (
            (self.rules.max_image_bytes, "media.max_image_bytes")
            if kind == "image"
            else (self.rules.max_audio_bytes, "media.max_audio_bytes")
        )
        what = "an image" if kind == "image" else "a clip"
        too_big = f"{what} may be at most {most} bytes ({setting})"
        code = f"invalid_{kind}"
        if len(text) // 4 * 3 > most + 3 + len(text) // 64:  # room for line breaks some encoders add
            raise InvalidRequest(too_big, param=param, code=code)
        try:
            raw = text.encode("ascii")
            if b"\n" in raw or b"\r" in raw or b" " in raw:
                raw = _WHITESPACE.sub(b"", raw)
            data = base64.b64decode(raw, validate=True)
        except (UnicodeEncodeError, binascii.Error, ValueError):
            raise InvalidRequest(f"{what} must be sent as base64", param=param, code=code) from None
        if len(data) > most:
            raise InvalidRequest(too_big, param=param, code=code)
        if not data:
            raise InvalidRequest(f"{what} is empty", param=param, code=code)
        return data

    def image_url(self, url: object, param: str) -> MediaInput:
        """An image by URL: a base64 `data:` URL, or http(s) from a host the operator listed."""
        if not isinstance(url, str):
            raise InvalidRequest(f"'{param}' must be a string", param=param, code="invalid_image")
        self._count("image", param)
        if url[:5].lower() == "data:":
            return self._data_url(url, param)
        scheme = url.split(":", 1)[0].lower() if ":" in url[:8] else ""
        if scheme not in ("http", "https"):
            raise InvalidRequest(
                "an image URL must be a data: URL or an http(s) URL", param=param, code="invalid_image"
            )
        try:
            host = (urlsplit(url).hostname or "").lower()
        except ValueError:
            host = ""
        if not self.rules.fetch_hosts:
            raise InvalidRequest(
                "this server reads images sent in the request only (base64 data: URLs); it fetches "
                "no URL (media.fetch_hosts is empty)",
                param=param,
                code="invalid_image",
            )
        if host not in self.rules.fetch_hosts or len(url) > 2048:
            raise InvalidRequest(
                "this server fetches images only from the hosts in media.fetch_hosts",
                param=param,
                code="invalid_image",
            )
        return MediaInput("image", b"", None, url=url)

    def _data_url(self, url: str, param: str) -> MediaInput:
        found = _DATA_URL.match(url)
        # The scheme and the parameters are case-insensitive (RFC 2397: DATA:IMAGE/PNG;BASE64 too).
        if found is None or "base64" not in found.group(2).lower().split(";")[1:]:
            raise InvalidRequest(
                "an image data: URL must be data:image/<type>;base64,<data>",
                param=param,
                code="invalid_image",
            )
        media_type = found.group(1).lower()
        if not media_type.startswith("image/"):
            raise InvalidRequest(
                "an image data: URL must hold an image/* media type", param=param, code="invalid_image"
            )
        fmt = format_name(media_type)
        if fmt not in IMAGE_FORMATS:
            raise InvalidRequest(
                f"images may be {', '.join(IMAGE_FORMATS)}; the data: URL says another type",
                param=param,
                code="invalid_image",
            )
        return MediaInput("image", self._bytes("image", url[found.end() :], param), fmt)

    def image_base64(self, data: object, media_type: object, param: str) -> MediaInput:
        """An image as base64 with its declared media type (Anthropic's `source`)."""
        allowed = ", ".join(f"image/{name}" for name in IMAGE_FORMATS)
        return self._base64("image", data, media_type, param, field="media_type", allowed=allowed)

    def audio_base64(self, data: object, fmt: object, param: str) -> MediaInput:
        """A clip as base64 with its format (OpenAI's `input_audio`: {"data", "format"})."""
        return self._base64("audio", data, fmt, param, field="format", allowed=", ".join(AUDIO_FORMATS))

    def _base64(
        self, kind: str, data: object, declared: object, param: str, *, field: str, allowed: str
    ) -> MediaInput:
        """`param`.data as base64 and `param`.`field` one of the formats of `kind`, counted."""
        code = f"invalid_{kind}"
        if not isinstance(data, str):
            raise InvalidRequest(f"'{param}.data' must be a string", param=f"{param}.data", code=code)
        name = format_name(declared) if isinstance(declared, str) else None
        if name not in (IMAGE_FORMATS if kind == "image" else AUDIO_FORMATS):
            raise InvalidRequest(
                f"'{param}.{field}' must be one of {allowed}", param=f"{param}.{field}", code=code
            )
        self._count(kind, param)
        return MediaInput(kind, self._bytes(kind, data, f"{param}.data"), name)

    def audio_file(self, data: bytes, fmt: str | None, param: str) -> MediaInput:
        """An uploaded clip (a multipart file), its size already bounded by the upload."""
        if len(data) > self.rules.max_audio_bytes:
            raise InvalidRequest(
                f"a clip may be at most {self.rules.max_audio_bytes} bytes (media.max_audio_bytes)",
                param=param,
                code="invalid_audio",
            )
        if not data:
            raise InvalidRequest("the clip is empty", param=param, code="invalid_audio")
        self._count("audio", param)
        name = format_name(fmt)
        return MediaInput("audio", data, name if name in AUDIO_FORMATS else None)


class Content:
    """A message's content as its decoder meets it: text and images or clips, in order."""

    def __init__(self) -> None:
        self._texts: list[str] = []
        self._length = 0
        self._media: list[MediaInput] = []
        self._at: list[int] = []

    def text(self, text: str) -> None:
        """Text next."""
        self._texts.append(text)
        self._length += len(text)

    def media(self, item: MediaInput) -> None:
        """An image or clip next."""
        self._media.append(item)
        self._at.append(self._length)

    def message(self, role: str, **more: object) -> ChatMessage:
        """The message (`more`: ChatMessage's other fields)."""
        return ChatMessage(
            role,
            "".join(self._texts),
            media=tuple(self._media),
            media_at=tuple(self._at),
            **more,  # type: ignore[arg-type]
        )


async def fetch_media(messages: Sequence[ChatMessage], settings: MediaSettings) -> tuple[ChatMessage, ...]:
    """The messages with every image given by an http(s) URL fetched (the decoders allowed its host).

    No redirect is followed, the body is read up to `media.max_image_bytes`, and the whole
    fetch must end within `media.fetch_timeout_s`; any failure is the client's 400 naming the
    image, never the URL's contents.
    """
    wanted = [item.url for m in messages for item in m.media if item.url is not None]
    if not wanted:
        return tuple(messages)
    fetched: dict[str, bytes] = {}
    timeout = aiohttp.ClientTimeout(total=settings.fetch_timeout_s)
    async with aiohttp.ClientSession(timeout=timeout, trust_env=False) as client:
        for number, url in enumerate(dict.fromkeys(wanted), 1):
            fetched[url] = await _fetch(client, url, number, settings.max_image_bytes)
    return tuple(
        replace(
            message,
            media=tuple(
                replace(item, data=fetched[item.url], url=None) if item.url is not None else item
                for item in message.media
            ),
        )
        if any(item.url is not None for item in message.media)
        else message
        for message in messages
    )


async def _fetch(client: aiohttp.ClientSession, url: str, number: int, most: int) -> bytes:
    def failed(why: str) -> InvalidRequest:
        return InvalidRequest(f"image URL {number} could not be fetched: {why}", code="invalid_image")

    try:
        async with client.get(url, allow_redirects=False) as response:
            if response.status != 200:
                raise failed(f"the server answered {response.status}")
            if response.content_length is not None and response.content_length > most:
                raise failed(f"it is larger than {most} bytes (media.max_image_bytes)")
            body = bytearray()
            async for chunk in response.content.iter_chunked(65536):
                body += chunk
                if len(body) > most:
                    raise failed(f"it is larger than {most} bytes (media.max_image_bytes)")
            return bytes(body)
    except TimeoutError:
        raise failed("it took longer than media.fetch_timeout_s") from None
    except (aiohttp.ClientError, asyncio.IncompleteReadError, ValueError):
        raise failed("the connection failed") from None
