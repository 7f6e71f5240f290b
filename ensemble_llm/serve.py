"""`ensemble-llm serve`: the ensemble behind an OpenAI-compatible HTTP API (FastAPI + uvicorn).

Endpoints: POST /v1/chat/completions (messages with tools and tool calls, `tools`/`tool_choice`,
`response_format`, `stop`, `max_tokens`/`max_completion_tokens`, `temperature`, `top_p`, `seed`,
`stream` with `stream_options.include_usage`), POST /v1/completions (raw prompts), GET /v1/models,
GET /health, GET /metrics (Prometheus, with the KV budget per device). Errors are OpenAI-shaped,
`{"error": {"message", "type", "param", "code"}}`: 400 for a bad parameter (named), a prompt over
the context window or a request whose KV cache could never fit the KV budget, 401
without the API key when one is set, 429 when the queue is full, 504 on a timeout (the body's
`timeout`, seconds), 500 only for a fault inside generation (the engine keeps serving). A
client that disconnects cancels its request: no further forward pass runs for it. Every reply
carries the ensemble's figures in an extra `ensemble` field.

Needs the `serve` extra: pip install "ensemble-llm[serve]".
"""

import asyncio
import json
import secrets
import threading
import time
import uuid
from typing import Any, AsyncIterator

from pydantic import BaseModel, ConfigDict, ValidationError

from .engine import Ensemble
from .errors import EnsembleError, GenerationError, RequestCancelled, RequestError, RequestTimeout
from .params import GenerationParams
from .results import GenerationResult


class _Body(BaseModel):
    """The OpenAI body fields this server reads; any other field is refused by name (400). The
    settings stay loosely typed here: GenerationParams checks them and names the fix."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    tools: list[dict] | None = None
    tool_choice: Any = None
    response_format: Any = None
    stop: Any = None
    max_tokens: Any = None
    max_completion_tokens: Any = None
    temperature: Any = None
    top_p: Any = None
    seed: Any = None
    timeout: Any = None  # seconds: the request stops with 504 after it
    stream: bool = False
    stream_options: dict | None = None
    n: int | None = 1
    # sent routinely by clients; they change nothing here
    user: Any = None
    parallel_tool_calls: Any = None
    frequency_penalty: Any = None
    presence_penalty: Any = None
    logprobs: Any = None
    metadata: Any = None
    store: Any = None


class ChatBody(_Body):
    """POST /v1/chat/completions."""

    messages: list[dict]


class CompletionBody(_Body):
    """POST /v1/completions: a raw prompt (one string, or a list of exactly one)."""

    prompt: str | list[str]


def _api_error(exc: ValidationError) -> "ApiError":
    """A body pydantic refused, as a 400 naming the field (every unknown field at once)."""
    errors = exc.errors()
    extra = [str(e["loc"][0]) for e in errors if e["type"] == "extra_forbidden"]
    if extra:
        return ApiError(400, f"unsupported field(s) {sorted(extra)}", param=sorted(extra)[0])
    e = errors[0]
    field = str(e["loc"][0]) if e["loc"] else None
    hints = {
        "messages": "'messages' must be a list of {'role', 'content'} objects",
        "prompt": "'prompt' must be a string",
    }
    where = ".".join(str(x) for x in e["loc"])
    return ApiError(400, f"{hints.get(field, where)}: {e['msg']} (got {e.get('input')!r:.200})", param=field)


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _param_of(message: str) -> str | None:
    """The request field a RequestError names (its message starts with or quotes it)."""
    for name in (
        "max_new_tokens",
        "temperature",
        "top_p",
        "seed",
        "stop",
        "timeout",
        "tool_choice",
        "tools",
        "response_format",
        "messages",
        "prompt",
    ):
        if name in message:
            return {"max_new_tokens": "max_tokens"}.get(name, name)
    if "message " in message or "content" in message:
        return "messages"
    return None


def _from_engine_error(exc: EnsembleError) -> ApiError:
    if isinstance(exc, RequestTimeout):
        return ApiError(504, str(exc), "timeout_error", "timeout", "timeout")
    if isinstance(exc, RequestError):
        return ApiError(400, str(exc), "invalid_request_error", _param_of(str(exc)), exc.code)
    if isinstance(exc, RequestCancelled):
        return ApiError(499, str(exc), "cancelled")
    if isinstance(exc, GenerationError):
        return ApiError(500, f"{exc} (the server keeps serving)", "server_error")
    return ApiError(400, str(exc))


def _messages(raw: list[dict]) -> list[dict]:
    """OpenAI chat messages -> the engine's (tool-call arguments parsed from their JSON text)."""
    out = []
    for i, m in enumerate(raw):
        m = dict(m)
        if m.get("role") == "developer":
            m["role"] = "system"
        if m.get("role") == "tool" and not (isinstance(m.get("tool_call_id"), str) and m["tool_call_id"]):
            raise ApiError(
                400,
                f"messages[{i}] (tool) has no tool_call_id (got {m.get('tool_call_id')!r}); a tool "
                "result must name the call it answers: give it the 'tool_call_id' of that call.",
                param="messages",
            )
        calls = m.get("tool_calls")
        if isinstance(calls, list):
            fixed = []
            for c in calls:
                if isinstance(c, dict) and isinstance(c.get("function"), dict):
                    fn = dict(c["function"])
                    if isinstance(fn.get("arguments"), str):
                        try:
                            fn["arguments"] = json.loads(fn["arguments"] or "{}")
                        except ValueError:
                            raise ApiError(
                                400,
                                f"messages[{i}].tool_calls: arguments are not JSON: {fn['arguments']!r}",
                                param="messages",
                            ) from None
                    c = {**c, "function": fn}
                fixed.append(c)
            m["tool_calls"] = fixed
        out.append(m)
    return out


def _params(body: _Body, *, raw: bool) -> GenerationParams:
    if body.n not in (1, None):
        raise ApiError(
            400, f"n={body.n!r}: this server returns one choice per request; send n=1 (or several requests)", param="n"
        )
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    settings: dict[str, Any] = {"raw": raw}
    for name in ("temperature", "top_p", "seed", "timeout", "stop", "response_format"):
        if getattr(body, name) is not None:
            settings[name] = getattr(body, name)
    if max_tokens is not None:
        settings["max_new_tokens"] = max_tokens
    if body.tools:
        settings["tools"] = tuple(body.tools)
        if body.tool_choice is not None:
            settings["tool_choice"] = body.tool_choice
    elif body.tool_choice not in (None, "none", "auto"):
        raise ApiError(400, "tool_choice needs tools", param="tool_choice")
    try:
        return GenerationParams(**settings)
    except RequestError as exc:
        raise _from_engine_error(exc) from None


class Server:
    """The state behind the app: the engine, the queue limit and the metrics."""

    def __init__(self, engine: Ensemble, *, api_key: str | None = None, max_queue: int = 64) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.engine, self.api_key, self.max_queue = engine, api_key, max_queue
        self.model_id = f"{engine.method_name}:{'+'.join(engine.model_names)}"
        self.in_flight = 0
        self.lock = threading.Lock()
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "ensemble_requests", "Requests by endpoint and status", ["endpoint", "status"], registry=self.registry
        )
        self.tokens = Counter("ensemble_completion_tokens", "Completion tokens written", registry=self.registry)
        self.queue = Gauge("ensemble_queue_depth", "Requests waiting or running", registry=self.registry)
        self.seconds = Histogram(
            "ensemble_request_seconds", "Request time by method", ["method"], registry=self.registry
        )
        kv = "KV-cache bytes per device: the kv_budget limit, and the bound the running requests reserve"
        self.kv_limit = Gauge("ensemble_kv_budget_bytes", kv, ["device"], registry=self.registry)
        self.kv_reserved = Gauge("ensemble_kv_reserved_bytes", kv, ["device"], registry=self.registry)

    def kv_figures(self) -> None:
        """The KV budget's figures into the gauges (read at each /metrics scrape)."""
        used = self.engine.kv_budget.in_use()
        for device, limit in self.engine.kv_budget.limits().items():
            self.kv_limit.labels(device).set(limit)
            self.kv_reserved.labels(device).set(used.get(device, 0))

    def admit(self) -> None:
        with self.lock:
            if self.in_flight >= self.max_queue:
                raise ApiError(
                    429,
                    f"the queue is full ({self.max_queue} requests); retry later",
                    "rate_limit_exceeded",
                    None,
                    "queue_full",
                )
            self.in_flight += 1
            self.queue.set(self.in_flight)

    def release(self) -> None:
        with self.lock:
            self.in_flight -= 1
            self.queue.set(self.in_flight)

    def ensemble_field(self, result: GenerationResult) -> dict:
        stats = {k: v for k, v in result.stats.items() if k != "trace"}
        return {"method": result.method, "members": result.models, "stats": stats}


def _tool_calls(result: GenerationResult) -> list[dict]:
    return [
        {
            "id": c.id,
            "type": "function",
            "function": {"name": c.name, "arguments": json.dumps(c.arguments, ensure_ascii=False)},
        }
        for c in result.tool_calls
    ]


def _usage(result: GenerationResult) -> dict:
    return result.usage.to_dict()


def _check_key(srv: Server, request) -> None:
    if srv.api_key is not None:
        auth = request.headers.get("authorization", "")
        # constant-time comparison: the time a wrong key takes says nothing about the right one
        if not secrets.compare_digest(auth.encode(), f"Bearer {srv.api_key}".encode()):
            raise ApiError(
                401,
                "missing or wrong API key: send 'Authorization: Bearer <key>'",
                "authentication_error",
                None,
                "invalid_api_key",
            )


async def _read(request, model: type[_Body]) -> _Body:
    """The request body as `model` (ChatBody or CompletionBody), or a 400 naming what is wrong."""
    try:
        body = await request.json()
    except ValueError:
        raise ApiError(400, "the request body is not JSON") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise _api_error(exc) from None


async def _run(engine: Ensemble, request, prompt: Any, params: GenerationParams) -> GenerationResult:
    """One non-streamed request; a client that disconnects cancels it."""
    stream = engine.astream(prompt, params)

    async def consume():
        async for _ in stream:
            pass
        return stream.result

    task = asyncio.ensure_future(consume())
    while not task.done():
        await asyncio.wait({task}, timeout=0.25)
        if not task.done() and await request.is_disconnected():
            task.cancel()  # the stream's cleanup tells the engine: no further forward pass
            raise ApiError(499, "the client disconnected", "cancelled")
    return task.result()


def _reply(srv: Server, result: GenerationResult, rid: str, created: int, chat: bool) -> dict:
    """A non-streamed reply in OpenAI's shape, with the ensemble's figures."""
    if chat:
        message = {"role": "assistant", "content": result.text if (result.text or not result.tool_calls) else None}
        if result.tool_calls:
            message["tool_calls"] = _tool_calls(result)
        choice = {"index": 0, "message": message, "finish_reason": result.finish_reason, "logprobs": None}
    else:
        choice = {"index": 0, "text": result.text, "finish_reason": result.finish_reason, "logprobs": None}
    return {
        "id": rid,
        "object": "chat.completion" if chat else "text_completion",
        "created": created,
        "model": srv.model_id,
        "choices": [choice],
        "usage": _usage(result),
        "ensemble": srv.ensemble_field(result),
    }


async def _handle(srv: Server, request, endpoint: str, chat: bool):
    """One completion request: checked, admitted to the queue, run (or streamed), answered."""
    from fastapi.responses import StreamingResponse

    engine = srv.engine
    _check_key(srv, request)
    body = await _read(request, ChatBody if chat else CompletionBody)
    if chat:
        prompt = _messages(body.messages)
    else:
        prompt = body.prompt
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if not isinstance(prompt, str):
            raise ApiError(400, "'prompt' must be a string", param="prompt")
    params = _params(body, raw=not chat)
    try:
        engine.check_request(prompt, params)
    except RequestError as exc:
        raise _from_engine_error(exc) from None
    srv.admit()
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
    created = int(time.time())
    if body.stream:
        include_usage = bool((body.stream_options or {}).get("include_usage"))
        return StreamingResponse(
            _sse(srv, engine, prompt, params, rid, created, chat, include_usage, endpoint),
            media_type="text/event-stream",
        )
    t0 = time.perf_counter()
    try:
        result = await _run(engine, request, prompt, params)
    except EnsembleError as exc:
        raise _from_engine_error(exc) from None
    finally:
        srv.release()
    srv.seconds.labels(engine.method_name).observe(time.perf_counter() - t0)
    srv.tokens.inc(result.usage.completion_tokens)
    srv.requests.labels(endpoint, "200").inc()
    return _reply(srv, result, rid, created, chat)


def create_app(engine: Ensemble, *, api_key: str | None = None, max_queue: int = 64):
    """The FastAPI app serving `engine` (see the module doc)."""
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, PlainTextResponse
    from prometheus_client import generate_latest

    srv = Server(engine, api_key=api_key, max_queue=max_queue)
    app = FastAPI(title="ensemble-llm", version="1")
    app.state.server = srv

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError):
        srv.requests.labels(request.url.path, str(exc.status)).inc()
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": srv.model_id, "queue": srv.in_flight}

    @app.get("/v1/models")
    async def models(request: Request):
        _check_key(srv, request)
        return {
            "object": "list",
            "data": [{"id": srv.model_id, "object": "model", "created": 0, "owned_by": "ensemble-llm"}],
        }

    @app.get("/metrics")
    async def metrics():
        srv.kv_figures()
        return PlainTextResponse(generate_latest(srv.registry).decode(), media_type="text/plain; version=0.0.4")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _handle(srv, request, "/v1/chat/completions", chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _handle(srv, request, "/v1/completions", chat=False)

    return app


async def _sse(
    srv: Server,
    engine: Ensemble,
    prompt: Any,
    params: GenerationParams,
    rid: str,
    created: int,
    chat: bool,
    include_usage: bool,
    endpoint: str,
) -> AsyncIterator[str]:
    """Server-sent events in OpenAI's chunk format; the generator's cancellation (a client that
    went away) reaches the engine through the stream's cleanup."""
    obj = "chat.completion.chunk" if chat else "text_completion"

    def chunk(delta: dict | str | None, finish: str | None = None, **extra) -> str:
        if chat:
            choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]
        else:
            choices = [] if delta is None else [{"index": 0, "text": delta, "finish_reason": finish, "logprobs": None}]
        return (
            "data: "
            + json.dumps(
                {"id": rid, "object": obj, "created": created, "model": srv.model_id, "choices": choices, **extra},
                ensure_ascii=False,
            )
            + "\n\n"
        )

    t0 = time.perf_counter()
    stream = engine.astream(prompt, params)
    try:
        if chat:
            yield chunk({"role": "assistant", "content": ""})
        try:
            async for delta in stream:
                yield chunk({"content": delta} if chat else delta)
        except EnsembleError as exc:
            err = _from_engine_error(exc)
            srv.requests.labels(endpoint, str(err.status)).inc()
            yield "data: " + json.dumps(err.body()) + "\n\n"
            return
        result = stream.result
        if chat and result.tool_calls:
            calls = [{"index": i, **c} for i, c in enumerate(_tool_calls(result))]
            yield chunk({"tool_calls": calls})
        yield chunk({} if chat else "", result.finish_reason, ensemble=srv.ensemble_field(result))
        if include_usage:
            yield chunk(None, usage=_usage(result))
        yield "data: [DONE]\n\n"
        srv.seconds.labels(engine.method_name).observe(time.perf_counter() - t0)
        srv.tokens.inc(result.usage.completion_tokens)
        srv.requests.labels(endpoint, "200").inc()
    finally:
        srv.release()


def serve(
    members: list | None,
    method: str | None,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    max_queue: int = 64,
    device: str = "auto",
    config: Any = None,
    placement: str = "local",
    ray_address: str | None = None,
    member_resources: Any = None,
    max_batch: int | str = "auto",
    kv_budget: Any = "auto",
) -> None:
    """Load the ensemble (members in this process, or each in a Ray actor with placement="ray"),
    then serve it until interrupted."""
    import uvicorn

    engine = Ensemble(
        members,
        method,
        config,
        device=device,
        placement=placement,
        ray_address=ray_address,
        member_resources=member_resources,
        max_batch=max_batch,
        kv_budget=kv_budget,
    ).load()
    uvicorn.run(create_app(engine, api_key=api_key, max_queue=max_queue), host=host, port=port, log_level="warning")
