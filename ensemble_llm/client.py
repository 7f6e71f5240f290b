"""`RemoteEnsemble`: a served ensemble (`ensemble-llm serve`) behind the engine's own interface.

generate / stream / agenerate / astream take the same prompt and `GenerationParams` as
`Ensemble` and return the same `GenerationResult` and text streams, so both framework facades
use it unchanged when given `base_url=`. HTTP goes through the official `openai` client (its
transport retries are `max_retries`); the server's OpenAI-shaped errors come back as the
engine's own error classes (400 -> RequestError, 504 -> RequestTimeout, other failures ->
GenerationError).
"""

from __future__ import annotations

import json
from typing import Any, AsyncIterator, Iterator

from .errors import ConfigError, GenerationError, RequestError, RequestTimeout
from .params import FIELDS, GenerationParams
from .results import GenerationResult, ToolCall, Usage


def _openai():
    try:
        import openai
    except ImportError as exc:
        raise ConfigError("client mode (base_url=...) needs the openai package: pip install openai") from exc
    return openai


def _messages(prompt: Any) -> list[dict]:
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    out = []
    for m in prompt:
        m = dict(m)
        if m.get("tool_calls"):
            m["tool_calls"] = [
                {
                    **c,
                    "function": {
                        **c["function"],
                        "arguments": c["function"]["arguments"]
                        if isinstance(c["function"].get("arguments"), str)
                        else json.dumps(c["function"].get("arguments") or {}, ensure_ascii=False),
                    },
                }
                for c in m["tool_calls"]
            ]
        out.append(m)
    return out


def _body(prompt: Any, params: GenerationParams) -> dict[str, Any]:
    body: dict[str, Any] = {
        "max_tokens": params.max_new_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
    }
    if params.seed is not None:
        body["seed"] = params.seed
    if params.stop:
        body["stop"] = list(params.stop)
    extra: dict[str, Any] = {}
    if params.timeout is not None:
        extra["timeout"] = params.timeout  # the server's deadline (its 504), besides the HTTP timeout
    if params.raw:
        body["prompt"] = prompt
    else:
        body["messages"] = _messages(prompt)
        if params.tools:
            body["tools"] = list(params.tools)
            body["tool_choice"] = (
                params.tool_choice
                if params.tool_choice in ("auto", "none", "required")
                else {"type": "function", "function": {"name": params.tool_choice}}
            )
        rf = params.response_format
        if rf is not None:
            if rf.kind == "json_schema":
                body["response_format"] = {
                    "type": "json_schema",
                    "json_schema": {"name": "response", "schema": json.loads(rf.source)},
                }
            elif rf.kind == "json_object":
                body["response_format"] = {"type": "json_object"}
            else:
                raise RequestError(
                    f"a {rf.kind} constraint cannot travel over the OpenAI API; use a JSON Schema "
                    "or run the ensemble in process"
                )
    if extra:
        body["extra_body"] = extra
    return body


def _error(exc: Exception) -> Exception:
    openai = _openai()
    if isinstance(exc, openai.APIStatusError):
        body = exc.body if isinstance(exc.body, dict) else {}
        message = (body.get("error") or body).get("message") if isinstance(body.get("error", body), dict) else None
        message = message or str(exc)
        if exc.status_code == 400:
            return RequestError(message)
        if exc.status_code == 504:
            return RequestTimeout(message)
        return GenerationError(f"the server answered {exc.status_code}: {message}")
    if isinstance(exc, openai.APITimeoutError):
        return RequestTimeout(f"the server did not answer in time: {exc}")
    return GenerationError(f"the server could not be reached: {exc}")


def _result(
    message_text: str | None, tool_calls: list, finish: str, usage: Any, extra: dict | None
) -> GenerationResult:
    calls = []
    for c in tool_calls or []:
        fn = c["function"] if isinstance(c, dict) else c.function
        name = fn["name"] if isinstance(fn, dict) else fn.name
        args = fn["arguments"] if isinstance(fn, dict) else fn.arguments
        calls.append(ToolCall(name, json.loads(args or "{}"), c["id"] if isinstance(c, dict) else c.id))
    extra = extra or {}
    details = getattr(usage, "prompt_tokens_details", None)  # cached prompt tokens (the server's prefix reuse)
    cached = int(getattr(details, "cached_tokens", None) or 0)
    u = Usage(usage.prompt_tokens, usage.completion_tokens, cached) if usage is not None else Usage(0, 0)
    text = message_text or ""
    return GenerationResult(
        text,
        finish or "stop",
        u,
        dict(extra.get("stats") or {}),
        extra.get("method", ""),
        list(extra.get("members") or []),
        calls,
        text,
    )


class _Stream:
    """A TextStream over the server's events: iterate for text deltas; `.result` at the end."""

    def __init__(self, events) -> None:
        self._events = events
        self.result: GenerationResult | None = None

    def _fold(self, state: dict, chunk: Any) -> str:
        extra = getattr(chunk, "model_extra", None) or {}
        if extra.get("ensemble"):
            state["extra"] = extra["ensemble"]
        if getattr(chunk, "usage", None) is not None:
            state["usage"] = chunk.usage
        delta_text = ""
        for choice in chunk.choices or []:
            if choice.finish_reason:
                state["finish"] = choice.finish_reason
            delta = getattr(choice, "delta", None)
            if delta is None:  # completions
                delta_text += choice.text or ""
                continue
            delta_text += delta.content or ""
            for tc in delta.tool_calls or []:
                slot = state["calls"].setdefault(tc.index, {"id": None, "function": {"name": "", "arguments": ""}})
                slot["id"] = tc.id or slot["id"]
                if tc.function is not None:
                    slot["function"]["name"] += tc.function.name or ""
                    slot["function"]["arguments"] += tc.function.arguments or ""
        state["text"] += delta_text
        return delta_text

    def _finish(self, state: dict) -> None:
        self.result = _result(
            state["text"], list(state["calls"].values()), state["finish"], state["usage"], state["extra"]
        )

    def close(self) -> None:
        """Close the HTTP response: the server sees the disconnect and stops generating."""
        self._events.close()

    def __iter__(self) -> Iterator[str]:
        state = {"text": "", "calls": {}, "finish": None, "usage": None, "extra": None}
        try:
            for chunk in self._events:
                delta = self._fold(state, chunk)
                if delta:
                    yield delta
        except Exception as exc:  # noqa: BLE001 - the engine's error classes
            raise _error(exc) from exc
        finally:  # also when the caller abandons the stream (its loop breaks, the generator is closed)
            self._events.close()
        self._finish(state)

    async def __aiter__(self) -> AsyncIterator[str]:
        state = {"text": "", "calls": {}, "finish": None, "usage": None, "extra": None}
        try:
            async for chunk in self._events:
                delta = self._fold(state, chunk)
                if delta:
                    yield delta
        except Exception as exc:  # noqa: BLE001
            raise _error(exc) from exc
        finally:
            await self._events.close()
        self._finish(state)


class RemoteEnsemble:
    """An `Ensemble` served elsewhere (see the module doc)."""

    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        *,
        max_retries: int = 2,
        timeout: float | None = None,
        model: str = "ensemble",
    ) -> None:
        if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
            raise ConfigError(f"base_url must be an http(s) URL like 'http://127.0.0.1:8000/v1', got {base_url!r}")
        self.base_url, self.api_key = base_url.rstrip("/"), api_key
        if not isinstance(model, str) or not model:
            raise ConfigError(f"model must be the served model's name (e.g. 'ensemble'), got {model!r}")
        self.max_retries, self.timeout, self.model = max_retries, timeout, model
        self._sync = self._async = None
        self.method_name, self.model_names = "remote", []

    def __repr__(self) -> str:
        return f"RemoteEnsemble({self.base_url!r})"

    def _client(self, asynchronous: bool = False):
        openai = _openai()
        kw = dict(base_url=self.base_url, api_key=self.api_key or "none", max_retries=self.max_retries)
        if self.timeout is not None:
            kw["timeout"] = self.timeout
        if asynchronous:
            self._async = self._async or openai.AsyncOpenAI(**kw)
            return self._async
        self._sync = self._sync or openai.OpenAI(**kw)
        return self._sync

    @staticmethod
    def _params(params: GenerationParams | None, settings: dict[str, Any]) -> GenerationParams:
        unknown = sorted(set(settings) - set(FIELDS))
        if unknown:
            raise TypeError(f"unexpected keyword argument(s) {unknown}; the settings are {list(FIELDS)}")
        params = params or GenerationParams()
        return params.replace(**settings) if settings else params

    def _create(self, client, prompt: Any, params: GenerationParams, stream: bool):
        body = _body(prompt, params)
        if stream:
            body["stream"] = True
            if not params.raw:
                body["stream_options"] = {"include_usage": True}
        api = client.completions if params.raw else client.chat.completions
        return api.create(model=self.model, **body)

    def _from_response(self, res: Any) -> GenerationResult:
        extra = (res.model_extra or {}).get("ensemble")
        choice = res.choices[0]
        if hasattr(choice, "message"):
            return _result(choice.message.content, choice.message.tool_calls, choice.finish_reason, res.usage, extra)
        return _result(choice.text, [], choice.finish_reason, res.usage, extra)

    def generate(self, prompt: Any, params: GenerationParams | None = None, **settings: Any) -> GenerationResult:
        params = self._params(params, settings)
        try:
            return self._from_response(self._create(self._client(), prompt, params, stream=False))
        except (RequestError, ConfigError):
            raise
        except Exception as exc:  # noqa: BLE001
            raise _error(exc) from exc

    def stream(self, prompt: Any, params: GenerationParams | None = None, **settings: Any) -> _Stream:
        params = self._params(params, settings)
        try:
            return _Stream(self._create(self._client(), prompt, params, stream=True))
        except Exception as exc:  # noqa: BLE001
            raise _error(exc) from exc

    async def agenerate(self, prompt: Any, params: GenerationParams | None = None, **settings: Any) -> GenerationResult:
        params = self._params(params, settings)
        try:
            return self._from_response(await self._create(self._client(True), prompt, params, stream=False))
        except Exception as exc:  # noqa: BLE001
            raise _error(exc) from exc

    def astream(self, prompt: Any, params: GenerationParams | None = None, **settings: Any) -> "_AsyncStream":
        return _AsyncStream(self, prompt, self._params(params, settings))


class _AsyncStream:
    """`async for delta in remote.astream(...)`; `.result` at the end (the request starts on iteration)."""

    def __init__(self, remote: RemoteEnsemble, prompt: Any, params: GenerationParams) -> None:
        self._remote, self._prompt, self._params = remote, prompt, params
        self.result: GenerationResult | None = None

    async def __aiter__(self) -> AsyncIterator[str]:
        try:
            events = await self._remote._create(self._remote._client(True), self._prompt, self._params, stream=True)
        except Exception as exc:  # noqa: BLE001
            raise _error(exc) from exc
        inner = _Stream(events)
        try:
            async for delta in inner:
                yield delta
        finally:  # an abandoned stream closes its response (see _Stream)
            await events.close()
        self.result = inner.result
