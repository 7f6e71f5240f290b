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

Where each concern lives: this module holds the app, its routes, the queue (`Server`) and the
replies; serve_requests.py the bodies, their limits and checks and the errors (`ApiError`);
serve_http.py the API key, the body read under its size limit and the Host check; serve_stream.py
the engine's stream consumed (whole, or as server-sent events); serve_scoring.py the
log-probabilities; serve_tokenizer.py the tokenizer endpoints.

Needs the `serve` extra: pip install "ensemble-llm[serve]".
"""

import asyncio
import dataclasses
import json
import logging
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence

from starlette.responses import JSONResponse

from . import serve_tokenizer
from .engine import Ensemble
from .errors import EnsembleError, RequestError
from .params import GenerationParams
from .results import GenerationResult
from .serve_http import API_KEY_ENV, HostCheck, allowed_hosts, body_bytes, check_key, key_ok
from .serve_requests import MODEL_ALIASES, ApiError, Limits, checked_request, from_engine_error, internal_error
from .serve_scoring import Wants, echoed, prompt_only, reply_in_scoring, scored
from .serve_stream import Reply, SlotStream, run, sse, tool_calls, usage

log = logging.getLogger("ensemble_llm.serve")


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


def _reply(srv: Server, answers: list[tuple], rid: str, created: int, chat: bool, echo: bool) -> dict:
    """A non-streamed reply in OpenAI's shape, one choice per prompt (each answer: the result, its
    logprobs and the prompt echoed before a completion's text), with the ensemble's figures."""
    choices = []
    for i, (result, logprobs, shown) in enumerate(answers):
        if chat:
            content = result.text if (result.text or not result.tool_calls) else None
            message = {"role": "assistant", "content": content}
            if result.tool_calls:
                message["tool_calls"] = tool_calls(result)
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
        "usage": usage(results),
        "ensemble": srv.ensemble_field(results[0]) if len(results) == 1 else [srv.ensemble_field(r) for r in results],
    }


async def _handle(srv: Server, request, endpoint: str, chat: bool):
    """One completion request: read, checked off the loop, admitted to the queue, run (or
    streamed) and answered; its queue slot is given back on every path."""
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
    request.state.rid = rid
    check_key(srv, request)
    raw = await body_bytes(request, srv.limits.body_bytes)
    body, prompts, params, want = await srv.checked(lambda: checked_request(srv, raw, chat))
    slot = srv.admit()
    created = int(time.time())
    try:
        if body.stream:
            include_usage = bool((body.stream_options or {}).get("include_usage"))
            events = sse(srv, prompts[0][0], params, Reply(rid, created, endpoint, chat), include_usage, slot)
            return SlotStream(events, slot)
        t0 = time.perf_counter()
        try:
            answers = await _answers(srv, request, prompts, params, want, chat)
        except EnsembleError as exc:
            raise from_engine_error(exc, rid) from None
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
    return await run(srv.engine, request, text, params) if want.generate else prompt_only(srv.engine, text)


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
    app.add_middleware(HostCheck, allowed=hosts or allowed_hosts("127.0.0.1"))

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
        if srv.api_key is None or not key_ok(srv, request):  # figures only for a caller with the key
            return {"status": "ok"}
        return {"status": "ok", "model": srv.model_id, "queue": srv.in_flight}

    @app.get("/v1/models")
    async def models(request: Request):
        check_key(srv, request)
        return {
            "object": "list",
            "data": [{"id": srv.model_id, "object": "model", "created": 0, "owned_by": "ensemble-llm"}],
        }

    @app.get("/metrics")
    async def metrics(request: Request):
        check_key(srv, request)
        srv.kv_figures()
        return PlainTextResponse(generate_latest(srv.registry).decode(), media_type="text/plain; version=0.0.4")

    @app.get("/tokenizer_info")
    async def tokenizer_info(request: Request):
        check_key(srv, request)
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
    check_key(srv, request)
    raw = await body_bytes(request, srv.limits.body_bytes)

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
            raise from_engine_error(exc, "") from None

    return await srv.checked(answer)


def serve(
    engine: Ensemble, *, host: str = "127.0.0.1", port: int = 8000, allowed: Sequence[str] = (), **app: Any
) -> None:
    """Load `engine` (members in this process, or each in a Ray actor with placement="ray"), then
    serve it until interrupted. `allowed`: Host names answered besides the loopback names and
    `host` (see `allowed_hosts`); `app`: `create_app`'s settings (api_key, max_queue, limits,
    cors_origins, docs)."""
    import uvicorn

    _log_to_stderr()
    hosts = allowed_hosts(host, list(allowed))
    if host in ("0.0.0.0", "::") and not allowed:
        log.warning(
            "serving on every interface, but only these Host names are answered: %s; pass --allowed-host "
            "NAME for each name (or address) clients use",
            ", ".join(hosts),
        )
    if app.get("api_key") is None and host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("serving on %s without an API key: anyone who reaches it can use it (set %s)", host, API_KEY_ENV)
    uvicorn.run(create_app(engine.load(), hosts=hosts, **app), host=host, port=port, log_level="warning")


def _log_to_stderr() -> None:
    """The server's own log lines (a request's failure under its id) on stderr, beside uvicorn's."""
    logger = logging.getLogger("ensemble_llm")
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.WARNING)
