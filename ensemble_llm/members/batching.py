"""Continuous batching across concurrent requests: one batched forward per member per step.

Every request runs its method in a thread of its own (the worker runs up to `max_batch` at once)
and the methods stay as they are: sequential code asking a member to `extend` a state. A
one-token `extend` from a request thread is not run at once: it waits in `SCHEDULER` for the
step. A step runs when every running request is waiting in one (iteration-level scheduling, as
in Orca: a request that is prefilling or scoring a segment is waited for up to `GATHER_S`, then
the step goes without it), and it is ONE forward per member over all waiting states.

The states of one member that step together live as rows of one batched cache (`RowGroup`), so
a steady decode step copies nothing: each row's own tokens sit in its columns, right-aligned,
and a row that does not take part in a step gets a masked hole column. A crop inside a group
masks columns instead of copying; any other operation takes the row out of the group first
(`release`: its columns copied into a cache of its own). Each row sees only its own columns at
its own position ids, through a 4-D mask (sliding-window layers get a mask of their own), so a
batched step computes what the row's own forward would, up to float rounding.

What is batched: one-token `extend`s of members in this process, and smc's tree forwards
(`forward_rows`: the trees of several requests laid out one after another in one forward).
Multi-token extends (prefills, verification, scoring) and members in Ray actors still run one
request at a time per member (under the member's lock), between the steps; the steps do not wait
for a request inside such a forward.
"""

from __future__ import annotations

import contextlib
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache

GATHER_S = 0.02  # how long waiting requests wait for one that is still computing before stepping without it
SLACK = 64  # a group is rebuilt once its width passes twice its longest row plus this many columns


@dataclass
class Tally:
    """One request's forward passes, seconds in them and prefills, per member (its stats)."""

    counts: dict[int, list] = field(default_factory=dict)

    def add(self, member: Any, n: int = 1, seconds: float = 0.0, prefills: int = 0) -> None:
        c = self.counts.setdefault(id(member), [0, 0.0, 0])
        c[0] += n
        c[1] += seconds
        c[2] += prefills

    def of(self, member: Any) -> tuple[int, float, int]:
        n, t, p = self.counts.get(id(member), (0, 0.0, 0))
        return n, t, p


@dataclass
class _Call:
    member: Any
    state: Any
    token: int
    tally: Tally | None
    done: bool = False
    result: torch.Tensor | None = None
    error: BaseException | None = None
    since: float = field(default_factory=time.monotonic)
    tree: tuple | None = None  # a forward_rows call (smc): (prefix_kv, paths, tokens); then no state/token


class RowGroup:
    """States of one member as the rows of one batched cache [rows, heads, width, dim] per layer.
    `valid[r, c]`: row r's token sits in column c; `pos[r, c]`: its position id (-1 for holes)."""

    def __init__(self, member: Any, states: list) -> None:
        self.member = member
        lens = [len(s.ids) for s in states]
        width = max(lens)
        dev = member.device
        layers = []
        for li in range(len(states[0].cache.layers)):
            ks, vs = [], []
            for s, n in zip(states, lens):
                layer = s.cache.layers[li]
                ks.append(torch.nn.functional.pad(layer.keys, (0, 0, width - n, 0)))
                vs.append(torch.nn.functional.pad(layer.values, (0, 0, width - n, 0)))
            layers.append((torch.cat(ks), torch.cat(vs)))
        self.cache = DynamicCache(ddp_cache_data=layers)
        self.valid = torch.zeros(len(states), width, dtype=torch.bool, device=dev)
        self.pos = torch.full((len(states), width), -1, dtype=torch.long, device=dev)
        for r, n in enumerate(lens):
            self.valid[r, width - n :] = True
            self.pos[r, width - n :] = torch.arange(n, device=dev)
        # weak: a finished request's states are freed at once (its row is dead until a rebuild)
        self.rows: list = [weakref.ref(s) for s in states]
        for r, s in enumerate(states):
            s.group, s.row, s.cache = self, r, None

    @property
    def width(self) -> int:
        return self.valid.shape[1]

    def live(self) -> list:
        return [s for s in (r() for r in self.rows if r is not None) if s is not None]

    def worn(self) -> bool:
        """Too many holes or dead rows to keep stepping: rebuild from the live rows."""
        live = self.live()
        longest = max((len(s.ids) for s in live), default=0)
        return len(live) * 2 < len(self.rows) or self.width > 2 * longest + SLACK

    def release(self, state: Any) -> None:
        """Take `state` out of the group: its columns become a cache of its own."""
        r = state.row
        cols = self.valid[r].nonzero()[:, 0]
        data = []
        for layer in self.cache.layers:
            c = cols.to(layer.keys.device)
            data.append((layer.keys[r : r + 1, :, c], layer.values[r : r + 1, :, c]))
        state.cache = DynamicCache(ddp_cache_data=data) if len(cols) else DynamicCache()
        self.rows[r] = None
        state.group, state.row = None, -1

    def crop(self, state: Any, n: int) -> None:
        """Row `state` keeps its first n tokens: the later columns become holes."""
        r = state.row
        gone = self.pos[r] >= n
        self.valid[r, gone] = False
        self.pos[r, gone] = -1

    def step(self, calls: list[_Call]) -> None:
        """One forward: each call's token appended to its row; rows without a call get a hole."""
        m, b = self.member, len(self.rows)
        dev = m.device
        tokens = torch.zeros(b, 1, dtype=torch.long, device=dev)
        part = torch.zeros(b, dtype=torch.bool, device=dev)
        qpos = torch.zeros(b, dtype=torch.long, device=dev)
        for c in calls:
            r = c.state.row
            tokens[r, 0], part[r], qpos[r] = c.token, True, len(c.state.ids)
        valid = torch.cat([self.valid, part[:, None]], dim=1)
        pos = torch.cat([self.pos, torch.where(part, qpos, -1)[:, None]], dim=1)
        seen = valid.clone()
        seen[~part, -1] = True  # a row without a call sees its own hole only (a fully masked row gives NaN)
        logits = m._forward(
            tallies=[c.tally for c in calls],
            input_ids=tokens,
            attention_mask=batch_masks(m, seen, qpos, pos),
            position_ids=qpos[:, None],
            cache=self.cache,
            use_cache=True,
        )[:, -1]
        self.valid, self.pos = valid, pos
        for c in calls:
            row = logits[c.state.row].float()
            logp = torch.log_softmax(row, dim=-1)
            c.state.ids.append(int(c.token))
            c.state.next_logprobs, c.state.next_logits = logp, row
            c.result = logp[None]


def batch_masks(member: Any, seen: torch.Tensor, qpos: torch.Tensor, kpos: torch.Tensor) -> Any:
    """The 4-D additive masks [rows, 1, 1, width] for one query per row: row r sees the columns in
    `seen[r]`; a model with sliding-window layers gets a second mask for them (keys within the
    window of the query's own position)."""
    neg = torch.finfo(member.dtype).min
    full = torch.zeros(seen.shape, dtype=member.dtype, device=seen.device).masked_fill(~seen, neg)
    cfg = member.model.config.get_text_config(decoder=True)
    window = getattr(cfg, "sliding_window", None)
    if window and "sliding_attention" in (getattr(cfg, "layer_types", None) or ()):
        far = (qpos[:, None] - kpos) >= window
        return {"full_attention": full[:, None, None], "sliding_attention": full.masked_fill(far, neg)[:, None, None]}
    return full[:, None, None]


def run_step(member: Any, calls: list[_Call]) -> None:
    """One member's step over its waiting calls: in their common group when they have one (and it
    is not worn), else in a new group of these states (a lone call runs on its own cache)."""
    with member._lock:
        alone = [c for c in calls if len(calls) == 1 or not c.state.ids]  # an empty state has no cache to join
        for c in alone:
            if c.state.group is not None:
                c.state.group.release(c.state)
            c.result = member._extend_own(c.state, [c.token], tally=c.tally)
        calls = [c for c in calls if c not in alone]
        if not calls:
            return
        states = [c.state for c in calls]
        group = states[0].group
        if group is None or any(s.group is not group for s in states) or group.worn():
            for s in states:
                if s.group is not None:
                    s.group.release(s)
                member.drop_candidates(s)
            group = RowGroup(member, states)
        group.step(calls)


class StepScheduler:
    """Gathers the one-token extends of concurrent request threads into steps (see the module)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._local = threading.local()
        self._active = 0  # request threads running (registered by `request`)
        self._busy = 0  # of those, threads inside a forward of their own (a prefill, a scoring): not waited for
        self._pending: list[_Call] = []
        self._stepping = False
        self._stepped = 0.0  # when the last step ended: everyone gets a gather period after it

    @contextlib.contextmanager
    def request(self):
        """The calling thread runs one request: its one-token extends may be batched."""
        with self._cond:
            self._active += 1
        self._local.on = True
        try:
            yield
        finally:
            self._local.on = False
            with self._cond:
                self._active -= 1
                self._cond.notify_all()  # the others may all be waiting now

    @contextlib.contextmanager
    def own_forward(self):
        """The calling thread runs a forward outside the steps: while it does, the steps do not wait for it."""
        if not getattr(self._local, "on", False):
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

    def batching(self) -> bool:
        """Whether an extend from this thread should wait for a step: it runs a request, and
        another request runs too."""
        return getattr(self._local, "on", False) and self._active > 1

    def extend(self, member: Any, state: Any, token: int, tally: Tally | None) -> torch.Tensor:
        return self._wait(_Call(member, state, int(token), tally))

    def rows(self, member: Any, tree: tuple, tally: Tally | None) -> tuple:
        """A `forward_rows` call, run with the other requests' trees in one forward."""
        return self._wait(_Call(member, None, -1, tally, tree=tree))

    def _wait(self, call: _Call) -> Any:
        with self._cond:
            self._pending.append(call)
            self._cond.notify_all()
            while not call.done:
                # every running request waits in a step (or this call has waited a gather period:
                # a request still prefilling or scoring is not waited for longer): this thread steps
                late = time.monotonic() - max(call.since, self._stepped) >= GATHER_S
                if not self._stepping and (len(self._pending) >= self._active - self._busy or late):
                    self._step()
                else:
                    self._cond.wait(GATHER_S)
        if call.error is not None:
            raise call.error
        return call.result

    def _step(self) -> None:
        """Run every pending call (called with the lock held; released during the forwards)."""
        calls, self._pending, self._stepping = self._pending, [], True
        self._cond.release()
        try:
            by_member: dict[tuple, list[_Call]] = {}
            for c in calls:
                by_member.setdefault((id(c.member), c.tree is None), []).append(c)
            for group in by_member.values():
                try:
                    if group[0].tree is None:
                        run_step(group[0].member, group)
                    else:  # smc's trees: one forward for all of them
                        outs = group[0].member.rows_many([c.tree for c in group], [c.tally for c in group])
                        for c, out in zip(group, outs):
                            c.result = out
                except BaseException as exc:  # noqa: BLE001 - each waiting request raises it in its own thread
                    for c in group:
                        c.error = exc
        finally:
            self._cond.acquire()
            for c in calls:
                c.done = True
            self._stepping, self._stepped = False, time.monotonic()
            self._cond.notify_all()


SCHEDULER = StepScheduler()
