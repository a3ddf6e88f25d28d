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
from collections.abc import AsyncIterator, Iterable, Iterator
from dataclasses import dataclass

DONE = "[DONE]"
_LINE_END = re.compile(r"\r\n|\r|\n")


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
    ``\\r\\n`` split between two pieces is joined). ``close()`` returns a last line without a line end."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self._buffer = ""

    def feed(self, data: bytes) -> list[str]:
        buffer = self._buffer + self._decoder.decode(data)
        hold = buffer.endswith("\r")  # maybe the first half of a "\r\n" split between two pieces
        parts = _LINE_END.split(buffer[:-1] if hold else buffer)
        self._buffer = parts.pop() + ("\r" if hold else "")
        return parts

    def close(self) -> list[str]:
        parts = _LINE_END.split(self._buffer + self._decoder.decode(b"", final=True))
        self._buffer = ""
        return parts[:-1] + ([parts[-1]] if parts[-1] else [])


class EventParser:
    """Feed it lines (without their line end); it returns the events each line completes."""

    def __init__(self) -> None:
        self._data: list[str] = []
        self._event = ""

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
        self._data, self._event = [], ""
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


async def aparse_lines(lines: AsyncIterator[str]) -> AsyncIterator[Event]:
    parser = EventParser()
    async for line in lines:
        event = parser.feed(line.rstrip("\r\n"))
        if event is not None:
            yield event
    last = parser.close()
    if last is not None:
        yield last
