"""Text-side helpers of the scheduler: UTF-8-safe detokenization and stop strings."""

from __future__ import annotations

import pytest

from edgellmd.engine.generation import SamplingParams, StopMatcher, Utf8Stream


def test_utf8_stream_holds_partial_characters() -> None:
    stream = Utf8Stream()
    snowman = "☃".encode()  # 3 bytes
    assert stream.feed(snowman[:1]) == ""
    assert stream.feed(snowman[1:2]) == ""
    assert stream.feed(snowman[2:] + b"x") == "☃x"
    assert stream.flush() == ""


def test_utf8_stream_emoji_split_over_four_pieces() -> None:
    stream = Utf8Stream()
    emoji = "🦙".encode()
    out = "".join(stream.feed(emoji[i : i + 1]) for i in range(4))
    assert out == "🦙"


def test_utf8_stream_invalid_bytes_become_replacement_characters() -> None:
    stream = Utf8Stream()
    assert stream.feed(b"a\xffb") == "a\ufffdb"
    # A truncated character at the very end is flushed as one replacement character.
    assert stream.feed("é".encode()[:1]) == ""
    assert stream.flush() == "\ufffd"


@pytest.mark.parametrize(
    ("stops", "pieces", "emitted", "hit"),
    [
        ((), ["hello", " world"], ["hello", " world"], False),
        (("STOP",), ["abc", "deSTOPfg"], ["abc", "de"], True),
        # The stop string straddles pieces: nothing of it is emitted.
        (("STOP",), ["abcST", "OPxyz"], ["abc", ""], True),
        # A partial match is held back, then released when it turns out not to be a stop.
        (("STOP",), ["abcST", "ART"], ["abc", "START"], False),
        # The earliest of several stops wins.
        (("world", "lo"), ["hello world"], ["hel"], True),
        (("\n\n",), ["line\n", "\nnext"], ["line", ""], True),
    ],
)
def test_stop_matcher(stops: tuple[str, ...], pieces: list[str], emitted: list[str], hit: bool) -> None:
    matcher = StopMatcher(stops)
    out: list[str] = []
    got_hit = False
    for piece in pieces:
        text, got_hit = matcher.feed(piece)
        out.append(text)
        if got_hit:
            break
    assert out == emitted
    assert got_hit is hit


def test_stop_matcher_flush_releases_held_prefix() -> None:
    matcher = StopMatcher(["</answer>"])
    assert matcher.feed("42</ans") == ("42", False)
    assert matcher.flush() == "</ans"
    assert matcher.flush() == ""


def test_sampling_params_flags() -> None:
    assert SamplingParams(temperature=0.0).greedy
    assert not SamplingParams(temperature=0.7).greedy
    assert not SamplingParams().penalized
    assert SamplingParams(presence_penalty=0.5).penalized
    assert SamplingParams(repeat_penalty=1.1).penalized
