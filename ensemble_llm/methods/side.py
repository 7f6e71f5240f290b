"""One request's member calls run side by side, in threads, where the members gain by it.

They gain on different devices and in Ray actors (each computes apart), and as llama.cpp members
on the CPU, which then split its cores (`LlamaMember.sharing_cores`): two one-thread decodes at
once beat the same two in turn on every core. Transformers members on one device only
contend, so they take turns. Each thread runs under the request's deadline and counts, and its
forwards join the request's steps, as the request's own would.

It pays where each thread runs many calls (specfuse's drafts of a segment); one call each and
then a barrier does not (unite's primary and views at every token, so unite keeps its members in
turn).
"""

from __future__ import annotations

import contextlib
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterable, Sequence

from ..members.context import current_request
from ..members.protocol import SHARES_CORES
from ..members.scheduler import batched_now, outside_steps, part_of


def sharing_cpu(members: Sequence[Any]) -> list:
    """The members that split the CPU's cores when they decode at once (llama.cpp members on the CPU)."""
    return [m for m in members if SHARES_CORES in m.capabilities and m.device.type == "cpu"]


class SideBySide:
    """Runs one request's calls on its members at once when they gain by it (`on`), else in turn."""

    def __init__(self, members: Sequence[Any]) -> None:
        self.sharing = sharing_cpu(members)
        separate = len({str(m.device) for m in members}) > 1 or any(m.remote for m in members)
        self.apart = len(members) > 1 and separate
        self.on = self.apart or (len(members) > 1 and len(self.sharing) == len(members))
        self.ctx = current_request()  # the request's deadline, counts and steps hold in the threads too
        self.pool = ThreadPoolExecutor(max_workers=len(members)) if self.on else None

    def map(self, fn: Callable[[Any], Any], items: Iterable[Any]) -> list:
        """fn over items: in the pool's threads when `on`, else one after another here. Members that
        share the CPU take turns while other requests run: the steps then batch the requests' calls,
        and threads of their own would split the cores under every batched step."""
        if self.pool is None or (not self.apart and batched_now(self.ctx)):
            return [fn(x) for x in items]

        def guarded(x):  # each thread's forwards join the steps, as the request's would
            with part_of(self.ctx):
                return fn(x)

        with outside_steps(), contextlib.ExitStack() as sharing:  # the steps wait for the threads, not this one
            for m in self.sharing:
                sharing.enter_context(m.sharing_cores(len(self.sharing)))
            return list(self.pool.map(guarded, items))

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True)
