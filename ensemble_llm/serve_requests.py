"""What `serve` checks of a request before it may queue (serve.py): the OpenAI bodies it reads
(`ChatBody`, `CompletionBody`, every other field refused by name), their limits (`Limits`), the
messages and settings they become (`chat_messages`, `params_of`), and the OpenAI-shaped errors
(`ApiError`) a refused request or a failed one is answered with. `checked_request` runs all of it,
in the server's checks' threads (serve.py's `Server.checked`)."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from pydantic import BaseModel, ConfigDict, ValidationError

from .errors import EnsembleError, RequestCancelled, RequestError, RequestTimeout
from .params import GenerationParams
from .serve_scoring import Wants, completion_prompts, wants

if TYPE_CHECKING:
    from .engine import Ensemble
    from .results import GenerationResult

log = logging.getLogger("ensemble_llm.serve")  # serve.py's logger: a failure's detail under its request id
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


class Served(Protocol):
    """What the request checks, the key check and the streams read of serve.py's `Server` (which
    imports their modules)."""

    engine: Ensemble
    limits: Limits
    api_key: str | None
    model_id: str
    model_names: set[str]
    requests: Any  # its Prometheus metrics
    tokens: Any
    seconds: Any

    def ensemble_field(self, result: GenerationResult) -> dict: ...


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


def from_engine_error(exc: EnsembleError, rid: str) -> ApiError:
    if isinstance(exc, RequestTimeout):
        return ApiError(504, str(exc), "timeout_error", "timeout", "timeout")
    if isinstance(exc, RequestError):
        return ApiError(400, str(exc), "invalid_request_error", _param_of(str(exc)), exc.code)
    if isinstance(exc, RequestCancelled):
        return ApiError(499, str(exc), "cancelled")
    return internal_error(rid, exc)  # GenerationError and anything else raised inside generation


def chat_messages(raw: list[dict]) -> list[dict]:
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


def params_of(body: _Body, *, raw: bool, generate: bool = True) -> GenerationParams:
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


def _check_model(srv: Served, name: str | None) -> None:
    if name is not None and name not in srv.model_names:
        others = ", ".join(repr(n) for n in sorted(srv.model_names - {srv.model_id}))
        raise ApiError(
            404,
            f"the model {name!r} does not exist here; this server serves {srv.model_id!r} (also named {others})",
            param="model",
            code="model_not_found",
        )


def checked_request(srv: Served, raw: bytes, chat: bool) -> tuple[_Body, list, GenerationParams, Wants]:
    """Everything a request is checked for before it may queue (run in the checks' threads)."""
    body = _parsed(raw, ChatBody if chat else CompletionBody)
    _check_counts(body, srv.limits)
    _check_model(srv, body.model)
    try:
        prompts = [(chat_messages(body.messages), None)] if chat else completion_prompts(srv.engine, body.prompt)
        want = wants(body, chat, _max_tokens(body))
        if len(prompts) > 1 and body.stream:
            raise RequestError("a list of prompts is answered in one reply here; send it with stream: false")
        params = params_of(body, raw=not chat, generate=want.generate)
        for prompt, _ in prompts:
            srv.engine.check_request(prompt, params)
    except RequestError as exc:
        raise from_engine_error(exc, "") from None
    return body, prompts, params, want
