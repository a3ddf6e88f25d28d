"""FALLBACK test server: a small real HTTP/1.1 server (asyncio streams) that answers POSTs with scripted
OpenAI-style SSE bodies, for the client's tolerance tests (comment lines, no [DONE], errors in the
stream, dropped connections, slow answers) that a well-behaved server never produces on demand.

It is not vLLM and stands in for nothing: what the client does against a real server is tested in
tests/test_live_vllm.py. Scenarios are picked by the request's prompt (or its one chat message);
``default`` answers any other prompt, so a whole ``servelab bench`` run can be scripted. GET
``/v1/models`` lists one model ``m``; ``/tokenize`` counts whitespace-separated words (+1 for a BOS)
(after ``tokenize_delay_s``) unless ``tokenize`` is given (a function of the request body -> the JSON answer); ``/metrics`` is 404
unless ``metrics_delay_s`` is given (then one gauge, after that delay).
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
    def __init__(self, scenarios: dict[str, Reply], default: Reply | None = None, tokenize=None,
                 metrics_delay_s: float | None = None, models_delay_s: float = 0.0, tokenize_delay_s: float = 0.0):
        self.scenarios = scenarios
        self.metrics_delay_s = metrics_delay_s  # None: /metrics is 404; else answered after this delay
        self.models_delay_s = models_delay_s  # /v1/models answers after this delay
        self.tokenize_delay_s = tokenize_delay_s  # /tokenize answers after this delay
        self.default = default
        self.tokenize = tokenize
        self.completions = 0  # POSTs to /v1/completions or /v1/chat/completions answered
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
                method, path = (lines[0].split(" ") + ["", ""])[:2]
                length = 0
                for line in lines[1:]:
                    name, _, value = line.partition(":")
                    if name.strip().lower() == "content-length":
                        length = int(value)
                body = json.loads(await reader.readexactly(length)) if length else {}
                if method == "GET" or path == "/tokenize":
                    await self._service(writer, method, path, body)
                    continue
                self.received.append(body)
                self.completions += 1
                key = body.get("prompt") or (body.get("messages") or [{}])[-1].get("content", "")
                reply = self.scenarios.get(key, self.default) if isinstance(key, str) else self.default
                if reply is None:
                    raise KeyError(key)
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

    async def _service(self, writer: asyncio.StreamWriter, method: str, path: str, body: dict) -> None:
        if path == "/metrics" and self.metrics_delay_s is not None:
            await asyncio.sleep(self.metrics_delay_s)
            data = b"vllm:num_requests_running 0\n"
            writer.write(f"HTTP/1.1 200 X\r\ncontent-type: text/plain\r\ncontent-length: {len(data)}\r\n\r\n"
                         .encode() + data)
            await writer.drain()
            return
        if path == "/v1/models":
            await asyncio.sleep(self.models_delay_s)
            status, answer = 200, {"data": [{"id": "m"}]}
        elif path == "/tokenize":
            await asyncio.sleep(self.tokenize_delay_s)
            if self.tokenize is not None:
                status, answer = 200, self.tokenize(body)
            else:
                text = body.get("prompt") or ""
                status, answer = 200, {"count": len(text.split()) + 1}
        else:
            status, answer = 404, {"error": "not found"}
        data = json.dumps(answer).encode()
        writer.write(f"HTTP/1.1 {status} X\r\ncontent-type: application/json\r\ncontent-length: {len(data)}\r\n\r\n"
                     .encode() + data)
        await writer.drain()


def usage(completion_tokens, prompt_tokens: int = 7) -> bytes:
    return b"data: " + json.dumps({"id": "x", "choices": [], "usage": {"prompt_tokens": prompt_tokens,
                                   "completion_tokens": completion_tokens}}).encode() + b"\n\n"


class ServerThread:
    """A FallbackServer on its own event loop in a thread, for tests that run the real CLI (which
    runs its own loop): ``with ServerThread(scenarios, default=...) as server: ... server.url``."""

    def __init__(self, scenarios: dict[str, Reply], **kwargs):
        self.server = FallbackServer(scenarios, **kwargs)
        self._ready = None

    def __enter__(self) -> FallbackServer:
        import threading

        self._loop = asyncio.new_event_loop()
        ready = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(self._loop)
            self._loop.run_until_complete(self.server.__aenter__())
            ready.set()
            self._loop.run_forever()

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()
        ready.wait(10)
        return self.server

    def __exit__(self, *exc) -> None:
        async def shutdown() -> None:  # the server, then every connection's handler still running
            self.server.server.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()
