"""The request a thread (or asyncio task) is working for: one object in a context variable.

A request carries three things every forward pass must see: its guard (the deadline and
cancellation check, run before each forward, so a request stops within one forward of its
timeout or of its caller going away), its tally (the forwards run for it, its stats) and the
engine's step scheduler its calls join (members/scheduler.py). They used to live in
thread-locals that every helper thread reinstalled by hand; a context variable follows the
request into `asyncio.to_thread` by itself, and into a thread of its own through `run_in`.
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass, field, replace
from typing import Any, Callable, ContextManager, Protocol, Sequence


class Steps(Protocol):
    """What a request's calls ask of the engine's step scheduler (members/scheduler.py's
    `StepScheduler`), named here so that this module, which the scheduler imports, needs none."""

    config: Any

    def joined(self, ctx: RequestContext) -> bool: ...
    def batching(self, ctx: RequestContext) -> bool: ...
    def wait(self, call: Any) -> Any: ...
    def own_forward(self, ctx: RequestContext) -> ContextManager[None]: ...
    def request(self, ctx: RequestContext | None) -> ContextManager[None]: ...


@dataclass
class Tally:
    """One request's forward passes, seconds in them and prefills, per member (its stats)."""

    counts: dict[int, list] = field(default_factory=dict)
    remote: dict[int, Any] = field(default_factory=dict)  # per member in a Ray actor: its own count (ray/member.py)
    reused: dict[int, int] = field(default_factory=dict)  # per member: prompt tokens taken from a stored prompt

    def add(self, member: Any, n: int = 1, seconds: float = 0.0, prefills: int = 0) -> None:
        c = self.counts.setdefault(id(member), [0, 0.0, 0])
        c[0] += n
        c[1] += seconds
        c[2] += prefills

    def of(self, member: Any) -> tuple[int, float, int]:
        n, t, p = self.counts.get(id(member), (0, 0.0, 0))
        return n, t, p


@dataclass(eq=False)
class RequestContext:
    """What a request's forwards need (see the module). `part`: a thread running part of a request
    (specfuse's parallel drafts): the steps wait for it as for a request, but a lone request with
    its parts does not batch."""

    check: Callable[[], None] | None = None
    tally: Tally = field(default_factory=Tally)
    scheduler: Steps | None = None
    part: bool = False
    # per member: the prompt state score_prompt prefilled, for the prefill that follows (its prompt runs once)
    ready: dict[int, Any] = field(default_factory=dict)
    deadline: float | None = None  # time.perf_counter() by which the request must end (a server member's waits)

    def run_check(self) -> None:
        if self.check is not None:
            self.check()

    def for_part(self) -> "RequestContext":
        """The context of a thread that runs part of this request (same guard, tally, scheduler)."""
        return replace(self, part=True)


_CURRENT: contextvars.ContextVar[RequestContext | None] = contextvars.ContextVar("ensemble_llm_request", default=None)


def current_request() -> RequestContext | None:
    """The request the caller works for (None outside one)."""
    return _CURRENT.get()


@contextlib.contextmanager
def request_scope(ctx: RequestContext | None):
    """The block runs for `ctx` (None: for no request)."""
    token = _CURRENT.set(ctx)
    try:
        yield ctx
    finally:
        _CURRENT.reset(token)


def check_request() -> None:
    """Run the current request's guard (deadline, cancellation), if there is one."""
    ctx = _CURRENT.get()
    if ctx is not None:
        ctx.run_check()


def current_check() -> Callable[[], None] | None:
    """The current request's guard (None outside a request): for code that waits and must stop
    when the request does (a Ray actor's answer, the KV budget)."""
    ctx = _CURRENT.get()
    return None if ctx is None else ctx.check


def current_deadline() -> float | None:
    """When the current request must end (time.perf_counter()), or None."""
    ctx = _CURRENT.get()
    return None if ctx is None else ctx.deadline


def current_tally() -> Tally | None:
    ctx = _CURRENT.get()
    return None if ctx is None else ctx.tally


class Counted:
    """A member's forward passes, seconds in them and prefills: its totals, and each request's in
    the request's tally (`counters` answers for the calling request inside one)."""

    n_forward = 0
    n_prefill = 0  # forwards that started a fresh cache from a prompt (counted in n_forward too)
    forward_time = 0.0

    def counters(self) -> tuple[int, float, int, int, int]:
        """(forward passes, seconds in them, prefills, bytes moved to and from another process and
        waits for its answers: 0 and 0 here): those of the calling thread's request inside one (a
        batched step counts once for each request in it), else the member's totals."""
        tally = current_tally()
        if tally is not None:
            return (*tally.of(self), 0, 0)
        return self.n_forward, self.forward_time, self.n_prefill, 0, 0

    def prompt_reused(self) -> int | None:
        """Prompt tokens the calling thread's request took from stored prompts (0 outside one)."""
        tally = current_tally()
        return 0 if tally is None else tally.reused.get(id(self), 0)

    def count_prefill(self) -> None:
        """A forward that starts a fresh cache from a prompt, for the calling request."""
        self.n_prefill += 1
        tally = current_tally()
        if tally is not None:
            tally.add(self, 0, 0.0, 1)

    def count_forward(self, tallies: Sequence[Tally | None], seconds: float) -> None:
        """One forward (a step's, for every request in it): the member's totals, and once for each
        request that took part (`tallies`: its calls' requests, None for none)."""
        self.n_forward += 1
        self.forward_time += seconds
        for tally in {id(t): t for t in tallies if t is not None}.values():
            tally.add(self, 1, seconds)
