"""How a request's text reaches its caller: the worker sends ("delta", text), then ("done",
result) or ("error", exception) through a sink; `TextStream` reads them, from a `queue.Queue`
with `for` (sync callers) or from an `asyncio.Queue` with `async for` (never blocking the event
loop). A caller that stops reading before the end cancels the request."""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Iterator

Sink = Callable[[str, Any], None]


class TextStream:
    """Text deltas as the engine decides them; `.result` (a GenerationResult) is set at the end.
    One class for both kinds of caller: iterate it with `for` when it reads a `queue.Queue`
    (`stream`), with `async for` when it reads an `asyncio.Queue` (`astream`)."""

    def __init__(self, items: "queue.Queue | asyncio.Queue", cancel: threading.Event) -> None:
        self._items = items
        self._cancel = cancel
        self.result: Any = None

    def _take(self, kind: str, payload: Any) -> bool:
        """Whether the item is a delta to yield; the end sets `result`, an error is raised."""
        if kind == "delta":
            return True
        if kind == "done":
            self.result = payload
            return False
        raise payload

    def __iter__(self) -> Iterator[str]:
        try:
            while True:
                kind, payload = self._items.get()
                if not self._take(kind, payload):
                    return
                yield payload
        finally:
            if self.result is None:
                self._cancel.set()

    async def __aiter__(self) -> AsyncIterator[str]:
        try:
            while True:
                kind, payload = await self._items.get()
                if not self._take(kind, payload):
                    return
                yield payload
        finally:
            if self.result is None:
                self._cancel.set()


AsyncTextStream = TextStream  # the name `astream` returns (the same class, over an asyncio.Queue)


def sync_channel() -> tuple[Sink, threading.Event, TextStream]:
    """(sink for the worker, cancel flag, the caller's stream) over a thread-safe queue."""
    items: "queue.Queue" = queue.Queue()
    cancel = threading.Event()
    return (lambda kind, payload: items.put((kind, payload))), cancel, TextStream(items, cancel)


def async_channel() -> tuple[Sink, threading.Event, TextStream]:
    """The same for the running event loop: the worker thread hands items to the loop."""
    loop = asyncio.get_running_loop()
    items: "asyncio.Queue" = asyncio.Queue()
    cancel = threading.Event()

    def sink(kind: str, payload: Any) -> None:
        try:
            loop.call_soon_threadsafe(items.put_nowait, (kind, payload))
        except RuntimeError:  # the caller's loop is gone: nobody is listening any more
            cancel.set()

    return sink, cancel, TextStream(items, cancel)


@dataclass
class Output:
    """What goes to the caller during a run: text deltas, and when the first one left."""

    emit: Callable[[str], None]
    t0: float
    first: float | None = None

    def send(self, text: str) -> None:
        if text:
            if self.first is None:
                self.first = time.perf_counter() - self.t0
            self.emit(text)
