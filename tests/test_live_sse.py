"""The SSE parser on hand-written streams (the WHATWG event-stream rules servers rely on)."""

from servelab.live.sse import Event, parse_lines


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
