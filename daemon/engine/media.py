"""Images and audio clips from a client's bytes to pixels and samples, in Python, bounded.

Nothing a client sends as media reaches llama.cpp undecoded: an image is opened by Pillow
(its header first: format, width and height are checked against `MediaLimits` before a
pixel is decoded, so a decompression bomb costs a header's parse) and handed on as RGB
pixels; a clip is read by the standard library (WAV, whose header is checked against the
bytes that follow it) or soundfile (MP3, FLAC, Ogg; decoding stops at the duration limit)
and handed on as mono float samples at the projector's rate. Every refusal is a MediaError
whose message names the limit or the defect, never a byte of the input.

Plain Python and well-kept, fuzzed libraries only: this runs where the model's engine runs
(inside the confined engine process, where there is one), before libmtmd sees anything.
"""

from __future__ import annotations

import io
import struct
import warnings
from typing import Final

import numpy as np

from edgellmd.engine.config import MediaError, MediaLimits

# The image formats a client may send (what OpenAI and Anthropic accept), as Pillow names them.
IMAGE_FORMATS: Final = {"png": "PNG", "jpeg": "JPEG", "webp": "WEBP", "gif": "GIF"}
# Audio formats by the name clients use (OpenAI's input_audio `format`, a file's extension).
AUDIO_FORMATS: Final = ("wav", "mp3", "flac", "ogg")
MIN_SECONDS: Final = 1  # a clip shorter than this is padded with silence (see decode_audio)
# What a clip's header may declare. The duration limit alone does not bound the work: a 30 KB
# FLAC of constant subframes declares 8 channels at 96 kHz for ten minutes (gigabytes of
# samples), a WAV 4.29 GHz (seconds of resampling a request). Rates are those recorders
# write; channels up to 7.1; the samples of all channels together at most those of ten
# minutes of 48 kHz stereo per ten minutes of media.max_audio_seconds.
MIN_AUDIO_RATE: Final = 1_000
MAX_AUDIO_RATE: Final = 384_000
MAX_AUDIO_CHANNELS: Final = 8
SAMPLES_PER_SECOND: Final = 96_000  # frames x channels a clip may hold per second of the limit
_READ_FRAMES: Final = 65_536  # a block decoded at a time, downmixed to mono as it comes
_ALIASES: Final = {"jpg": "jpeg", "mpeg": "mp3", "mpga": "mp3", "x-wav": "wav", "wave": "wav", "oga": "ogg"}


def format_name(declared: str | None) -> str | None:
    """A declared format or media type's subtype, as this module names it (`image/jpg` -> jpeg)."""
    if declared is None:
        return None
    name = declared.lower().rpartition("/")[2].strip()
    return _ALIASES.get(name, name)


def sniff_image(data: bytes) -> str | None:
    """The image format the bytes start like, or None."""
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        return "png"
    if data.startswith(b"\xff\xd8\xff"):
        return "jpeg"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "webp"
    if data[:6] in (b"GIF87a", b"GIF89a"):
        return "gif"
    return None


def sniff_audio(data: bytes) -> str | None:
    """The audio format the bytes start like, or None."""
    if data[:4] == b"RIFF" and data[8:12] == b"WAVE":
        return "wav"
    if data[:4] == b"fLaC":
        return "flac"
    if data[:4] == b"OggS":
        return "ogg"
    if data[:3] == b"ID3" or (len(data) > 1 and data[0] == 0xFF and data[1] & 0xE0 == 0xE0):
        return "mp3"
    return None


def _checked_format(kind: str, found: str | None, declared: str | None, allowed: tuple[str, ...]) -> str:
    said = format_name(declared)
    if found is None:
        raise MediaError(f"the {kind} is none of the formats this server reads ({', '.join(allowed)})")
    if said is not None and said != found:
        raise MediaError(f"the {kind} is {found}, not the {said} its media type or format says")
    return found


# Scans of a progressive JPEG: an encoder writes up to about ten (libjpeg's progression: 10
# for colour, 6 for grey), an optimising one a few more. Each refinement scan walks every
# coefficient of every block again (about 25 ms at 4096x4096 here), and a scan costs 35
# bytes: a 68 KB file of a thousand took 30 s of the engine's prompt threads. Refused past
# this, as the markers say, before anything is decoded.
MAX_JPEG_SCANS: Final = 64
_JPEG_SOS: Final = 0xDA
_JPEG_EOI: Final = 0xD9
_JPEG_NO_LENGTH: Final = frozenset({0x01, *range(0xD0, 0xD8)})  # TEM, RST0-7: no length follows


def jpeg_scans(data: bytes, limit: int = MAX_JPEG_SCANS) -> int:
    """How many scans (SOS markers) a JPEG holds, counted up to `limit` + 1, by walking its
    markers as libjpeg finds them (`next_marker`): between segments, bytes that are not 0xFF
    and stuffed 0xFF00 pairs are skipped (libjpeg warns and reads on), fill bytes swallowed;
    a segment's length is skipped (an EXIF thumbnail's markers are not counted); a scan's
    entropy-coded data runs to the next 0xFF that is neither stuffing (00), a restart nor a
    fill byte. A file cut short stops the count (Pillow says what is wrong with it)."""
    pos, scans, end = 2, 0, len(data)  # past SOI
    while scans <= limit:
        # The next marker: libjpeg's next_marker.
        while True:
            pos = data.find(b"\xff", pos)
            if pos < 0:
                return scans
            while pos + 1 < end and data[pos + 1] == 0xFF:  # fill bytes
                pos += 1
            if pos + 1 >= end:
                return scans
            if data[pos + 1] != 0:
                break
            pos += 2  # a stuffed zero outside a scan: discarded
        marker = data[pos + 1]
        pos += 2
        if marker == _JPEG_EOI:
            return scans
        if marker in _JPEG_NO_LENGTH:
            continue
        if pos + 2 > end:
            return scans
        pos += int.from_bytes(data[pos : pos + 2], "big")
        if marker != _JPEG_SOS:
            continue
        scans += 1
        while (pos := data.find(b"\xff", pos)) >= 0 and pos + 1 < end:  # the scan's data
            following = data[pos + 1]
            if following == 0 or following in _JPEG_NO_LENGTH:
                pos += 2  # a stuffed byte or a restart: still the scan's data
            elif following == 0xFF:
                pos += 1
            else:
                break  # the next marker
        else:
            return scans
    return scans


def decode_image(data: bytes, declared: str | None, limits: MediaLimits) -> np.ndarray:
    """RGB pixels (height x width x 3, uint8) of a PNG, JPEG, WebP or GIF (its first frame).

    The header is read first and its size checked; only then are pixels decoded. A file
    Pillow cannot decode whole (truncated, corrupt) is refused, never padded out.
    """
    from PIL import Image, ImageOps  # noqa: PLC0415 - only engines of models that read images need it

    fmt = _checked_format("image", sniff_image(data), declared, tuple(IMAGE_FORMATS))
    if fmt == "jpeg" and jpeg_scans(data) > MAX_JPEG_SCANS:
        raise MediaError(f"the JPEG holds more than {MAX_JPEG_SCANS} progressive scans")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data), formats=[IMAGE_FORMATS[fmt]])
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise MediaError(
            f"the image has more than {limits.max_pixels} pixels (media.max_image_pixels)",
            limit="media.max_image_pixels",
        ) from None
    except (OSError, SyntaxError, ValueError):
        raise MediaError(f"the image could not be read as {fmt}") from None
    with image:
        width, height = image.size
        if width < 1 or height < 1:
            raise MediaError("the image has no pixels")
        if max(width, height) > limits.max_side:
            raise MediaError(
                f"the image is {width}x{height} pixels; a side may be at most {limits.max_side} "
                "(media.max_image_side)",
                limit="media.max_image_side",
            )
        if width * height > limits.max_pixels:
            raise MediaError(
                f"the image is {width}x{height} pixels; at most {limits.max_pixels} pixels "
                "(media.max_image_pixels)",
                limit="media.max_image_pixels",
            )
        try:
            image.load()  # the first frame of an animation
            # A camera's picture is upright as its EXIF orientation says, as a viewer shows it.
            upright = ImageOps.exif_transpose(image)
            pixels = np.asarray(upright.convert("RGB"), dtype=np.uint8)
        except (OSError, SyntaxError, ValueError, MemoryError, Image.DecompressionBombError):
            raise MediaError(f"the image could not be decoded as {fmt} (truncated or corrupt)") from None
    return np.ascontiguousarray(pixels)


# ---- audio ---------------------------------------------------------------------------------------

_WAV_PCM: Final = 1
_WAV_FLOAT: Final = 3
_WAV_EXTENSIBLE: Final = 0xFFFE
_RIFF_UNKNOWN: Final = (0, 0xFFFFFFFF)  # a streaming writer's "to the end of the file"


def _wav_samples(data: bytes, limits: MediaLimits) -> tuple[np.ndarray, int]:
    """A WAV file's samples (frames x channels, float32 in [-1, 1]) and its rate.

    The header's declared length is checked against the limit and against the bytes that
    follow before anything is converted: a header that claims hours over a kilobyte is refused.
    """
    pos, fmt, body = 12, None, None
    while pos + 8 <= len(data) and body is None:
        chunk, size = data[pos : pos + 4], struct.unpack_from("<I", data, pos + 4)[0]
        start = pos + 8
        if chunk == b"fmt ":
            if size < 16 or start + 16 > len(data):
                raise MediaError("the WAV file's format header is cut short")
            fmt = struct.unpack_from("<HHIIHH", data, start)
            if fmt[0] == _WAV_EXTENSIBLE and size >= 40 and start + 26 <= len(data):
                fmt = (struct.unpack_from("<H", data, start + 24)[0], *fmt[1:])
        elif chunk == b"data":
            if fmt is None:
                raise MediaError("the WAV file has no format header before its data")
            available = len(data) - start
            if size in _RIFF_UNKNOWN:
                size = available
            tag, channels, rate, _, _, bits = fmt
            if tag not in (_WAV_PCM, _WAV_FLOAT) or channels < 1 or rate < 1 or bits not in (8, 16, 24, 32):
                raise MediaError("the WAV file is not PCM or float samples this server reads")
            _check_shape(rate, channels)
            width = bits // 8
            frame = width * channels
            seconds = size / (frame * rate)
            if seconds > limits.max_audio_seconds:
                raise MediaError(
                    f"the clip is {seconds:.0f} s long by its header; at most "
                    f"{limits.max_audio_seconds:g} s (media.max_audio_seconds)",
                    limit="media.max_audio_seconds",
                )
            if size > available:
                raise MediaError(
                    f"the WAV file's header declares {size} bytes of samples and {available} follow "
                    "(truncated, or its header lies)"
                )
            body = data[start : start + size - size % frame]
            return _pcm(body, tag, width, channels), rate
        pos = start + size + (size & 1)
    raise MediaError(
        "the WAV file has no data chunk" if fmt is not None else "the WAV file has no format header"
    )


def _pcm(body: bytes, tag: int, width: int, channels: int) -> np.ndarray:
    if tag == _WAV_FLOAT:
        if width not in (4,):
            raise MediaError("the WAV file's float samples are not 32-bit")
        samples = np.frombuffer(body, dtype="<f4").astype(np.float32)
        samples = np.nan_to_num(samples, nan=0.0, posinf=1.0, neginf=-1.0)
    elif width == 1:
        samples = (np.frombuffer(body, dtype=np.uint8).astype(np.float32) - 128.0) / 128.0
    elif width == 3:
        raw = np.frombuffer(body, dtype=np.uint8).reshape(-1, 3).astype(np.int32)
        values = raw[:, 0] | (raw[:, 1] << 8) | (raw[:, 2] << 16)
        samples = (np.where(values >= 1 << 23, values - (1 << 24), values) / float(1 << 23)).astype(
            np.float32
        )
    else:
        kind = "<i2" if width == 2 else "<i4"
        samples = (np.frombuffer(body, dtype=kind) / float(1 << (8 * width - 1))).astype(np.float32)
    return samples.reshape(-1, channels)


def _check_shape(rate: int, channels: int) -> None:
    """Refuse a rate or a channel count no recorder writes (before a sample is decoded)."""
    if not MIN_AUDIO_RATE <= rate <= MAX_AUDIO_RATE:
        raise MediaError(
            f"the clip's sample rate is {rate} Hz; {MIN_AUDIO_RATE} to {MAX_AUDIO_RATE} Hz are read",
        )
    if channels > MAX_AUDIO_CHANNELS:
        raise MediaError(f"the clip has {channels} channels; at most {MAX_AUDIO_CHANNELS} are read")


def _other_samples(data: bytes, fmt: str, limits: MediaLimits) -> tuple[np.ndarray, int]:
    """An MP3, FLAC or Ogg clip's samples through soundfile (libsndfile), read no further than the
    limits, a block at a time and downmixed to mono as it comes (frames x 1)."""
    import soundfile  # noqa: PLC0415 - only engines of models that hear need it

    blocks: list[np.ndarray] = []
    try:
        with soundfile.SoundFile(io.BytesIO(data)) as clip:
            rate, channels = int(clip.samplerate), int(clip.channels)
            if rate < 1 or channels < 1:
                raise MediaError(f"the clip could not be read as {fmt}")
            _check_shape(rate, channels)
            by_seconds = int(limits.max_audio_seconds * rate)
            by_samples = int(limits.max_audio_seconds * SAMPLES_PER_SECOND) // channels
            most = min(by_seconds, by_samples)
            frames = 0
            while frames <= most:
                block = clip.read(
                    frames=min(_READ_FRAMES, most + 1 - frames), dtype="float32", always_2d=True
                )
                if len(block) == 0:
                    break
                frames += len(block)
                blocks.append(block.mean(axis=1, dtype=np.float32))
    except (RuntimeError, TypeError, ValueError, OSError, soundfile.LibsndfileError):
        raise MediaError(f"the clip could not be decoded as {fmt} (truncated or corrupt)") from None
    if frames > most:
        if by_samples < by_seconds:
            raise MediaError(
                f"the clip holds more samples than {limits.max_audio_seconds:g} s of 48 kHz stereo "
                f"({channels} channels at {rate} Hz; media.max_audio_seconds)",
                limit="media.max_audio_seconds",
            )
        raise MediaError(
            f"the clip is longer than {limits.max_audio_seconds:g} s (media.max_audio_seconds)",
            limit="media.max_audio_seconds",
        )
    mono = np.concatenate(blocks) if blocks else np.zeros(0, dtype=np.float32)
    return np.nan_to_num(mono, nan=0.0, posinf=1.0, neginf=-1.0).reshape(-1, 1), rate


def decode_audio(data: bytes, declared: str | None, limits: MediaLimits, rate: int) -> np.ndarray:
    """Mono float32 samples at `rate` Hz (the projector's) of a WAV, MP3, FLAC or Ogg clip."""
    fmt = _checked_format("clip", sniff_audio(data), declared, AUDIO_FORMATS)
    try:
        return _decode_audio(data, fmt, limits, rate)
    except MemoryError:  # bounded above; an engine short of memory says so, as a client's 400
        raise MediaError("the clip does not fit in memory once decoded") from None


def _decode_audio(data: bytes, fmt: str, limits: MediaLimits, rate: int) -> np.ndarray:
    samples, found = _wav_samples(data, limits) if fmt == "wav" else _other_samples(data, fmt, limits)
    if len(samples) == 0:
        raise MediaError("the clip holds no samples")
    mono = samples.mean(axis=1, dtype=np.float32)
    if found != rate:
        import soxr  # noqa: PLC0415 - as soundfile

        mono = soxr.resample(mono, found, rate, quality="HQ").astype(np.float32)
    # libmtmd's audio preprocessors assert on clips shorter than a few of their frames (a
    # one-sample clip aborts the process): a short clip is padded with silence to MIN_SECONDS.
    short = rate * MIN_SECONDS - len(mono)
    if short > 0:
        mono = np.concatenate([mono, np.zeros(int(short), dtype=np.float32)])
    return np.ascontiguousarray(np.clip(mono, -1.0, 1.0), dtype=np.float32)
