"""A local implementation of the SageMaker runtime's streaming API for the tests, driven through boto3.

``POST /endpoints/NAME/invocations-response-stream`` answers ``application/vnd.amazon.eventstream``
(chunked): binary AWS event-stream messages, each a prelude (total length, headers length, CRC32 of
the two), headers (``:event-type`` PayloadPart, ``:message-type`` event, ``:content-type``; string
values), the payload (a PayloadPart's raw bytes: the shape's ``Bytes`` blob is its event payload)
and the CRC32 of all that. A stream error is an ``exception`` message (``:exception-type``
ModelStreamError / InternalStreamFailure, a JSON payload). An error before the stream is a rest-json
error answer (``x-amzn-ErrorType``, a JSON body with ``Message``; ModelError adds
``OriginalStatusCode`` / ``OriginalMessage``, as SageMaker does when the container answers 4xx/5xx).
The container's content type is the ``X-Amzn-SageMaker-Content-Type`` header. Written from
botocore's service model (sagemaker-runtime 2017-05-13) and the event-stream format; botocore's own
parser (and its CRC checks) reads it in the tests.

Two modes:

- ``upstream=URL`` (a real vLLM server): each invocation's body goes to the server's own SageMaker
  route, ``URL/invocations`` (as SageMaker forwards it to the container), and the server's real SSE
  stream comes back re-cut into PayloadParts at awkward byte boundaries (``split``): a line is split
  over parts, mid-character too, and (with ``carry``) a part holds the end of one line and the
  start of the next. ``jsonlines=True`` rewrites the stream as JSON lines (``data: `` dropped, no
  ``[DONE]``), as LMI containers stream. An error answer of the server becomes a ModelError.
- ``scenarios`` (FALLBACK, scripted): replies picked by the request's prompt, for what a real
  server does not produce on demand (stream errors, drops, slow answers, JSON lines).

Only loopback addresses; it runs its own event loop in a thread (``with SageMakerShim(...) as shim``).
"""

from __future__ import annotations

import asyncio
import json
import struct
import threading
import zlib
from dataclasses import dataclass, field
from typing import Self

EVENTSTREAM = "application/vnd.amazon.eventstream"


def _header(name: str, value: str) -> bytes:
    name_b, value_b = name.encode(), value.encode()
    return struct.pack("!B", len(name_b)) + name_b + b"\x07" + struct.pack("!H", len(value_b)) + value_b  # 7: string


def message(headers: dict[str, str], payload: bytes) -> bytes:
    """One event-stream message: prelude + prelude CRC, headers, payload, message CRC (big-endian)."""
    head = b"".join(_header(k, v) for k, v in headers.items())
    prelude = struct.pack("!II", 12 + len(head) + len(payload) + 4, len(head))
    body = prelude + struct.pack("!I", zlib.crc32(prelude)) + head + payload
    return body + struct.pack("!I", zlib.crc32(body))


def payload_part(data: bytes) -> bytes:
    return message({":event-type": "PayloadPart", ":content-type": "application/octet-stream",
                    ":message-type": "event"}, data)  # fmt: skip


def stream_error(kind: str, text: str, code: str | None = None) -> bytes:
    body = {"Message": text} | ({"ErrorCode": code} if code else {})
    return message({":exception-type": kind, ":content-type": "application/json", ":message-type": "exception"},
                   json.dumps(body).encode())  # fmt: skip


def sse(text: str, finish: str | None = None, chat: bool = False) -> bytes:
    """One OpenAI-style SSE chunk."""
    choice = {"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text}
    return b"data: " + json.dumps({"id": "x", "choices": [dict(choice, finish_reason=finish)]}).encode() + b"\n\n"


def awkward_split(piece: bytes) -> list[bytes]:
    """Cut after the first byte and in the middle: the first part is one byte of a line (``d`` of
    ``data:``), the middle cut lands inside the JSON (inside a multi-byte character where there is one)."""
    if len(piece) < 3:
        return [piece]
    mid = len(piece) // 2
    return [piece[:1], piece[1:mid], piece[mid:]]


@dataclass
class Scripted:
    """A scripted reply: an error answer (``status`` != 200), or stream items after their delays:
    ``(delay_s, bytes)`` sends the bytes as one PayloadPart; ``(delay_s, ("raw", bytes))`` sends the
    bytes as they are (already framed: several messages in one HTTP chunk, an exception message);
    ``(delay_s, "drop")`` closes the connection mid-stream."""

    items: list = field(default_factory=list)
    status: int = 200
    error_type: str = ""
    error_body: dict = field(default_factory=dict)
    content_type: str = "text/event-stream"


class SageMakerShim:
    def __init__(self, endpoint: str = "test-endpoint", upstream: str | None = None,
                 scenarios: dict[str, Scripted] | None = None, split=awkward_split, carry: int = 0,
                 jsonlines: bool = False, echo: bool = False, echo_gap_s: float = 0.0):  # fmt: skip
        self.endpoint, self.upstream, self.scenarios = endpoint, upstream, scenarios or {}
        self.split, self.carry, self.jsonlines, self.echo = split, carry, jsonlines, echo
        self.echo_gap_s = echo_gap_s  # seconds before each echoed chunk
        self.received: list[dict] = []  # {"path", "headers" (lower-case names), "body" (JSON)} per request
        self.parts = 0  # PayloadParts sent
        self.upstream_pieces = 0  # reads of the upstream stream (forward mode)
        self.in_flight = 0
        self.peak_in_flight = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.Server | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._writers: set[asyncio.StreamWriter] = set()

    @property
    def url(self) -> str:
        host, port = self._server.sockets[0].getsockname()[:2]
        return f"http://{host}:{port}"

    def __enter__(self) -> Self:
        ready = threading.Event()

        def serve() -> None:
            self._loop = asyncio.new_event_loop()
            self._server = self._loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", 0))
            ready.set()
            self._loop.run_forever()

        self._thread = threading.Thread(target=serve, name="sagemaker-shim", daemon=True)
        self._thread.start()
        ready.wait(10)
        return self

    def __exit__(self, *exc) -> None:
        async def stop() -> None:
            self._server.close()
            for writer in list(self._writers):  # connections the client's pool keeps alive: their
                writer.transport.abort()  # handlers see the end of input and return
            handlers = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            await asyncio.wait(handlers, timeout=5) if handlers else None

        asyncio.run_coroutine_threadsafe(stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                request_line, *lines = head.decode().split("\r\n")
                method, path, _ = request_line.split(" ", 2)
                headers = {}
                for line in lines:
                    if line:
                        name, _, value = line.partition(":")
                        headers[name.strip().lower()] = value.strip()
                body = await reader.readexactly(int(headers.get("content-length", 0)))
                with self._lock:
                    self.received.append({"method": method, "path": path, "headers": headers,
                                          "body": json.loads(body) if body else None})  # fmt: skip
                    self.in_flight += 1
                    self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
                try:
                    keep = await self._answer(path, json.loads(body) if body else {}, body, writer)
                finally:
                    with self._lock:
                        self.in_flight -= 1
                if not keep:
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self._writers.discard(writer)
            writer.close()

    async def _answer(self, path: str, body: dict, raw: bytes, writer: asyncio.StreamWriter) -> bool:
        if path != f"/endpoints/{self.endpoint}/invocations-response-stream":
            name = path.split("/")[2] if path.startswith("/endpoints/") else path
            await self._error(writer, 400, "ValidationError", {"Message": f"Endpoint {name} of account "
                                                                          "123456789012 not found."})  # fmt: skip
            return True
        if self.upstream:
            return await self._forward(raw, writer)
        key = body.get("prompt") or (body.get("messages") or [{}])[-1].get("content", "")
        reply = self.scenarios.get(key)
        if reply is None and self.echo:
            reply = _echo(body, self.echo_gap_s)
        if reply.status != 200:
            await self._error(writer, reply.status, reply.error_type, reply.error_body)
            return True
        await self._start(writer, reply.content_type)
        for delay, item in reply.items:
            if delay:
                await asyncio.sleep(delay)
            if item == "drop":
                writer.transport.abort()
                return False
            if isinstance(item, tuple):
                await self._chunk(writer, item[1])
            else:
                await self._part(writer, item)
        await self._chunk(writer, b"")
        return True

    async def _forward(self, raw: bytes, writer: asyncio.StreamWriter) -> bool:
        import aiohttp

        async with aiohttp.ClientSession() as http, \
                http.post(f"{self.upstream}/invocations", data=raw,
                          headers={"content-type": "application/json"}) as response:  # fmt: skip
            if response.status != 200:
                text = await response.text()
                await self._error(writer, 424, "ModelError", {
                    "Message": f"Received client error ({response.status}) from primary with message \"{text}\"",
                    "OriginalStatusCode": response.status, "OriginalMessage": text})  # fmt: skip
                return True
            await self._start(writer, "application/jsonlines" if self.jsonlines else response.content_type)
            held = b""
            lines = b""
            async for piece in response.content.iter_any():
                self.upstream_pieces += 1
                if self.jsonlines:  # whole lines only, rewritten; then cut like the rest
                    lines += piece
                    *complete, lines = lines.split(b"\n")
                    piece = b"".join(_as_jsonline(line) for line in complete)
                data = held + piece
                held = data[len(data) - self.carry:] if self.carry and len(data) > self.carry else b""
                for part in self.split(data[:len(data) - len(held)]):
                    await self._part(writer, part)
            tail = held + (b"".join(_as_jsonline(line) for line in lines.split(b"\n")) if self.jsonlines else b"")
            if tail:
                await self._part(writer, tail)
        await self._chunk(writer, b"")
        return True

    async def _start(self, writer, content_type: str) -> None:
        writer.write(f"HTTP/1.1 200 OK\r\nContent-Type: {EVENTSTREAM}\r\nX-Amzn-SageMaker-Content-Type: "
                     f"{content_type}\r\nx-Amzn-Invoked-Production-Variant: AllTraffic\r\n"
                     "x-amzn-RequestId: 00000000-0000-0000-0000-000000000000\r\n"
                     "Transfer-Encoding: chunked\r\n\r\n".encode())  # fmt: skip
        await writer.drain()

    async def _part(self, writer, data: bytes) -> None:
        if data:
            self.parts += 1
            await self._chunk(writer, payload_part(data))

    async def _chunk(self, writer, data: bytes) -> None:
        writer.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        await writer.drain()

    async def _error(self, writer, status: int, kind: str, body: dict) -> None:
        data = json.dumps(body).encode()
        writer.write(f"HTTP/1.1 {status} Error\r\nContent-Type: application/json\r\nx-amzn-ErrorType: {kind}\r\n"
                     f"x-amzn-RequestId: 00000000-0000-0000-0000-000000000001\r\n"
                     f"Content-Length: {len(data)}\r\n\r\n".encode() + data)  # fmt: skip
        await writer.drain()


def _as_jsonline(line: bytes) -> bytes:
    line = line.strip()
    if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
        return b""
    return line[5:].strip() + b"\n"


def _echo(body: dict, gap_s: float = 0.0) -> Scripted:
    """FALLBACK for runs through the CLI: ``max_tokens`` one-letter chunks, then usage and [DONE]
    (the prompt's count is its words plus one). A scripted stand-in, not a model: it shows what the
    client records of a stream, not what a server generates."""
    n = int(body.get("max_tokens", 1))
    chat = "messages" in body
    prompt = body.get("prompt") or body["messages"][-1]["content"]
    usage = {"prompt_tokens": len(prompt.split()) + 1, "completion_tokens": n}
    items = [(gap_s, sse("x", "length" if k == n - 1 else None, chat)) for k in range(n)]
    items += [(0, b"data: " + json.dumps({"id": "x", "choices": [], "usage": usage}).encode() + b"\n\n"),
              (0, b"data: [DONE]\n\n")]  # fmt: skip
    return Scripted(items)
