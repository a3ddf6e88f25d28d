"""FALLBACK test server: a small real HTTP/1.1 server (asyncio streams) that answers POSTs with scripted
OpenAI-style SSE bodies, for the client's tolerance tests (comment lines, no [DONE], errors in the
stream, dropped connections, slow answers) that a well-behaved server never produces on demand.

It is not vLLM and stands in for nothing: what the client does against a real server is tested in
tests/test_live_vllm.py. Scenarios are picked by the request's prompt (or its one chat message).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Self


def chunk(text: str, finish: str | None = None, chat: bool = False) -> bytes:
    if chat:
        choice = {"index": 0, "delta": {"content": text}, "finish_reason": finish}
    else:
        choice = {"index": 0, "text": text, "finish_reason": finish}
    return b"data: " + json.dumps({"id": "x", "choices": [choice]}).encode() + b"\n\n"


@dataclass
class Reply:
    status: int = 200
    pieces: list[tuple[float, bytes]] = field(default_factory=list)  # (delay before, bytes) of the body
    drop: bool = False  # close the connection without finishing the chunked body
    hangup: int = 0  # the first `hangup` times this prompt comes, close the connection without a byte of answer
    content_type: str = "text/event-stream"


class FallbackServer:
    def __init__(self, scenarios: dict[str, Reply]):
        self.scenarios = scenarios
        self.received: list[dict] = []
        self.hung_up: dict[str, int] = {}  # prompt -> times its connection was closed unanswered
        self.connections = 0  # connections accepted
        self.server: asyncio.Server | None = None

    @property
    def url(self) -> str:
        host, port = self.server.sockets[0].getsockname()[:2]
        return f"http://{host}:{port}"

    async def __aenter__(self) -> Self:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc) -> None:
        self.server.close()
        await self.server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode().split("\r\n")
                length = 0
                for line in lines[1:]:
                    name, _, value = line.partition(":")
                    if name.strip().lower() == "content-length":
                        length = int(value)
                body = json.loads(await reader.readexactly(length)) if length else {}
                self.received.append(body)
                key = body.get("prompt") or (body.get("messages") or [{}])[-1].get("content", "")
                reply = self.scenarios[key]
                if self.hung_up.get(key, 0) < reply.hangup:  # as a server closing an idle kept-alive connection
                    self.hung_up[key] = self.hung_up.get(key, 0) + 1
                    writer.transport.abort()
                    return
                writer.write(f"HTTP/1.1 {reply.status} X\r\ncontent-type: {reply.content_type}\r\n"
                             "transfer-encoding: chunked\r\n\r\n".encode())
                await writer.drain()
                for delay, data in reply.pieces:
                    if delay:
                        await asyncio.sleep(delay)
                    writer.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                    await writer.drain()
                if reply.drop:
                    writer.transport.abort()
                    return
                writer.write(b"0\r\n\r\n")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()
