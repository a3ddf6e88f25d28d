"""The aiohttp application: OpenAI's completions and chat completions, models, health, tokenize and metrics.

Each request is submitted to the simulation at its receive time; its tokens are written as the
engine reports them (serve/sim.py), one SSE chunk per token when streaming. The engine models no
text: a token is the word " token". Errors have vLLM's shape: ``{"error": {"message", "type",
"param", "code"}}`` with 400 for a bad request (including prompt + max_tokens past max_model_len) and
404 for a model the server does not serve.
"""

from __future__ import annotations

import asyncio
import json
import time

from aiohttp import web

from servelab.replay.core.request import Status
from servelab.serve.metrics import Metrics
from servelab.serve.prompts import PromptCounter
from servelab.serve.sim import Simulation

TOKEN_TEXT = " token"
DEFAULT_MAX_TOKENS = 16  # OpenAI's completions default (also used for chat here)

SIM = web.AppKey("sim", Simulation)
METRICS = web.AppKey("metrics", Metrics)
COUNTER = web.AppKey("counter", PromptCounter)
MODEL = web.AppKey("model", str)


class BadRequest(Exception):
    def __init__(self, message: str, status: int = 400, param: str | None = None):
        super().__init__(message)
        self.status = status
        self.param = param


def error(message: str, status: int = 400, param: str | None = None) -> web.Response:
    return web.json_response(_error_body(message, status, param), status=status)


def _error_body(message: str, status: int = 400, param: str | None = None) -> dict:
    kind = {400: "BadRequestError", 404: "NotFoundError"}.get(status, "InternalServerError")
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def make_app(sim: Simulation, model: str, counter: PromptCounter) -> web.Application:
    app = web.Application()
    app[SIM], app[MODEL], app[COUNTER] = sim, model, counter
    app[METRICS] = Metrics(sim, model)

    async def on_startup(app: web.Application) -> None:
        await app[SIM].start()

    async def on_cleanup(app: web.Application) -> None:
        await app[SIM].stop()

    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/tokenize", tokenize)
    return app


async def health(request: web.Request) -> web.Response:
    return web.Response(status=200)


async def models(request: web.Request) -> web.Response:
    app = request.app
    sim = app[SIM]
    card = {"id": app[MODEL], "object": "model", "created": 0, "owned_by": "servelab", "root": app[MODEL],
            "parent": None, "max_model_len": sim.max_model_len,
            "servelab": {"simulated": True, "time_scale": sim.time_scale, "prompt_tokens": app[COUNTER].description,
                         "event_loop": event_loop()}}
    return web.json_response({"object": "list", "data": [card]})


def event_loop() -> str:
    """The running event loop's kind, as `serve --loop` names it: uvloop, or asyncio's own."""
    return "uvloop" if type(asyncio.get_running_loop()).__module__.startswith("uvloop") else "asyncio"


async def metrics(request: web.Request) -> web.Response:
    return web.Response(body=request.app[METRICS].exposition(), content_type="text/plain",
                        charset="utf-8", headers={"X-Content-Type-Options": "nosniff"})


async def _body(request: web.Request) -> dict:
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise BadRequest(f"the request body is not JSON: {err}") from err
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    model = body.get("model")
    if model is not None and model != request.app[MODEL]:
        raise BadRequest(f"The model `{model}` does not exist.", 404, "model")
    return body


def _max_tokens(body: dict, *names: str) -> int:
    for name in names:
        value = body.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise BadRequest(f"{name} must be an integer >= 1, got {value!r}", param=name)
        return value
    return DEFAULT_MAX_TOKENS


def _min_tokens(body: dict, max_tokens: int) -> None:
    """vLLM's ``min_tokens`` checks (the engine generates max_tokens anyway: nothing ends a request early)."""
    value = body.get("min_tokens")
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise BadRequest(f"min_tokens must be an integer >= 0, got {value!r}", param="min_tokens")
    if value > max_tokens:
        raise BadRequest(f"min_tokens must be less than or equal to max_tokens={max_tokens}, got {value}",
                         param="min_tokens")


def _stream_options(body: dict) -> tuple[bool, bool]:
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest(f"stream must be true or false, got {stream!r}", param="stream")
    options = body.get("stream_options")
    if options is not None and not stream:
        raise BadRequest("stream_options can only be given when stream is true", param="stream_options")
    usage = isinstance(options, dict) and bool(options.get("include_usage"))
    return stream, usage


def _prompt_tokens(body: dict, counter: PromptCounter) -> int:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:  # (vLLM refuses an empty prompt too)
            raise BadRequest("The prompt cannot be empty", param="prompt")
        return counter.count(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        negative = next((t for t in prompt if t < 0), None)
        if negative is not None:  # (no vocabulary here to bound the ids from above)
            raise BadRequest(f"Token id {negative} is out of vocabulary", param="prompt")
        return len(prompt)  # token ids
    if prompt is None:
        raise BadRequest("prompt is required", param="prompt")
    raise BadRequest("prompt must be a string or a list of token ids (one prompt per request)", param="prompt")


def _chat_tokens(body: dict, counter: PromptCounter) -> int:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
        raise BadRequest("messages must be a non-empty list of message objects", param="messages")
    return counter.chat(messages)


async def completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, chat=False)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, chat=True)


async def _serve(request: web.Request, chat: bool) -> web.StreamResponse:
    app = request.app
    sim = app[SIM]
    received_s = sim.now_s()  # the engine schedules the request from here (serve/sim.py)
    try:
        body = await _body(request)
        if chat:
            prompt_tokens = _chat_tokens(body, app[COUNTER])
            max_tokens = _max_tokens(body, "max_completion_tokens", "max_tokens")
        else:
            prompt_tokens = _prompt_tokens(body, app[COUNTER])
            max_tokens = _max_tokens(body, "max_tokens")
        _min_tokens(body, max_tokens)
        stream, include_usage = _stream_options(body)
        n = body.get("n", 1)
        if n != 1:
            raise BadRequest(f"only n=1 is simulated, got {n!r}", param="n")
        limit = sim.max_model_len
        if limit is not None and prompt_tokens + max_tokens > limit:
            raise BadRequest(f"This model's maximum context length is {limit} tokens. However, you requested "
                             f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the messages, {max_tokens} "
                             "in the completion). Please reduce the length of the messages or completion.",
                             param="max_tokens")
    except BadRequest as err:
        return error(str(err), err.status, err.param)
    req, queue = sim.submit(prompt_tokens, max_tokens, received_s)
    try:
        return await _answer(request, req, queue, chat, stream, include_usage)
    finally:  # the client went away (the handler cancelled, a write failed) before the request ended
        if not req.status.is_terminal:
            sim.abort(req)


def _unserved(req) -> str:
    return f"request not served: {req.reason or req.status.name.lower()}"


async def _answer(request: web.Request, req, queue, chat: bool, stream: bool, include_usage: bool) -> web.StreamResponse:
    app = request.app
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{req.request_id}"
    created = int(time.time())
    model = app[MODEL]
    if not stream:
        made, ended = 0, False
        while not ended:
            times, ended = await queue.get()
            made += len(times)
        if req.status is not Status.FINISHED and made == 0:
            return error(_unserved(req))
        return web.json_response(_whole(rid, created, model, chat, made, req))
    await asyncio.sleep(0)  # the clock's turn (set by submit) comes first: the arrival is processed
    if req.status.is_terminal and req.status is not Status.FINISHED:  # rejected on arrival: still a 400
        return error(_unserved(req))
    obj = "chat.completion.chunk" if chat else "text_completion"
    # The headers (and a chat's role chunk) go out now, as vLLM's server sends them, not with the first
    # token: the first token's write is its chunk alone, and the client has read the headers meanwhile.
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    made = 0
    try:
        await response.prepare(request)
        if chat:
            await response.write(_sse(_chunk(rid, obj, created, model, {"role": "assistant", "content": ""}, None)))
        token = _sse(_chunk(rid, obj, created, model, {"content": TOKEN_TEXT} if chat else TOKEN_TEXT, None))
        while True:
            times, ended = await queue.get()
            made += len(times)
            if not ended:
                await response.write(token * len(times))
                continue
            parts = [token] * max(0, len(times) - 1)
            if made == 0 and req.status is not Status.FINISHED:  # ended unserved after the headers went out:
                parts.append(_sse(_error_body(_unserved(req))))  # the error in the stream, as vLLM sends one
            else:
                text = TOKEN_TEXT if times else ""  # the last token, or an end without one (an abort)
                delta = ({"content": text} if text else {}) if chat else text
                parts.append(_sse(_chunk(rid, obj, created, model, delta, _finish_reason(req))))
                if include_usage:
                    parts.append(_sse({"id": rid, "object": obj, "created": created, "model": model, "choices": [],
                                       "usage": _usage(req.prompt_tokens, made)}))  # fmt: skip
            parts.append(b"data: [DONE]\n\n")
            await response.write(b"".join(parts))
            break
        await response.write_eof()
    except ConnectionError:
        pass  # the client went away: the request is aborted (``_serve``)
    return response


def _finish_reason(req) -> str:
    return "length" if req.status is Status.FINISHED else "abort"


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _chunk(rid: str, obj: str, created: int, model: str, delta, reason: str | None) -> dict:
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason} if isinstance(delta, dict) \
        else {"index": 0, "text": delta, "logprobs": None, "finish_reason": reason}
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice]}


def _sse(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def _whole(rid: str, created: int, model: str, chat: bool, made: int, req) -> dict:
    text = TOKEN_TEXT * made
    reason = _finish_reason(req)
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": reason}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
        obj = "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice],
            "usage": _usage(req.prompt_tokens, made)}


async def tokenize(request: web.Request) -> web.Response:
    """vLLM's ``/tokenize``: the count always; the ids only with a real tokenizer."""
    app = request.app
    counter = app[COUNTER]
    try:
        body = await _body(request)
        if "messages" in body:
            count, ids = _chat_tokens(body, counter), None
        else:
            prompt = body.get("prompt")
            if not isinstance(prompt, str):
                raise BadRequest("prompt must be a string", param="prompt")
            count, ids = counter.count(prompt), counter.ids(prompt)
    except BadRequest as err:
        return error(str(err), err.status, err.param)
    out = {"count": count, "max_model_len": app[SIM].max_model_len}
    if ids is not None:
        out["tokens"] = ids
    return web.json_response(out)
