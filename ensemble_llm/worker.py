"""The engine's worker: one thread per engine that owns the models and runs queued requests one
at a time, in order, so concurrent callers (threads or asyncio tasks) never corrupt a KV cache or
interleave output. A request's internal fault (GenerationError) is retried up to `max_retries`
times under the same deadline, unless a stream already showed text; every failure reaches its
caller through the sink and the worker lives on."""

from __future__ import annotations

import queue
import threading
from typing import Callable

from .errors import EnsembleError, GenerationError, RequestCancelled
from .members.member import forward_guard
from .requests import Job
from .results import GenerationResult
from .streams import Sink

Execute = Callable[[Job, Callable[[str], None], threading.Event], GenerationResult]


class Worker:
    """Runs `execute(job, emit, cancel)` for each submitted job on its own thread; `load()` runs
    first (outside the forward guard, so a short timeout cannot cut loading off midway)."""

    def __init__(self, execute: Execute, load: Callable[[], object]) -> None:
        self._execute, self._load = execute, load
        self._jobs: "queue.Queue" = queue.Queue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def submit(self, job: Job, sink: Sink, cancel: threading.Event) -> None:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._work, name="ensemble-llm-worker", daemon=True)
                self._thread.start()
        self._jobs.put((job, sink, cancel))

    def _work(self) -> None:
        while True:
            job, sink, cancel = self._jobs.get()
            if cancel.is_set():
                continue
            try:
                sink("done", self.attempts(job, sink, cancel))
            except EnsembleError as exc:
                sink("error", exc)

    def attempts(self, job: Job, sink: Sink, cancel: threading.Event) -> GenerationResult:
        """Run the request; an internal fault (GenerationError) is retried up to
        `max_retries` times under the same deadline, unless a stream already showed text."""
        sent = [False]

        def emit(delta: str) -> None:
            sent[0] = True
            sink("delta", delta)

        def guard() -> None:  # before every forward pass of this request
            if cancel.is_set():
                raise RequestCancelled("the caller stopped listening; the request was stopped.")
            job.check_deadline()

        retries = job.params.max_retries
        for attempt in range(retries + 1):
            try:
                job.check_deadline()  # it may have expired while waiting in the queue
                self._load()  # loading and calibration run once, outside the guard, so a short timeout
                with forward_guard(guard):  # cannot cut them off midway and make every request redo them
                    result = self._execute(job, emit, cancel)
                if attempt:
                    result.stats["retries"] = attempt
                return result
            except GenerationError as exc:  # a fault inside generation (e.g. a member's Ray actor died)
                if (sent[0] and job.shows_text) or attempt == retries:
                    if attempt:
                        raise GenerationError(f"{exc} (after {attempt} retries)") from exc
                    raise
            except EnsembleError:
                raise
            except Exception as exc:  # noqa: BLE001 - surfaced to the caller, the worker lives on
                err = GenerationError(
                    f"generation failed: {type(exc).__name__}: {exc}"
                    + (f" (after {attempt} retries)" if attempt else "")
                )
                err.__cause__ = exc
                if (sent[0] and job.shows_text) or attempt == retries:
                    raise err from exc
        raise AssertionError("unreachable")
