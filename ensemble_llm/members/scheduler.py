"""The engine's step scheduler: the policy that turns concurrent requests' calls into steps.

The loop is `StepScheduler.wait` -> `_steps_now` (who steps) -> `take` (what runs) -> `step` (run
each group on its executor, then answer the calls), in that order below.

Every request runs its method in a thread of its own and the methods stay as they are: sequential
code asking a member to extend a state. A member turns each such ask into a typed call (steps.py)
and hands it to `run_call`. Outside a request, or while the request runs alone, the call runs at
once in a forward of its own. While other requests run, it waits here for the next step. A step
runs when every running request is waiting in one (iteration-level scheduling, as in Orca; a
request inside a forward of its own, such as the prompt scoring of per-request weights, is not
waited for, and one still doing Python work is waited for up to `gather_s`).

Which calls a step takes (`take`): every group that holds a prompt (new requests start at once), a
member that computes apart (a Ray actor) always, and of the rest the largest group, the others
waiting for later steps (at most `max_defer`) so that the requests fall into phase. A group is
what its member's executor runs in one step (`Executor.group`: transformers, one member and kind;
llama.cpp, every call of one member in one `llama_decode`). The scheduler never touches a
tensor: the executors do (backends/*/, ray/member.py).

A step whose group raises reruns that group's calls one by one, so that one bad call fails only
its own request.

The engine owns one scheduler (two engines in one process share none).
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any

from .context import RequestContext, current_request, request_scope
from .steps import BatchingConfig, StepCall

DEFAULT_CONFIG = BatchingConfig()


def run_call(call: StepCall) -> Any:
    """Run a member's call for the current request (see the module) and return its result."""
    ctx = current_request()
    sched = None if ctx is None else ctx.scheduler
    executor = call.member.executor
    if ctx is not None:
        call.tally = ctx.tally
        ctx.run_check()
    if sched is not None and sched.batching(ctx) and executor.batchable(call):
        call.guard = ctx.check
        return sched.wait(call)
    with outside_steps():
        return executor.run_alone(call, DEFAULT_CONFIG if sched is None else sched.config)


def batched_now(ctx: RequestContext | None) -> bool:
    """Whether request `ctx`'s calls wait for steps now (another request runs beside it)."""
    return ctx is not None and ctx.scheduler is not None and ctx.scheduler.batching(ctx)


@contextlib.contextmanager
def part_of(ctx: RequestContext | None):
    """The block runs part of request `ctx` in a thread of its own (methods/side.py): its calls
    join the steps as the request's would, under the request's deadline and counts."""
    part = None if ctx is None else ctx.for_part()
    sched = None if ctx is None else ctx.scheduler
    with sched.request(part) if sched is not None and sched.joined(ctx) else contextlib.nullcontext():
        with request_scope(part):
            yield


@contextlib.contextmanager
def outside_steps():
    """The block runs a forward (or waits) outside the steps: the steps do not wait for it."""
    ctx = current_request()
    if ctx is None or ctx.scheduler is None:
        yield
        return
    with ctx.scheduler.own_forward(ctx):
        yield


class StepScheduler:
    """Gathers the calls of concurrent requests into steps (see the module)."""

    def __init__(self, config: BatchingConfig | None = None) -> None:
        self.config = config or BatchingConfig()
        self._cond = threading.Condition()
        self._active = 0  # requests and their parts running here (registered by `request`)
        self._requests = 0  # of those, the requests themselves (not their parts)
        self._busy = 0  # of those, inside a forward of their own (a prefill, a scoring): not waited for
        self._joined: set[int] = set()  # id() of the contexts inside `request`
        self._pending: list[StepCall] = []
        self._stepping = False
        self._stepped = 0.0  # when the last step ended: everyone gets a gather period after it
        self.steps = 0  # steps run (figures for benches and tests)

    @property
    def idle(self) -> bool:
        """No request is registered and no call waits."""
        with self._cond:
            return self._active == 0 and not self._pending

    @contextlib.contextmanager
    def request(self, ctx: RequestContext):
        """`ctx` runs one request (or, `ctx.part`, a part of one): its calls may be batched."""
        with self._cond:
            self._active += 1
            self._requests += not ctx.part
            self._joined.add(id(ctx))
        try:
            yield ctx
        finally:
            with self._cond:
                self._joined.discard(id(ctx))
                self._active -= 1
                self._requests -= not ctx.part
                self._cond.notify_all()  # the others may all be waiting now

    @contextlib.contextmanager
    def own_forward(self, ctx: RequestContext):
        """`ctx` runs a forward outside the steps: while it does, the steps do not wait for it."""
        if id(ctx) not in self._joined:
            yield
            return
        with self._cond:
            self._busy += 1
            self._cond.notify_all()  # the others may all be waiting now
        try:
            yield
        finally:
            with self._cond:
                self._busy -= 1

    def joined(self, ctx: RequestContext | None) -> bool:
        return ctx is not None and id(ctx) in self._joined

    def batching(self, ctx: RequestContext | None) -> bool:
        """Whether a call of `ctx` should wait for a step: it runs a request (or a part of one)
        here, and another request runs too."""
        return self.joined(ctx) and self._requests > 1

    # ---- the step loop, top to bottom: wait -> who steps -> take -> step (run, update) --------
    def wait(self, call: StepCall) -> Any:
        """Queue `call` for the next step that takes it; this thread may run that step."""
        with self._cond:
            self._pending.append(call)
            self._cond.notify_all()
            while not call.done:
                self._leave_if_gone(call)
                if self._steps_now(call):
                    self.step()
                else:
                    self._cond.wait(self.config.gather_s)
        if call.error is not None:
            raise call.error
        return call.result

    def _leave_if_gone(self, call: StepCall) -> None:
        """A call no step took yet whose request was cancelled or passed its deadline leaves the
        queue at once (its guard raises here)."""
        if call.guard is None or call not in self._pending:
            return
        try:
            call.guard()
        except BaseException:
            self._pending.remove(call)
            self._cond.notify_all()
            raise

    def _steps_now(self, call: StepCall) -> bool:
        """Who steps: this thread, when no step runs and either every running request waits with a
        call (those inside a forward of their own are not waited for), or this call has waited a
        gather period since it came or since the last step (a request still doing Python work is
        not waited for longer)."""
        if self._stepping:
            return False
        everyone = len(self._pending) >= self._active - self._busy
        late = time.monotonic() - max(call.since, self._stepped) >= self.config.gather_s
        return everyone or late

    def take(self) -> list[list[StepCall]]:
        """The groups the next step runs (see the module). Running every group each step would keep
        requests out of phase for good: in unite, half the requests waiting on one member and half
        on the other make two half-full forwards per step, forever. Passing the smaller group over
        once lets its requests fall in behind the others, and from then on each forward has every
        row. specfuse and safe spend several steps on one member (a draft, a segment): their
        smaller group may wait up to `max_defer` steps for the others to come over."""
        groups: dict[tuple, list[StepCall]] = {}
        for c in self._pending:
            groups.setdefault(c.member.executor.group(c), []).append(c)
        best = max(groups.values(), key=lambda g: (len(g), -min(c.since for c in g)))
        taken = [
            g
            for g in groups.values()
            if g is best
            or any(c.kind == "prefill" for c in g)
            or g[0].member.executor.apart  # its own actor: no other group waits for it
            or any(c.deferred >= self.config.max_defer for c in g)
        ]
        ids = {id(c) for g in taken for c in g}
        self._pending = [c for c in self._pending if id(c) not in ids]
        for c in self._pending:
            c.deferred += 1
        return taken

    def step(self) -> None:
        """One step, the whole loop in three parts: schedule (`take` the groups), run (each group's
        executor, the lock released during the forwards), update (answer the calls, wake their
        requests). Called with the lock held by a waiting request's thread."""
        groups, self._stepping = self.take(), True  # schedule
        self._cond.release()
        try:
            for group in groups:  # run
                self._run_group(group)
        finally:  # update
            self._cond.acquire()
            for g in groups:
                for c in g:
                    c.done = True
            self._stepping, self._stepped = False, time.monotonic()
            self.steps += 1
            self._cond.notify_all()

    def _run_group(self, group: list[StepCall]) -> None:
        """One group's step; when it raises, its unanswered calls run one by one, so each request
        gets its own outcome (the failing one its error, the others their results)."""
        executor = group[0].member.executor
        try:
            executor.run(group, self.config)
            return
        except BaseException as exc:  # noqa: BLE001 - each waiting request raises its own in its thread
            if len(group) == 1:
                group[0].error = exc
                return
        for c in group:
            if c.result is not None:
                continue
            try:
                executor.recover(c)
                executor.run([c], self.config)
            except BaseException as exc:  # noqa: BLE001 - this request's own failure
                c.error = exc
