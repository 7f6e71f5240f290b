"""The engine's worker: threads that run queued requests, up to `max_batch` at once (in order of
arrival), each request on its own KV caches, so concurrent callers (threads or asyncio tasks)
never corrupt a cache or interleave output; their member forwards share batched steps. A
request's internal fault (GenerationError) is retried up to `max_retries` times under the same
deadline, unless a stream already showed text; every failure reaches its caller through the sink
and the worker lives on."""

from __future__ import annotations

import queue
import threading
import time
from typing import Callable

from .errors import EnsembleError, GenerationError, RequestCancelled
from .members.context import RequestContext, request_scope
from .members.scheduler import StepScheduler
from .requests import Job
from .results import GenerationResult
from .streams import Sink

Execute = Callable[[Job, Callable[[str], None], threading.Event], GenerationResult]


class Worker:
    """Runs `execute(job, emit, cancel)` for each submitted job, up to `max_batch` jobs at once,
    each on a thread of its own (their member forwards, extends and prompts, are batched into
    shared steps by the engine's `scheduler`: members/scheduler.py); `load()` runs first (outside
    the forward guard, so a short timeout cannot cut loading off midway)."""

    def __init__(
        self, execute: Execute, load: Callable[[], object], max_batch: int = 1, scheduler: StepScheduler | None = None
    ) -> None:
        self._execute, self._load, self.max_batch = execute, load, max_batch
        self.scheduler = scheduler or StepScheduler()
        self._jobs: "queue.Queue" = queue.Queue()
        self._threads: list[threading.Thread] = []
        self._open = 0  # jobs submitted and not finished (counted at submit: a job a thread has just
        # taken from the queue is neither queued nor busy yet, and counting those two let a burst
        # of requests get fewer threads than requests: the last ones waited for a thread to finish)
        self._lock = threading.Lock()

    def submit(self, job: Job, sink: Sink, cancel: threading.Event) -> None:
        with self._lock:
            self._threads = [t for t in self._threads if t.is_alive()]  # live threads only
            self._open += 1
            if len(self._threads) < min(self.max_batch, self._open):
                thread = threading.Thread(target=self._work, name="ensemble-llm-worker", daemon=True)
                self._threads.append(thread)
                thread.start()
        self._jobs.put((job, sink, cancel))

    def stop(self) -> None:
        """The idle threads end (the engine's close: no thread outlives its use); a busy one ends
        after its job. A later job starts threads again."""
        with self._lock:
            live, self._threads = [t for t in self._threads if t.is_alive()], []
        for _ in live:
            self._jobs.put(None)

    def _work(self) -> None:
        while (item := self._jobs.get()) is not None:
            job, sink, cancel = item
            item = None
            try:
                if cancel.is_set():
                    continue
                try:
                    sink("done", self.attempts(job, sink, cancel))
                except EnsembleError as exc:
                    sink("error", exc)
                except BaseException as exc:  # SystemExit, KeyboardInterrupt: the caller hears of it, the thread ends
                    with self._lock:  # no longer counted: the next job gets a new thread
                        if threading.current_thread() in self._threads:  # (stop() may have let it go)
                            self._threads.remove(threading.current_thread())
                    sink("error", GenerationError(f"generation stopped: {type(exc).__name__}: {exc}"))
                    raise
            finally:
                job = sink = cancel = None  # an idle thread keeps no request (nor its members) alive
                with self._lock:
                    self._open -= 1

    def wait_idle(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds until no job is open (close(): the threads let go of the members)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if self._open == 0:
                    return True
            time.sleep(0.005)
        return False

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
                # cannot cut them off midway and make every request redo them
                ctx = RequestContext(check=guard, scheduler=self.scheduler, deadline=job.deadline())
                with self.scheduler.request(ctx), request_scope(ctx):
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
