"""How `serve` (serve.py) consumes the engine's stream of a request: whole (`run`, for a
non-streamed reply) or as server-sent events in OpenAI's chunk format (`sse`), either one cancelled
when the client goes away, and the response that gives the request's queue slot back however the
stream ends (`SlotStream`). The reply pieces both the streamed and the whole reply carry
(`tool_calls`, `usage`) live here, so serve.py's `_reply` and the stream share them without an
import circle."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, AsyncIterator, Protocol

from starlette.responses import StreamingResponse

from .errors import EnsembleError
from .params import GenerationParams
from .results import GenerationResult, Usage
from .serve_requests import ApiError, Served, from_engine_error, internal_error

if TYPE_CHECKING:
    from .engine import Ensemble


async def run(engine: Ensemble, request, prompt: Any, params: GenerationParams) -> GenerationResult:
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


def tool_calls(result: GenerationResult) -> list[dict]:
    return [
        {
            "id": c.id,
            "type": "function",
            "function": {"name": c.name, "arguments": json.dumps(c.arguments, ensure_ascii=False)},
        }
        for c in result.tool_calls
    ]


def usage(results: list[GenerationResult]) -> dict:
    """The usage of a reply, summed over its prompts."""
    us = [r.usage for r in results]
    total = Usage(
        sum(u.prompt_tokens for u in us), sum(u.completion_tokens for u in us), sum(u.cached_tokens for u in us)
    )
    return total.to_dict()


class Slot(Protocol):
    """A request's place in the queue (serve.py's `_Slot`): given back once, whatever path it takes."""

    def release(self) -> None: ...


class SlotStream(StreamingResponse):
    """Server-sent events that give the queue slot back when the response ends, also when the
    client left before the first event (then the events' generator never starts, nor its finally)."""

    def __init__(self, events: AsyncIterator[str], slot: Slot) -> None:
        super().__init__(events, media_type="text/event-stream")
        self.slot = slot

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.slot.release()


@dataclass(frozen=True)
class Reply:
    """Who a reply answers: its id, its creation time, its endpoint and whether it is a chat one."""

    rid: str
    created: int
    endpoint: str
    chat: bool


async def sse(
    srv: Served, prompt: Any, params: GenerationParams, reply: Reply, include_usage: bool, slot: Slot
) -> AsyncIterator[str]:
    """Server-sent events in OpenAI's chunk format; the generator's cancellation (a client that
    went away) reaches the engine through the stream's cleanup. A failure mid-stream is one
    OpenAI-shaped error event (a fault inside generation: generic, with the request id)."""
    rid, created, chat, endpoint = reply.rid, reply.created, reply.chat, reply.endpoint
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
            err = from_engine_error(exc, rid) if isinstance(exc, EnsembleError) else internal_error(rid, exc)
            srv.requests.labels(endpoint, str(err.status)).inc()
            yield "data: " + json.dumps(err.body()) + "\n\n"
            return
        result = stream.result
        if chat and result.tool_calls:
            calls = [{"index": i, **c} for i, c in enumerate(tool_calls(result))]
            yield chunk({"tool_calls": calls})
        yield chunk({} if chat else "", result.finish_reason, ensemble=srv.ensemble_field(result))
        if include_usage:
            yield chunk(None, usage=usage([result]))
        yield "data: [DONE]\n\n"
        srv.seconds.labels(srv.engine.method_name).observe(time.perf_counter() - t0)
        srv.tokens.inc(result.usage.completion_tokens)
        srv.requests.labels(endpoint, "200").inc()
    finally:
        slot.release()
