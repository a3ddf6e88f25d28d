"""Server-sent events (the WHATWG "text/event-stream" format) as OpenAI-compatible servers stream them.

Tolerant on purpose: comment lines (``: ping``), ``\\r\\n`` / ``\\r`` line ends (the HTTP client
splits them), fields without the space after the colon, ``data:`` split over several lines (joined
with ``\\n``), an ``event:`` name (``event: error``), a stream that ends without ``[DONE]`` or without
the blank line after its last event, and a non-JSON payload (returned as text for the caller to
report). Nothing here knows about completions: the client (live/client.py) reads the events.
"""

from __future__ import annotations

import codecs
import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

DONE = "[DONE]"
_LINE_END = re.compile(r"\r\n|\r|\n")
# Longest line (and event) read, in characters: a chunk of one token is ~200; past this a stream is
# broken or hostile, and holding it would cost unbounded memory (the request fails instead).
MAX_LINE_CHARS = 4 << 20


class LineTooLong(ValueError):
    """A line or an event longer than MAX_LINE_CHARS."""

    def __init__(self, limit: int):
        super().__init__(f"a stream line longer than {limit:,} characters (not a chunk of tokens)")


@dataclass(frozen=True, slots=True)
class Event:
    data: str  # the event's data lines joined with "\n"
    event: str = "message"  # the "event:" field, "message" when absent

    @property
    def done(self) -> bool:
        return self.data.strip() == DONE

    def json(self) -> object:
        """The payload as JSON; raises ValueError (json.JSONDecodeError) when it is not."""
        return json.loads(self.data)


class LineSplitter:
    """Bytes arriving in arbitrary pieces -> the lines the event-stream format splits them into
    (``\\r\\n``, ``\\r`` or ``\\n``), decoded as UTF-8 across piece boundaries (a character or a
    ``\\r\\n`` split between two pieces is joined). ``close()`` returns a last line without a line end.
    The pieces of an unfinished line are kept apart and joined once, when its end comes (a long line
    costs time linear in its length), and a line longer than ``max_chars`` raises LineTooLong."""

    def __init__(self, max_chars: int = MAX_LINE_CHARS) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self._pending: list[str] = []  # the unfinished line's pieces
        self._pending_chars = 0
        self.max_chars = max_chars

    def _hold(self, text: str) -> None:
        self._pending.append(text)
        self._pending_chars += len(text)
        if self._pending_chars > self.max_chars + 1:  # (+1: a "\r" held for a "\r\n")
            raise LineTooLong(self.max_chars)

    def feed(self, data: bytes) -> list[str]:
        text = self._decoder.decode(data)
        if not text:
            return []
        after_cr = bool(self._pending) and self._pending[-1].endswith("\r")
        if not after_cr and "\n" not in text and "\r" not in text[:-1]:
            self._hold(text)  # no line ends here: the line goes on
            return []
        buffer = "".join(self._pending) + text
        self._pending, self._pending_chars = [], 0
        hold = buffer.endswith("\r")  # maybe the first half of a "\r\n" split between two pieces
        parts = _LINE_END.split(buffer[:-1] if hold else buffer)
        rest = parts.pop() + ("\r" if hold else "")
        if any(len(p) > self.max_chars for p in parts):
            raise LineTooLong(self.max_chars)
        if rest:
            self._hold(rest)
        return parts

    def close(self) -> list[str]:
        parts = _LINE_END.split("".join(self._pending) + self._decoder.decode(b"", final=True))
        self._pending, self._pending_chars = [], 0
        if any(len(p) > self.max_chars for p in parts):
            raise LineTooLong(self.max_chars)
        return parts[:-1] + ([parts[-1]] if parts[-1] else [])


class EventParser:
    """Feed it lines (without their line end); it returns the events each line completes."""

    def __init__(self, max_chars: int = MAX_LINE_CHARS) -> None:
        self._data: list[str] = []
        self._data_chars = 0
        self._event = ""
        self.max_chars = max_chars

    def feed(self, line: str) -> Event | None:
        if line == "":  # blank line: dispatch
            return self._dispatch()
        if line.startswith(":"):  # comment (keep-alive ping)
            return None
        name, sep, value = line.partition(":")
        if sep and value.startswith(" "):
            value = value[1:]
        if name == "data":
            self._data.append(value)
            self._data_chars += len(value) + 1
            if self._data_chars > self.max_chars:  # many data lines in one event: the same cap
                raise LineTooLong(self.max_chars)
        elif name == "event":
            self._event = value
        # "id", "retry" and unknown fields are ignored, as the standard says
        return None

    def close(self) -> Event | None:
        """End of stream: an event still being collected counts (servers that omit the last blank line)."""
        return self._dispatch()

    def _dispatch(self) -> Event | None:
        if not self._data:
            self._event = ""
            return None
        event = Event("\n".join(self._data), self._event or "message")
        self._data, self._data_chars, self._event = [], 0, ""
        return event


def parse_lines(lines: Iterable[str]) -> Iterator[Event]:
    parser = EventParser()
    for line in lines:
        event = parser.feed(line.rstrip("\r\n"))
        if event is not None:
            yield event
    last = parser.close()
    if last is not None:
        yield last

