"""Amazon SageMaker runtime streaming as a live backend: ``servelab bench sagemaker://ENDPOINT ...``.

Each request is one ``InvokeEndpointWithResponseStream`` call of boto3's ``sagemaker-runtime``
client (the optional extra ``servelab[sagemaker]``, imported only here). The body is the same
OpenAI-style completions or chat body the HTTP client sends (``Target.payload``; ``model`` only
when one is given), which is what the vLLM, SGLang and LMI containers take on ``/invocations``.
SageMaker answers with an event stream of ``PayloadPart`` events whose ``Bytes`` are arbitrary
slices of the container's own stream: a line may be split over several parts, and a part may hold
several lines. The slices are joined into lines (``LineSplitter``) and read as

- ``sse``: server-sent events (``data: {...}`` lines; vLLM, SGLang, TGI's messages API), parsed by
  live/sse.py exactly as the HTTP client parses them;
- ``jsonlines``: one JSON chunk per line (LMI's ``application/jsonlines`` streams);
- ``auto`` (default): by the container's content type (``X-Amzn-SageMaker-Content-Type``: an
  ``event-stream`` type is SSE, a ``jsonlines``/``ndjson`` type JSON lines), else by the first
  non-blank line (``{`` starts JSON lines).

Every chunk is read by live/client.py's ``read_event``: the same tokens, usage and errors. A
``ModelStreamError`` or ``InternalStreamFailure`` event, a ``ClientError`` before the stream
(``ModelError`` when the container answered 4xx/5xx, ``ValidationError``, throttling, ...) and a
broken connection make the request ``failed`` with the error's text; tokens seen before stay.

boto3 is synchronous: every request runs in a thread of its own (a daemon thread, so a request
still waiting for its answer never holds the process at exit), started when the load shape sends
it, so the threads in use are the requests in flight, which the load shape bounds (``--users``,
``--max-in-flight``); the client's connection pool is sized to the same bound. Each event's time is
taken in its thread as botocore hands it over. A timeout or cancellation is decided in the event
loop: the record is closed there at once and the thread's socket shut down; the thread then ends
without touching the record again (a lock orders the two). botocore retries nothing (one attempt
per request, as the HTTP client), and its read timeout is the per-request timeout plus a margin.

Tested offline only: against a local implementation of the SageMaker runtime protocol (the test
suite's, tests/helpers_sagemaker_server.py) through boto3 and botocore's real parser, with a real
vLLM server behind it in CI; not against AWS.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace

from servelab.common.errors import ServelabError
from servelab.live.client import (
    CANCELLED,
    ERROR_TEXT_MAX,
    NO_TEXT,
    Record,
    StreamError,
    Target,
    read_event,
    timeout_reason,
)
from servelab.live.sse import Event, EventParser, LineSplitter, LineTooLong

SCHEME = "sagemaker://"
FORMATS = ("auto", "sse", "jsonlines")
_NAME = re.compile(r"[a-zA-Z0-9](-*[a-zA-Z0-9]){0,62}")  # SageMaker's rule for endpoint names
MISSING_BOTO3 = "the SageMaker backend needs boto3: pip install 'servelab[sagemaker]'"
CHECK_TIMEOUT_S = 120.0  # the opening 2-token request
READ_TIMEOUT_MARGIN_S = 5.0  # botocore's read timeout: the request's timeout plus this (ours fires first)
NO_LIMIT_READ_TIMEOUT_S = 24 * 3600.0  # botocore's read timeout when requests have no timeout


def is_sagemaker_url(url: str) -> bool:
    return url.startswith(SCHEME)


def require_boto3() -> None:
    """Raise ServelabError naming the extra when boto3 is not installed."""
    try:
        import boto3  # noqa: F401
    except ImportError:
        raise ServelabError(MISSING_BOTO3) from None


@dataclass(frozen=True, slots=True)
class SageMakerEndpoint:
    """A SageMaker endpoint and how to reach it (the AWS options of ``servelab bench``)."""

    name: str
    region: str | None = None  # None: boto3's (AWS_REGION, AWS_DEFAULT_REGION, the profile's)
    profile: str | None = None  # a profile of ~/.aws/config (None: boto3's default chain)
    endpoint_url: str | None = None  # the runtime API's URL (a local or private endpoint)
    inference_component: str | None = None  # InferenceComponentName, for endpoints with components
    stream_format: str = "auto"  # auto | sse | jsonlines

    def __post_init__(self) -> None:
        if not _NAME.fullmatch(self.name):
            raise ServelabError(f"{SCHEME}{self.name}: not a SageMaker endpoint name (1-63 letters, digits and "
                                "hyphens, starting and ending with a letter or digit)")  # fmt: skip
        if self.stream_format not in FORMATS:
            raise ServelabError(f"stream format must be one of {', '.join(FORMATS)} (got {self.stream_format!r})")

    @classmethod
    def from_url(cls, url: str, **options) -> SageMakerEndpoint:
        """``sagemaker://NAME`` (a trailing slash is accepted) and the other fields."""
        if not is_sagemaker_url(url):
            raise ServelabError(f"{url}: a SageMaker endpoint is written {SCHEME}ENDPOINT_NAME")
        return cls(url[len(SCHEME):].rstrip("/"), **options)

    @property
    def url(self) -> str:
        return f"{SCHEME}{self.name}"


class PayloadReader:
    """PayloadPart bytes, sliced anywhere -> the container's stream events (SSE or JSON lines)."""

    def __init__(self, stream_format: str, content_type: str | None):
        self.lines = LineSplitter()
        self.sse = EventParser()
        self.format = stream_format if stream_format != "auto" else _format_of(content_type)

    def feed(self, data: bytes) -> list[Event]:
        return [e for line in self.lines.feed(data) if (e := self._line(line)) is not None]

    def close(self) -> list[Event]:
        events = [e for line in self.lines.close() if (e := self._line(line)) is not None]
        last = self.sse.close() if self.format == "sse" else None
        return events + ([last] if last is not None else [])

    def _line(self, line: str) -> Event | None:
        if self.format is None:  # auto without a telling content type: the first non-blank line says
            if not line.strip():
                return None
            self.format = "jsonlines" if line.lstrip().startswith("{") else "sse"
        if self.format == "jsonlines":
            return Event(line) if line.strip() else None
        return self.sse.feed(line)


def _format_of(content_type: str | None) -> str | None:
    kind = (content_type or "").split(";")[0].strip().lower()
    if kind.endswith("event-stream"):
        return "sse"
    if any(word in kind for word in ("jsonlines", "json-lines", "jsonl", "ndjson")):
        return "jsonlines"
    return None


class _Call:
    """One request's state shared by its thread and the event loop: whoever settles it first (the
    thread when the stream ends or fails, the loop on a timeout or cancellation) writes the outcome;
    the thread records events only while it is unsettled."""

    def __init__(self, record: Record, api: str, stream_format: str, clock: Callable[[], float],
                 notify: Callable[[], None]):  # fmt: skip
        self.record, self.api, self.stream_format, self.clock = record, api, stream_format, clock
        self.notify = notify  # tells the event loop the request is settled (callable from any thread)
        self.lock = threading.Lock()
        self.settled = False
        self.raw = None  # the HTTP response under the event stream, once it is there

    def settle(self, status: str, reason: str | None = None) -> bool:
        with self.lock:
            if self.settled:
                return False
            self.settled = True
            rec = self.record
            if status == "finished" and not rec.token_times:
                status, reason = "failed", NO_TEXT
            rec.status, rec.reason = status, reason
            if status == "finished":
                rec.finish_s = rec.token_times[-1]
            rec.end_s = self.clock()
        self.notify()
        return True

    def stop(self, status: str, reason: str) -> None:
        """From the event loop: a timeout or cancellation; unblock the thread's read."""
        if self.settle(status, reason) and self.raw is not None:
            # urllib3 >= 2.3 shuts the socket for reading, which wakes the thread's blocked read; an older
            # urllib3, or a connection already released, raises: the thread then ends with the stream
            with contextlib.suppress(Exception):
                self.raw.shutdown()

    def run(self, client, request: dict) -> None:
        """In the request's thread: the call, its events, its outcome."""
        from botocore.exceptions import ClientError, EventStreamError

        stream = None
        try:
            response = client.invoke_endpoint_with_response_stream(**request)
            stream = response["Body"]
            self.raw = getattr(stream, "_raw_stream", None)
            if self.settled:  # timed out or cancelled while the answer's headers were awaited
                return
            reader = PayloadReader(self.stream_format, response.get("ContentType"))
            done = False
            for part in stream:
                now = self.clock()
                payload = part.get("PayloadPart")
                if payload is not None and self._record(reader.feed(payload.get("Bytes") or b""), now):
                    done = True
                    break
            if not done:
                self._record(reader.close(), self.clock())
            self.settle("finished")
            if done:  # read what follows [DONE] (the stream's end) so the connection can be kept
                for _ in stream:
                    pass
        except _Settled:
            pass
        except (StreamError, LineTooLong) as err:
            self.settle("failed", str(err))
        except EventStreamError as err:  # ModelStreamError, InternalStreamFailure inside the stream
            error = err.response.get("Error", {})
            self.settle("failed", f"{error.get('Code', 'EventStreamError')}: {error.get('Message', '')}"[:ERROR_TEXT_MAX])
        except ClientError as err:  # an error answer before the stream: ModelError, ValidationError, ...
            self.settle("failed", _client_error_text(err))
        except Exception as err:  # noqa: BLE001 -- botocore's connection errors (refused, dropped, read timeout)
            self.settle("failed", _exception_text(err))  # and urllib3's while streaming: the request failed
        finally:
            if stream is not None:
                with contextlib.suppress(Exception):  # closing a broken stream may raise; nothing is left to do
                    stream.close()

    def _record(self, events: list[Event], now: float) -> bool:
        with self.lock:
            if self.settled:
                raise _Settled
            for event in events:
                if read_event(event, self.api, self.record, now):
                    return True
        return False


class _Settled(Exception):
    """The loop settled the request (timeout, cancellation) while its thread was reading."""


def _client_error_text(err) -> str:
    error = err.response.get("Error", {})
    status = err.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    text = f"{error.get('Code', 'ClientError')}" + (f" (HTTP {status})" if status else "")
    message = error.get("Message") or ""
    original = err.response.get("OriginalMessage")  # ModelError: what the container answered
    if original and original not in message:
        message = f"{message} {original}".strip()
    return f"{text}: {message}"[:ERROR_TEXT_MAX]


def _exception_text(err: Exception) -> str:
    return (f"{type(err).__name__}: {err}" if str(err) else type(err).__name__)[:ERROR_TEXT_MAX]


class SageMakerBackend:
    """``InvokeEndpointWithResponseStream`` through boto3, one thread per request in flight."""

    def __init__(self, endpoint: SageMakerEndpoint):
        self.endpoint = endpoint
        self.client = None
        self.region = endpoint.region  # the region boto3 resolved, once open

    def describe(self) -> dict:
        e = self.endpoint
        return {"backend": "sagemaker", "endpoint_name": e.name, "region": self.region, "profile": e.profile,
                "endpoint_url": e.endpoint_url, "inference_component": e.inference_component,
                "stream_format": e.stream_format}  # fmt: skip

    @asynccontextmanager
    async def open(self, target: Target, concurrency: int) -> AsyncIterator[None]:
        self.client = await asyncio.to_thread(self._make_client, target, concurrency)
        self.region = self.client.meta.region_name
        check = Record(-1, -1)
        await self.send(replace(target, ignore_eos=False, min_tokens=False, timeout_s=CHECK_TIMEOUT_S), check,
                         " a", 2)  # fmt: skip
        if check.status != "finished":
            raise RuntimeError(f"{self.endpoint.url}: the endpoint did not answer a 2-token request "
                               f"({check.reason})")  # fmt: skip
        try:
            yield
        finally:
            self.client = None

    def _make_client(self, target: Target, concurrency: int):
        try:
            import boto3
            from botocore.config import Config
            from botocore.exceptions import BotoCoreError
        except ImportError:
            raise RuntimeError(MISSING_BOTO3) from None
        e = self.endpoint
        try:
            session = boto3.session.Session(profile_name=e.profile, region_name=e.region)
            if session.region_name is None:
                raise RuntimeError(f"{e.url}: no AWS region: give --region, or set AWS_REGION or AWS_DEFAULT_REGION")
            if session.get_credentials() is None:
                raise RuntimeError(f"{e.url}: no AWS credentials found (environment, shared credentials file, "
                                   "profile or instance role)")  # fmt: skip
            read_timeout = (target.timeout_s + READ_TIMEOUT_MARGIN_S if target.timeout_s is not None
                            else NO_LIMIT_READ_TIMEOUT_S)  # fmt: skip
            config = Config(connect_timeout=30.0, read_timeout=read_timeout, retries={"total_max_attempts": 1},
                            max_pool_connections=max(10, concurrency))  # fmt: skip
            return session.client("sagemaker-runtime", endpoint_url=e.endpoint_url, config=config)
        except (BotoCoreError, ValueError) as err:  # an unknown profile, a malformed --endpoint-url, ...
            raise RuntimeError(f"{e.url}: {err}") from None

    def body(self, target: Target, prompt: str, max_tokens: int) -> dict:
        body = target.payload(prompt, max_tokens)
        if not target.model:  # no --model: the container's own model
            body.pop("model")
        return body

    def _request(self, target: Target, prompt: str, max_tokens: int) -> dict:
        request = {"EndpointName": self.endpoint.name, "ContentType": "application/json",
                   "Body": json.dumps(self.body(target, prompt, max_tokens)).encode()}  # fmt: skip
        if self.endpoint.inference_component:
            request["InferenceComponentName"] = self.endpoint.inference_component
        return request

    async def probe_extensions(self, target: Target) -> tuple[bool, str | None]:
        """One streamed 2-token request with ignore_eos + min_tokens: finished, or why not."""
        probe = Record(-1, -1)
        await self.send(replace(target, ignore_eos=True, min_tokens=True, timeout_s=CHECK_TIMEOUT_S), probe, " a", 2)
        return (True, None) if probe.status == "finished" else (False, probe.reason)

    async def tokenizer(self, target: Target) -> tuple[None, str]:
        # a local tokenizer.json, or the approximation
        return None, f"{self.endpoint.url}: a SageMaker endpoint has no /tokenize"

    def metrics_sampler(self, target: Target, interval_s: float, clock: Callable[[], float]) -> None:
        return None  # the endpoint's metrics are in CloudWatch, not a /metrics to scrape

    async def send(self, target: Target, record: Record, prompt: str | list[int], max_tokens: int,
                   clock: Callable[[], float] = time.perf_counter) -> Record:  # fmt: skip
        request = self._request(target, prompt, max_tokens)
        loop = asyncio.get_running_loop()
        ended = loop.create_future()

        def notify() -> None:
            try:
                loop.call_soon_threadsafe(_resolve, ended)
            except RuntimeError:  # the loop is closed: the run is over
                pass

        call = _Call(record, target.api, self.endpoint.stream_format, clock, notify)
        record.send_s = clock()
        threading.Thread(target=call.run, args=(self.client, request), name=f"servelab-sagemaker-{record.request_id}",
                         daemon=True).start()  # fmt: skip
        try:
            async with asyncio.timeout(target.timeout_s):
                await ended
        except TimeoutError:
            call.stop("timeout", timeout_reason(target))
        except asyncio.CancelledError:
            call.stop("cancelled", CANCELLED)
            raise
        return record


def _resolve(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)
