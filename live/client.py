"""One streamed request to an OpenAI-compatible server, timed: send, every text chunk's arrival, end.

``/v1/completions`` (``api="completions"``, a prompt string) and ``/v1/chat/completions``
(``api="chat"``, one user message). Streaming with ``stream_options.include_usage`` so servers that
support it report the real token counts in their last chunk; servers that do not are fine too (the
count of text chunks stands in). Outcomes, each with the error text where there is one:

- ``finished``: the stream ended normally (``[DONE]`` or the connection closed after a chunk with a
  ``finish_reason``, or simply closed: a stream without ``[DONE]`` is not an error);
- ``failed``: an HTTP error status, a refused or dropped connection, an ``error`` object or
  ``event: error`` inside the stream, a payload that is not JSON, an answer that is not an event
  stream at all (a non-streamed JSON body, an HTML page: the reason says what came), a stream line
  longer than live/sse.py's MAX_LINE_CHARS;
- ``timeout``: the request took longer than the per-request timeout;
- ``cancelled``: the run stopped it (Ctrl-C, the duration limit).

A request whose connection drops before any byte of an answer (a kept-alive connection the server
closed just as it was reused: nothing was served on it) is sent once more on a new connection and
marked ``resent``; its times still count from the first send. A connection that cannot be opened
at all (the server is down) is not retried.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp
from servelab.live.sse import Event, EventParser, LineSplitter, LineTooLong

ERROR_TEXT_MAX = 500  # characters of a server's error body kept in `reason`
# reasons every backend records for the same outcomes
NO_TEXT = "the stream ended without any generated text"
SETUP_TIMEOUT_S = 60.0  # the least the run's /tokenize calls wait (Target.setup_timeout)
CANCELLED = "stopped by the run (interrupt or duration limit)"


def timeout_reason(target: Target) -> str:
    return f"no complete response within {target.timeout_s:g} s"


@dataclass(frozen=True, slots=True)
class Target:
    """The server and how every request is sent to it."""

    base_url: str  # e.g. http://127.0.0.1:8000 (a trailing /v1 is accepted)
    model: str
    api: str = "completions"  # completions | chat
    timeout_s: float | None = 600.0  # per request, from send to the stream's end; None: no limit
    ignore_eos: bool = False  # vLLM extension: generate exactly max_tokens
    min_tokens: bool = False  # vLLM extension: min_tokens = max_tokens
    include_usage: bool = True  # stream_options.include_usage
    api_key: str | None = None
    extra_body: tuple[tuple[str, object], ...] = ()  # more JSON fields for every request

    @property
    def root(self) -> str:
        url = self.base_url.rstrip("/")
        return url.removesuffix("/v1")

    @property
    def url(self) -> str:
        return f"{self.root}/v1/{'chat/completions' if self.api == 'chat' else 'completions'}"

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def setup_timeout(self) -> aiohttp.ClientTimeout:
        """The limit of the run's /tokenize calls (exact prompt lengths, measured before the first send, many
        at once): as long as a request may wait, and never under SETUP_TIMEOUT_S: a short per-request timeout
        limits requests, and a busy server counting tokens late must not fail the run. (The reachability
        check and the extension probe wait --timeout itself: the first is the option's promise, the second
        is a request.)"""
        total = None if self.timeout_s is None else max(self.timeout_s, SETUP_TIMEOUT_S)
        return aiohttp.ClientTimeout(total=total)

    def payload(self, prompt: str | list[int], max_tokens: int) -> dict:  # a list: token ids (completions)
        body: dict = {"model": self.model, "max_tokens": max_tokens, "stream": True, "temperature": 0.0}
        if self.api == "chat":
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        if self.include_usage:
            body["stream_options"] = {"include_usage": True}
        if self.ignore_eos:
            body["ignore_eos"] = True
        if self.min_tokens:
            body["min_tokens"] = max_tokens
        body.update(self.extra_body)
        return body


@dataclass(slots=True)
class Record:
    """What happened to one request; times are seconds on the run's clock."""

    index: int  # position in the run's request list
    request_id: int
    scheduled_s: float | None = None  # when the load shape wanted it sent
    send_s: float | None = None  # just before the HTTP request was written
    first_token_s: float | None = None
    finish_s: float | None = None  # last text chunk of a finished request
    end_s: float | None = None  # when the stream ended, however it ended
    token_times: list[float] = field(default_factory=list)  # every text chunk's arrival
    usage_prompt_tokens: int | None = None
    usage_completion_tokens: int | None = None
    usage_cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, where given
    usage_rejected_tokens: int | None = None  # a completion count set aside as implausible (live/counts.py)
    finish_reason: str | None = None
    saw_done: bool = False
    resent: bool = False  # sent a second time: the first connection dropped before any answer
    status: str = "unsent"  # finished | failed | timeout | cancelled (unsent until sent)
    reason: str | None = None

    @property
    def output_tokens(self) -> int:
        """Tokens generated: the server's usage count when it gave one, else the text chunks seen."""
        return self.usage_completion_tokens if self.usage_completion_tokens is not None else len(self.token_times)


class StreamError(Exception):
    """An error the server reported inside the stream, or a payload the client cannot read."""


def _choice_text(payload: dict, api: str) -> tuple[str | None, str | None]:
    choices = payload.get("choices") or []
    if not choices or not isinstance(choices[0], dict):
        return None, None
    choice = choices[0]
    if api == "chat":
        delta = choice.get("delta") or {}
        text = delta.get("content") if isinstance(delta, dict) else None
    else:
        text = choice.get("text")
    return (text if isinstance(text, str) else None), choice.get("finish_reason")


def _error_text(payload: object) -> str:
    if isinstance(payload, dict):
        err = payload.get("error", payload)
        if isinstance(err, dict):
            return str(err.get("message") or err)[:ERROR_TEXT_MAX]
        return str(err)[:ERROR_TEXT_MAX]
    return str(payload)[:ERROR_TEXT_MAX]


def read_event(event: Event, api: str, record: Record, now: float) -> bool:
    """Record one stream event (an OpenAI-style chunk) that arrived at ``now``; True for ``[DONE]``.
    Raises StreamError for an error the server sent, or a payload that is not a JSON object."""
    if event.done:
        record.saw_done = True
        return True
    try:
        payload = event.json()
    except ValueError:
        raise StreamError(f"stream event is not JSON: {event.data[:200]!r}") from None
    if event.event == "error" or (isinstance(payload, dict) and "error" in payload and "choices" not in payload):
        raise StreamError(f"error in stream: {_error_text(payload)}")
    if not isinstance(payload, dict):
        raise StreamError(f"stream event is not a JSON object: {event.data[:200]!r}")
    text, finish = _choice_text(payload, api)
    if text:
        if record.first_token_s is None:
            record.first_token_s = now
        record.token_times.append(now)
    if finish:
        record.finish_reason = str(finish)
    usage = payload.get("usage")
    if isinstance(usage, dict):
        if isinstance(usage.get("completion_tokens"), int):
            record.usage_completion_tokens = usage["completion_tokens"]
        if isinstance(usage.get("prompt_tokens"), int):
            record.usage_prompt_tokens = usage["prompt_tokens"]
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
            record.usage_cached_tokens = details["cached_tokens"]
    return False


async def _read_stream(response: aiohttp.ClientResponse, target: Target, record: Record,
                       clock: Callable[[], float]) -> None:  # fmt: skip
    """Read the event stream into ``record``. Each piece of the body is timed when it arrives, before it is
    parsed (as vLLM's ``bench serve`` times each chunk), and its lines and events are read in one plain
    loop: a token's time does not include the parsing of those that came with it, and a chunk costs the
    client no task switch per line (which, with many streams, the next stream's first token waits for)."""
    head: list[str] = []  # the first non-blank lines, to say what came when no event did
    splitter, parser = LineSplitter(), EventParser()
    events = 0

    def take(lines: list[str], now: float) -> bool:  # True at [DONE]
        nonlocal events
        for line in lines:
            if len(head) < 3 and line.strip():
                head.append(line.strip()[:100])
            event = parser.feed(line)
            if event is not None:
                events += 1
                if read_event(event, target.api, record, now):
                    return True
        return False

    done = False
    async for data in response.content.iter_any():
        now = clock()
        if take(splitter.feed(data), now):
            done = True
            break
    if not done and not take(splitter.close(), clock()):
        last = parser.close()
        if last is not None:
            events += 1
            read_event(last, target.api, record, clock())
    if not events and head:
        kind = response.headers.get("Content-Type", "no content type").split(";")[0]
        raise StreamError(f"the answer is not an event stream ({kind}): {' '.join(head)[:200]!r}")


async def send(http: aiohttp.ClientSession, target: Target, record: Record, prompt: str | list[int], max_tokens: int,
               clock: Callable[[], float] = time.perf_counter) -> Record:  # fmt: skip
    """Send one request and fill ``record``; never raises except CancelledError (after recording it). Its
    time runs from just before the POST (the body built, as vLLM's ``bench serve`` builds it first)."""
    payload = target.payload(prompt, max_tokens)
    record.send_s = clock()
    try:
        async with asyncio.timeout(target.timeout_s):
            async with await _post(http, target, record, payload) as response:
                if response.status != 200:
                    body = (await response.read()).decode("utf-8", "replace")
                    raise StreamError(f"HTTP {response.status}: {_error_text(_maybe_json(body))}")
                await _read_stream(response, target, record, clock)
        if not record.token_times:
            raise StreamError(NO_TEXT)
        record.status = "finished"
        record.finish_s = record.token_times[-1]
    except (StreamError, LineTooLong) as err:
        record.status, record.reason = "failed", str(err)
    except TimeoutError:
        record.status, record.reason = "timeout", timeout_reason(target)
    except aiohttp.ClientError as err:
        record.status, record.reason = "failed", f"{type(err).__name__}: {err}" if str(err) else type(err).__name__
    except asyncio.CancelledError:
        record.status, record.reason = "cancelled", CANCELLED
        record.end_s = clock()
        raise
    record.end_s = clock()
    return record


async def _post(http: aiohttp.ClientSession, target: Target, record: Record, body: dict) -> aiohttp.ClientResponse:
    """POST ``body``; once more if the connection dropped before any answer came (aiohttp retries
    only idempotent methods itself). A failure to connect at all is not retried."""
    try:
        return await http.post(target.url, json=body, headers=target.headers())
    except aiohttp.ClientConnectorError:
        raise
    except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError, aiohttp.ClientConnectionResetError):
        record.resent = True
        return await http.post(target.url, json=body, headers=target.headers())


def _maybe_json(text: str) -> object:
    import json

    try:
        return json.loads(text)
    except ValueError:
        return text.strip()
