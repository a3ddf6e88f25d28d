"""The SSE parser on hand-written streams (the WHATWG event-stream rules servers rely on)."""

import pytest
from servelab.live.sse import Event, LineSplitter, parse_lines


def test_events_comments_and_done():
    lines = [": ping", "data: {\"a\": 1}", "", ":", "data:{\"a\": 2}", "", "data: [DONE]", ""]
    events = list(parse_lines(lines))
    assert [e.data for e in events] == ['{"a": 1}', '{"a": 2}', "[DONE]"]
    assert events[0].json() == {"a": 1}
    assert events[2].done and not events[0].done


def test_multiline_data_event_names_and_line_ends():
    lines = ["event: error\r\n", "data: first\r\n", "data:  second\n", "id: 7", "retry: 10", "\r\n",
             "data: after"]  # the last event has no blank line after it: it still counts
    events = list(parse_lines(lines))
    assert events == [Event("first\n second", "error"), Event("after", "message")]


def test_blank_lines_alone_and_an_event_without_data_yield_nothing():
    assert list(parse_lines(["", "", "event: ping", "", ": c"])) == []


def _lines(*pieces: bytes) -> list[str]:
    """The lines of a body that arrives in the given pieces, split as the live client splits them (each
    piece fed when it arrives: live/client.py ``_read_stream``)."""
    splitter = LineSplitter()
    lines = [line for piece in pieces for line in splitter.feed(piece)]
    return lines + splitter.close()


@pytest.mark.parametrize("pieces", [
    (b"a\r\nb\rc\n\nd",),
    (b"a\r", b"\nb\r", b"c\n", b"\nd"),  # "\r\n" split between reads: one line end, not two
    (b"a", b"\r\nb", b"\rc\n\n", b"d"),
])
def test_line_ends_across_reads(pieces):
    assert _lines(*pieces) == ["a", "b", "c", "", "d"]


def test_utf8_split_across_reads_and_a_last_line_end():
    text = "é€ ok\n".encode()
    assert _lines(text[:1], text[1:3], text[3:]) == ["é€ ok"]
    assert _lines(b"x\r") == ["x"] and _lines(b"") == []
