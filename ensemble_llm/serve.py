"""`ensemble-llm serve`: the ensemble behind an OpenAI-compatible HTTP API (FastAPI + uvicorn).

Endpoints: POST /v1/chat/completions (messages with tools and tool calls, `tools`/`tool_choice`,
`response_format`, `stop`, `max_tokens`/`max_completion_tokens`, `temperature`, `top_p`, `seed`,
`stream` with `stream_options.include_usage`, `logprobs`/`top_logprobs`), POST /v1/completions
(raw prompts, as text or token ids, with `logprobs`, `echo` and `max_tokens: 0`; serve_scoring.py),
GET /v1/models, GET /tokenizer_info, POST /tokenize and POST /detokenize (the main member's tokenizer,
in vLLM's shapes; serve_tokenizer.py),
GET /health, GET /metrics (Prometheus, with the KV budget per device). Errors are OpenAI-shaped,
`{"error": {"message", "type", "param", "code"}}`: 400 for a bad parameter (named), a prompt over
the context window or a request whose KV cache could never fit the KV budget, 401
without the API key when one is set, 404 for a model this server does not serve, 413 for a body
over the size limit, 415 for a body that is not JSON, 421 for a Host header the server was not
started for, 429 when the queue is full, 504 on a timeout (the body's `timeout`, seconds), 500
only for a fault inside generation (a generic message with the request id; the detail goes to
the server's log; the engine keeps serving). A client that disconnects cancels its request: no
further forward pass runs for it. Every reply carries the ensemble's figures in an extra
`ensemble` field.

Every request is bounded before it reaches the queue (`Limits`): the body is read in chunks up
to its size limit, and parsing and every check (schemas and tools compiled included) run in a
small thread pool under a time bound, so the event loop (and /health) never waits for them.
docs/serving-safely.md says what is bound by default and why.

Needs the `serve` extra: pip install "ensemble-llm[serve]".
"""

import asyncio
import dataclasses
import json
import logging
import secrets
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

from pydantic import BaseModel, ConfigDict, ValidationError
from starlette.responses import JSONResponse, StreamingResponse

from . import serve_tokenizer
from .engine import Ensemble
from .errors import EnsembleError, RequestCancelled, RequestError, RequestTimeout
from .params import GenerationParams
from .results import GenerationResult, Usage
from .serve_scoring import Wants, completion_prompts, echoed, prompt_only, reply_in_scoring, scored, wants

log = logging.getLogger("ensemble_llm.serve")
API_KEY_ENV = "ENSEMBLE_LLM_API_KEY"
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "[::1]")
MODEL_ALIASES = ("ensemble",)  # besides the model id and the method name: what client mode sends


@dataclass(frozen=True)
class Limits:
    """What one request may hold; a request past a limit is refused before any queue, naming it."""

    body_bytes: int = 4 * 2**20  # a 128k-token prompt is about 0.5 MB of text
    stop: int = 4  # OpenAI's API takes at most 4 stop strings
    tools: int = 128  # and at most 128 tools
    # OpenAI documents no message limit; a chat template spends at least 4 tokens on each message,
    # so 2048 messages are 8k tokens of framing alone (SmolLM2's whole context window), and the
    # checks and templating of each message stay bounded
    messages: int = 2048
    check_seconds: float = 10.0  # parsing and checking one request (schemas compiled included)


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
    metadata: Any = None
    store: Any = None


class ChatBody(_Body):
    """POST /v1/chat/completions."""

    messages: list[dict]
    logprobs: Any = None  # true: the reply's tokens with the ensemble's log-probabilities (serve_scoring.py)
    top_logprobs: Any = None


class CompletionBody(_Body):
    """POST /v1/completions: a raw prompt (one string or one list of token ids, or a list of exactly one)."""

    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: Any = None  # an integer: the tokens' log-probabilities and that many alternatives
    echo: bool = False


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
        "prompt": "'prompt' must be a string or a list of token ids",
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


_FIELDS = (
    "max_new_tokens",
    "max_tokens",
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
    "top_logprobs",
    "logprobs",
    "echo",
)


def _param_of(message: str) -> str | None:
    """The request field a RequestError names (its message starts with or quotes it)."""
    if message.startswith("tool ") or message.startswith("tools"):
        return "tools"
    for name in sorted(_FIELDS, key=lambda n: not message.startswith(n)):  # the field it starts with first
        if name in message:
            return {"max_new_tokens": "max_tokens"}.get(name, name)
    if "message " in message or "content" in message:
        return "messages"
    return None


def internal_error(rid: str, exc: BaseException) -> "ApiError":
    """A fault inside the server, as a 500 that names only the request id: the detail (a Ray
    traceback, paths, pids) goes to the server's log, never to the client."""
    log.error("request %s failed: %s: %s", rid, type(exc).__name__, exc, exc_info=exc)
    return ApiError(
        500,
        f"internal error while generating (request id {rid}); the server keeps serving, and its log "
        "holds the details under that id.",
        "server_error",
        None,
        "internal_error",
    )


def _from_engine_error(exc: EnsembleError, rid: str) -> ApiError:
    if isinstance(exc, RequestTimeout):
        return ApiError(504, str(exc), "timeout_error", "timeout", "timeout")
    if isinstance(exc, RequestError):
        return ApiError(400, str(exc), "invalid_request_error", _param_of(str(exc)), exc.code)
    if isinstance(exc, RequestCancelled):
        return ApiError(499, str(exc), "cancelled")
    return internal_error(rid, exc)  # GenerationError and anything else raised inside generation


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
            m["tool_calls"] = [_parsed_call(c, i) for c in calls]
        out.append(m)
    return out


def _parsed_call(c: Any, i: int) -> Any:
    """One tool call of message i with its arguments parsed from their JSON text."""
    if not (isinstance(c, dict) and isinstance(c.get("function"), dict)):
        return c
    fn = dict(c["function"])
    if isinstance(fn.get("arguments"), str):
        try:
            fn["arguments"] = json.loads(fn["arguments"] or "{}")
        except (ValueError, RecursionError):
            raise ApiError(
                400, f"messages[{i}].tool_calls: arguments are not JSON: {fn['arguments']!r:.200}", param="messages"
            ) from None
    return {**c, "function": fn}


def _max_tokens(body: _Body) -> Any:
    return body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens


def _params(body: _Body, *, raw: bool, generate: bool = True) -> GenerationParams:
    if body.n not in (1, None):
        raise ApiError(
            400, f"n={body.n!r}: this server returns one choice per request; send n=1 (or several requests)", param="n"
        )
    max_tokens = _max_tokens(body)
    settings: dict[str, Any] = {"raw": raw}
    for name in ("temperature", "top_p", "seed", "timeout", "stop", "response_format"):
        if getattr(body, name) is not None:
            settings[name] = getattr(body, name)
    if max_tokens is not None and generate:
        settings["max_new_tokens"] = max_tokens
    if body.tools:
        settings["tools"] = tuple(body.tools)
        if body.tool_choice is not None:
            settings["tool_choice"] = body.tool_choice
    elif body.tool_choice not in (None, "none", "auto"):
        raise ApiError(400, "tool_choice needs tools", param="tool_choice")
    return GenerationParams(**settings)


class _Slot:
    """One request's place in the queue, given back exactly once whatever path the request takes."""

    def __init__(self, srv: "Server") -> None:
        self._srv, self._held = srv, True

    def release(self) -> None:
        with self._srv.lock:
            if not self._held:
                return
            self._held = False
            self._srv.in_flight -= 1
            self._srv.queue.set(self._srv.in_flight)


class Server:
    """The state behind the app: the engine, the limits, the queue, the checks' threads and the metrics."""

    def __init__(
        self, engine: Ensemble, *, api_key: str | None = None, max_queue: int = 64, limits: Limits | None = None
    ) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.engine, self.api_key, self.max_queue = engine, api_key, max_queue
        self.limits = limits or Limits()
        self.model_id = f"{engine.method_name}:{'+'.join(engine.model_names)}"
        self.model_names = {self.model_id, engine.method_name, *MODEL_ALIASES}
        self.in_flight = 0
        self.lock = threading.Lock()
        # the requests' checks run here, two at a time: a burst of costly requests waits its turn
        # (each under its time bound) instead of taking every core from the running requests
        self.checkers = ThreadPoolExecutor(max_workers=2, thread_name_prefix="ensemble-llm-check")
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

    def admit(self) -> _Slot:
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
        return _Slot(self)

    async def checked(self, check: Callable[[], Any]) -> Any:
        """`check()` in the checks' threads, answered within `limits.check_seconds`: the event
        loop never runs it. A check still running at the bound finishes in its thread, unread."""
        future = self.checkers.submit(check)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), self.limits.check_seconds)
        except TimeoutError:
            if future.cancel():  # it never started: other requests' checks held the threads
                raise ApiError(503, "the server is busy checking other requests; retry later", "server_error") from None
            raise ApiError(
                400,
                f"checking this request took longer than {self.limits.check_seconds:g} s (a large JSON Schema "
                "or many tools); send a smaller one.",
            ) from None

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


def _usage(results: list[GenerationResult]) -> dict:
    """The usage of a reply, summed over its prompts."""
    us = [r.usage for r in results]
    total = Usage(
        sum(u.prompt_tokens for u in us), sum(u.completion_tokens for u in us), sum(u.cached_tokens for u in us)
    )
    return total.to_dict()


def _key_ok(srv: Server, request) -> bool:
    if srv.api_key is None:
        return True
    auth = request.headers.get("authorization", "")
    # constant-time comparison: the time a wrong key takes says nothing about the right one
    return secrets.compare_digest(auth.encode(), f"Bearer {srv.api_key}".encode())


def _check_key(srv: Server, request) -> None:
    if not _key_ok(srv, request):
        raise ApiError(
            401,
            "missing or wrong API key: send 'Authorization: Bearer <key>'",
            "authentication_error",
            None,
            "invalid_api_key",
        )


async def _body_bytes(request, limit: int) -> bytes:
    """The raw body of a POST: JSON only (415 otherwise), read in chunks and refused with 413 as
    soon as it passes `limit` bytes, whatever Content-Length claims."""
    media = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media != "application/json":
        # a browser page may send text/plain or a form to any site without asking first (a CORS
        # "simple" request): refusing every other type keeps such posts from driving the models
        raise ApiError(
            415,
            f"the body must be JSON sent as 'Content-Type: application/json' (got {media or 'no content type'!r})",
            param="content-type",
            code="unsupported_media_type",
        )
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            await _drain(request, 16 * limit)  # so the client reads the 413 instead of a reset connection
            raise ApiError(
                413,
                f"the request body is larger than this server takes ({limit} bytes); send a shorter prompt "
                "(or start the server with a larger --max-body-mb)",
                code="request_too_large",
            )
        chunks.append(chunk)
    return b"".join(chunks)


async def _drain(request, cap: int) -> None:
    """Read and drop the rest of a refused body, up to `cap` bytes (past that the connection just closes)."""
    seen = 0
    try:
        async for chunk in request.stream():
            seen += len(chunk)
            if seen > cap:
                return
    except Exception:  # noqa: BLE001 - the client went away: nothing left to drain
        return


def _parsed(raw: bytes, model: type[_Body]) -> _Body:
    """The body's JSON as `model` (ChatBody or CompletionBody), or a 400 naming what is wrong."""
    try:
        data = json.loads(raw)
    except RecursionError:
        raise ApiError(400, "the request body nests JSON too deeply to read") from None
    except ValueError:  # UnicodeDecodeError included
        raise ApiError(400, "the request body is not JSON") from None
    if not isinstance(data, dict):
        raise ApiError(400, "the request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise _api_error(exc) from None


def _check_counts(body: _Body, limits: Limits) -> None:
    """Stop strings, tools and messages within their limits (before any of them is read)."""
    stop = body.stop if isinstance(body.stop, list) else []
    messages = getattr(body, "messages", [])
    for count, limit, name, fix in (
        (len(stop), limits.stop, "stop", "stop strings (OpenAI's limit too)"),
        (len(body.tools or []), limits.tools, "tools", "tools (OpenAI's limit too)"),
        (len(messages), limits.messages, "messages", "messages: send a shorter conversation"),
    ):
        if count > limit:
            raise ApiError(400, f"'{name}' lists {count} entries; this server takes at most {limit} {fix}", param=name)


def _check_model(srv: Server, name: str | None) -> None:
    if name is not None and name not in srv.model_names:
        others = ", ".join(repr(n) for n in sorted(srv.model_names - {srv.model_id}))
        raise ApiError(
            404,
            f"the model {name!r} does not exist here; this server serves {srv.model_id!r} (also named {others})",
            param="model",
            code="model_not_found",
        )


def _checked_request(srv: Server, raw: bytes, chat: bool) -> tuple[_Body, list, GenerationParams, Wants]:
    """Everything a request is checked for before it may queue (run in the checks' threads)."""
    body = _parsed(raw, ChatBody if chat else CompletionBody)
    _check_counts(body, srv.limits)
    _check_model(srv, body.model)
    try:
        prompts = [(_messages(body.messages), None)] if chat else completion_prompts(srv.engine, body.prompt)
        want = wants(body, chat, _max_tokens(body))
        if len(prompts) > 1 and body.stream:
            raise RequestError("a list of prompts is answered in one reply here; send it with stream: false")
        params = _params(body, raw=not chat, generate=want.generate)
        for prompt, _ in prompts:
            srv.engine.check_request(prompt, params)
    except RequestError as exc:
        raise _from_engine_error(exc, "") from None
    return body, prompts, params, want


async def _run(engine: Ensemble, request, prompt: Any, params: GenerationParams) -> GenerationResult:
    """One non-streamed request; a client that disconnects cancels it."""
    stream = engine.astream(prompt, params)

    async def consume():
        async for _ in stream:
            pass
        return stream.result

    task = asyncio.ensure_future(consume())
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=0.25)
            if not task.done() and await request.is_disconnected():
                raise ApiError(499, "the client disconnected", "cancelled")
        return task.result()
    finally:
        if not task.done():
            task.cancel()  # the stream's cleanup tells the engine: no further forward pass


def _reply(srv: Server, answers: list[tuple], rid: str, created: int, chat: bool, echo: bool) -> dict:
    """A non-streamed reply in OpenAI's shape, one choice per prompt (each answer: the result, its
    logprobs and the prompt echoed before a completion's text), with the ensemble's figures."""
    choices = []
    for i, (result, logprobs, shown) in enumerate(answers):
        if chat:
            content = result.text if (result.text or not result.tool_calls) else None
            message = {"role": "assistant", "content": content}
            if result.tool_calls:
                message["tool_calls"] = _tool_calls(result)
            choices.append(
                {"index": i, "message": message, "finish_reason": result.finish_reason, "logprobs": logprobs}
            )
        else:
            text = shown + result.text
            choices.append({"index": i, "text": text, "finish_reason": result.finish_reason, "logprobs": logprobs})
    results = [a[0] for a in answers]
    return {
        "id": rid,
        "object": "chat.completion" if chat else "text_completion",
        "created": created,
        "model": srv.model_id,
        "choices": choices,
        "usage": _usage(results),
        "ensemble": srv.ensemble_field(results[0]) if len(results) == 1 else [srv.ensemble_field(r) for r in results],
    }


async def _handle(srv: Server, request, endpoint: str, chat: bool):
    """One completion request: read, checked off the loop, admitted to the queue, run (or
    streamed) and answered; its queue slot is given back on every path."""
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
    request.state.rid = rid
    _check_key(srv, request)
    raw = await _body_bytes(request, srv.limits.body_bytes)
    body, prompts, params, want = await srv.checked(lambda: _checked_request(srv, raw, chat))
    slot = srv.admit()
    created = int(time.time())
    try:
        if body.stream:
            include_usage = bool((body.stream_options or {}).get("include_usage"))
            events = _sse(srv, prompts[0][0], params, rid, created, chat, include_usage, endpoint, slot)
            return _SlotStream(events, slot)
        t0 = time.perf_counter()
        try:
            answers = await _answers(srv, request, prompts, params, want, chat)
        except EnsembleError as exc:
            raise _from_engine_error(exc, rid) from None
    except BaseException:
        slot.release()
        raise
    slot.release()
    srv.seconds.labels(srv.engine.method_name).observe(time.perf_counter() - t0)
    srv.tokens.inc(sum(a[0].usage.completion_tokens for a in answers))
    srv.requests.labels(endpoint, "200").inc()
    return _reply(srv, answers, rid, created, chat, want.echo)


async def _answers(srv: Server, request, prompts: list, params: GenerationParams, want: Wants, chat: bool) -> list:
    """Each prompt of a request: (result, logprobs, the text echoed before the reply). Echoed
    prompts are scored together once all are generated (`serve_scoring.echoed`)."""
    wants = [dataclasses.replace(want, ids=ids) for _, ids in prompts]
    results = await asyncio.gather(*(_result(srv, request, t, params, w) for (t, _), w in zip(prompts, wants)))
    if want.echo and want.logprobs:
        texts = [t for t, _ in prompts]
        done = await echoed(srv.engine, wants, texts, results, tuple(params.stop))
        return [(result, logprobs, text) for text, (logprobs, result) in zip(texts, done)]
    stops, texts = tuple(params.stop), [t for t, _ in prompts]
    done = await asyncio.gather(*(scored(srv.engine, w, t, r, chat, stops) for t, w, r in zip(texts, wants, results)))
    return [(result, logprobs, text if want.echo else "") for text, (logprobs, result) in zip(texts, done)]


async def _result(srv: Server, request, text: str, params: GenerationParams, want: Wants) -> GenerationResult | None:
    """One prompt's generated result (None: its reply is read off its scoring)."""
    if reply_in_scoring(srv.engine, want, params):
        return None
    return await _run(srv.engine, request, text, params) if want.generate else prompt_only(srv.engine, text)


class _SlotStream(StreamingResponse):
    """Server-sent events that give the queue slot back when the response ends, also when the
    client left before the first event (then the events' generator never starts, nor its finally)."""

    def __init__(self, events: AsyncIterator[str], slot: _Slot) -> None:
        super().__init__(events, media_type="text/event-stream")
        self.slot = slot

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.slot.release()


async def _sse(
    srv: Server,
    prompt: Any,
    params: GenerationParams,
    rid: str,
    created: int,
    chat: bool,
    include_usage: bool,
    endpoint: str,
    slot: _Slot,
) -> AsyncIterator[str]:
    """Server-sent events in OpenAI's chunk format; the generator's cancellation (a client that
    went away) reaches the engine through the stream's cleanup. A failure mid-stream is one
    OpenAI-shaped error event (a fault inside generation: generic, with the request id)."""
    obj = "chat.completion.chunk" if chat else "text_completion"

    def chunk(delta: dict | str | None, finish: str | None = None, **extra) -> str:
        key = "delta" if chat else "text"
        choices = [] if delta is None else [{"index": 0, key: delta, "finish_reason": finish, "logprobs": None}]
        event = {"id": rid, "object": obj, "created": created, "model": srv.model_id, "choices": choices, **extra}
        return "data: " + json.dumps(event, ensure_ascii=False) + "\n\n"

    t0 = time.perf_counter()
    try:
        stream = srv.engine.astream(prompt, params)
        if chat:
            yield chunk({"role": "assistant", "content": ""})
        try:
            async for delta in stream:
                yield chunk({"content": delta} if chat else delta)
        except Exception as exc:  # noqa: BLE001 - the error event, then the stream ends
            err = _from_engine_error(exc, rid) if isinstance(exc, EnsembleError) else internal_error(rid, exc)
            srv.requests.labels(endpoint, str(err.status)).inc()
            yield "data: " + json.dumps(err.body()) + "\n\n"
            return
        result = stream.result
        if chat and result.tool_calls:
            calls = [{"index": i, **c} for i, c in enumerate(_tool_calls(result))]
            yield chunk({"tool_calls": calls})
        yield chunk({} if chat else "", result.finish_reason, ensemble=srv.ensemble_field(result))
        if include_usage:
            yield chunk(None, usage=_usage([result]))
        yield "data: [DONE]\n\n"
        srv.seconds.labels(srv.engine.method_name).observe(time.perf_counter() - t0)
        srv.tokens.inc(result.usage.completion_tokens)
        srv.requests.labels(endpoint, "200").inc()
    finally:
        slot.release()


class _HostCheck:
    """Starlette's `TrustedHostMiddleware` (its Host parsing and name patterns), answering a Host
    outside `allowed` with 421 Misdirected Request and an OpenAI-shaped body instead of its plain
    400. A page on another site that rebinds its DNS name to this machine sends its own name as
    Host, so it is refused here. /health answers any Host (probes address a pod by its IP)."""

    def __init__(self, app, allowed: list[str]) -> None:
        self.app, self.allowed = app, allowed

    async def __call__(self, scope, receive, send) -> None:
        from starlette.middleware.trustedhost import TrustedHostMiddleware

        if scope["type"] not in ("http", "websocket") or scope.get("path") == "/health":
            await self.app(scope, receive, send)
            return

        async def allowed(scope_, receive_, _send) -> None:  # the check let it through: the app answers
            await self.app(scope_, receive_, send)

        async def misdirected(message) -> None:  # the check refused it (its only reply): 421 instead
            if message["type"] == "http.response.start":
                host = dict(scope.get("headers") or []).get(b"host", b"").decode("latin-1")
                err = ApiError(
                    421,
                    f"this server does not answer for the Host {host!r:.100}; start it with --allowed-host NAME "
                    f"for each name its clients use (allowed now: {', '.join(self.allowed)})",
                    code="misdirected_request",
                )
                await JSONResponse(err.body(), status_code=421)(scope, receive, send)

        check = TrustedHostMiddleware(allowed, allowed_hosts=self.allowed, www_redirect=False)
        await check(scope, receive, misdirected)


def allowed_hosts(host: str, extra: list[str] | tuple[str, ...] = ()) -> list[str]:
    """The Host names a server bound to `host` answers for: loopback names, the bound address
    (not a wildcard such as 0.0.0.0, which no client sends) and `extra` (`--allowed-host`)."""
    names = list(LOOPBACK_HOSTS)
    if host not in ("0.0.0.0", "::", ""):
        names.append(f"[{host}]" if ":" in host and not host.startswith("[") else host)
    return list(dict.fromkeys(n.lower() for n in [*names, *extra]))


def create_app(
    engine: Ensemble,
    *,
    api_key: str | None = None,
    max_queue: int = 64,
    limits: Limits | None = None,
    hosts: list[str] | None = None,
    cors_origins: list[str] | tuple[str, ...] = (),
    docs: bool = False,
):
    """The FastAPI app serving `engine` (see the module doc). `hosts`: the Host names it answers
    (default: `allowed_hosts("127.0.0.1")`); `cors_origins`: browser origins allowed to call it
    (none by default: CORS stays closed); `docs`: serve /docs, /redoc and /openapi.json."""
    from fastapi import FastAPI, Request
    from starlette.middleware.cors import CORSMiddleware

    srv = Server(engine, api_key=api_key, max_queue=max_queue, limits=limits)
    paths = {"docs_url": "/docs", "redoc_url": "/redoc", "openapi_url": "/openapi.json"} if docs else {}
    app = FastAPI(
        title="ensemble-llm", version="1", **{"docs_url": None, "redoc_url": None, "openapi_url": None, **paths}
    )
    app.state.server = srv
    if cors_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(cors_origins),
            allow_methods=["GET", "POST"],
            allow_headers=["authorization", "content-type"],
        )
    app.add_middleware(_HostCheck, allowed=hosts or allowed_hosts("127.0.0.1"))

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError):
        srv.requests.labels(request.url.path, str(exc.status)).inc()
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception):  # a bug of ours: the client sees no detail
        err = internal_error(getattr(request.state, "rid", None) or "req-" + uuid.uuid4().hex[:24], exc)
        return await api_error(request, err)

    _routes(app, srv)
    return app


def _routes(app, srv: Server) -> None:
    """The endpoints (see the module doc)."""
    from fastapi import Request
    from fastapi.responses import PlainTextResponse
    from prometheus_client import generate_latest

    @app.get("/health")
    async def health(request: Request):
        if srv.api_key is None or not _key_ok(srv, request):  # figures only for a caller with the key
            return {"status": "ok"}
        return {"status": "ok", "model": srv.model_id, "queue": srv.in_flight}

    @app.get("/v1/models")
    async def models(request: Request):
        _check_key(srv, request)
        return {
            "object": "list",
            "data": [{"id": srv.model_id, "object": "model", "created": 0, "owned_by": "ensemble-llm"}],
        }

    @app.get("/metrics")
    async def metrics(request: Request):
        _check_key(srv, request)
        srv.kv_figures()
        return PlainTextResponse(generate_latest(srv.registry).decode(), media_type="text/plain; version=0.0.4")

    @app.get("/tokenizer_info")
    async def tokenizer_info(request: Request):
        _check_key(srv, request)
        return serve_tokenizer.tokenizer_info(srv.engine)

    @app.post("/tokenize")
    async def tokenize(request: Request):
        return await _tokenizer_call(srv, request, serve_tokenizer.tokenize)

    @app.post("/detokenize")
    async def detokenize(request: Request):
        return await _tokenizer_call(srv, request, serve_tokenizer.detokenize)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _handle(srv, request, "/v1/chat/completions", chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _handle(srv, request, "/v1/completions", chat=False)


async def _tokenizer_call(srv: Server, request, call: Callable[[Any, dict], dict]) -> dict:
    """/tokenize or /detokenize: the body read and answered in the checks' threads."""
    _check_key(srv, request)
    raw = await _body_bytes(request, srv.limits.body_bytes)

    def answer() -> dict:
        try:
            data = json.loads(raw)
        except (ValueError, RecursionError):
            raise ApiError(400, "the request body is not JSON") from None
        if not isinstance(data, dict):
            raise ApiError(400, "the request body must be a JSON object")
        try:
            return call(srv.engine, data)
        except RequestError as exc:
            raise _from_engine_error(exc, "") from None

    return await srv.checked(answer)


def serve(
    members: list | None,
    method: str | None,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    max_queue: int = 64,
    limits: Limits | None = None,
    allowed: list[str] | tuple[str, ...] = (),
    cors_origins: list[str] | tuple[str, ...] = (),
    docs: bool = False,
    device: str = "auto",
    config: Any = None,
    placement: str = "local",
    ray_address: str | None = None,
    member_resources: Any = None,
    max_batch: int | str = "auto",
    kv_budget: Any = "auto",
) -> None:
    """Load the ensemble (members in this process, or each in a Ray actor with placement="ray"),
    then serve it until interrupted. `allowed`: Host names answered besides the loopback names and
    `host` (see `allowed_hosts`)."""
    import uvicorn

    _log_to_stderr()
    hosts = allowed_hosts(host, list(allowed))
    if host in ("0.0.0.0", "::") and not allowed:
        log.warning(
            "serving on every interface, but only these Host names are answered: %s; pass --allowed-host "
            "NAME for each name (or address) clients use",
            ", ".join(hosts),
        )
    if api_key is None and host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("serving on %s without an API key: anyone who reaches it can use it (set %s)", host, API_KEY_ENV)
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
    app = create_app(
        engine, api_key=api_key, max_queue=max_queue, limits=limits, hosts=hosts, cors_origins=cors_origins, docs=docs
    )
    uvicorn.run(app, host=host, port=port, log_level="warning")


def _log_to_stderr() -> None:
    """The server's own log lines (a request's failure under its id) on stderr, beside uvicorn's."""
    logger = logging.getLogger("ensemble_llm")
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.WARNING)
