"""The KV-cache budget: requests are admitted only while their KV caches fit, in order of arrival.

Each request reserves, before its method runs, a bound on the KV bytes it can hold on each device:
per member, its KV bytes per token (`Member.kv_per_token`) times its token bound (prompt plus
`max_new_tokens`). Requests that decode together are rows of one batched cache padded to the
longest row, and a group grows to at most twice its longest row plus `slack` columns before it
is rebuilt (members/backends/transformers/rowgroups.py), so a set S of running requests holds at most
|S| x (2 x longest bound + slack + 1) tokens per member; smc's particles (a token tree per member,
not a batched group) hold at most prompt + particles x beam_width x max_new_tokens. The budget
admits a request when that bound, with it added, fits every device's limit; otherwise it waits
(first come, first served, while still under its deadline and not cancelled). A request that
would not fit even alone is refused at once with a KVBudgetError (a RequestError) naming the sizes and the fixes
(the server answers 400; a full queue is its 429).

`kv_budget`: "auto" (on CUDA 90% of the device memory free once the weights are loaded, on the
CPU half the RAM then available: psutil), a number of bytes or a size string ("2GB", "512MiB"),
or None (no limit). Each member says what to count (`TokenLM.kv_account`): a llama.cpp member
counts on a device of its own, its requests' cells unpadded, its limit never above what its
context holds; a member in a Ray actor counts on a device of its own, its "auto" limit the same
share of the memory its actor found free once loaded (actors that share a GPU or a node each take
that share: set a byte count there).
"""

from __future__ import annotations

import contextlib
import re
import threading
import time
from typing import Any, Callable, Sequence

from .errors import ConfigError, KVBudgetError
from .members.scheduler import outside_steps

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}
AUTO_CUDA, AUTO_CPU = 0.9, 0.5  # "auto": shares of the free device memory / available RAM at first use


def parse_budget(value: Any) -> int | str | None:
    """The `kv_budget` option checked: "auto", None, or a positive number of bytes."""
    if value is None or value == "auto":
        return value
    if isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", value)
        if m and m.group(2).lower() in _UNITS:
            value = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ConfigError(
            'kv_budget must be "auto", None (no limit), a number of bytes or a size like "2GB" or '
            f'"512MiB"; got {value!r}'
        )
    return int(value)


def auto_limit(device: Any, free: int | None = None) -> int:
    """What "auto" allows on `device`: a share of its free memory now (or of `free`: what a Ray
    actor found free on its device)."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        if free is None:
            free, _ = torch.cuda.mem_get_info(device)
        return int(free * AUTO_CUDA)
    if free is not None:
        return int(free * AUTO_CPU)
    import psutil

    return int(psutil.virtual_memory().available * AUTO_CPU)


def _mb(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


class Reservation:
    """One request's bound: per member, (device, KV bytes per token, token units, padded)."""

    def __init__(self, parts: list[tuple[str, int, int, bool]]) -> None:
        self.parts = parts
        self.waited_s = 0.0


class KVBudget:
    """Admits requests while their KV bound fits (see the module)."""

    def __init__(self, value: Any = "auto", slack: int = 64) -> None:
        self.value = parse_budget(value)
        self.slack = slack  # the steps' BatchingConfig.slack: a row group's width past twice its longest row
        self._limits: dict[str, int] = {}  # per device, fixed at first use ("auto": after the weights load)
        self._free: dict[str, tuple[str, int]] = {}  # a Ray member's device: (its actor's device, free bytes)
        self._capacity: dict[str, int] = {}  # a llama.cpp member's device: the bytes its context holds
        self._running: list[Reservation] = []
        self._queue: list[Reservation] = []  # waiting, in order of arrival
        self._cond = threading.Condition()

    def limit(self, device: str) -> int | None:
        if self.value is None:
            return None
        if device not in self._limits:
            if self.value != "auto":
                self._limits[device] = int(self.value)
            elif device in self._capacity:  # a llama.cpp context: what it holds
                self._limits[device] = self._capacity[device]
            else:  # a Ray actor's: the share of what it found free on its device
                self._limits[device] = auto_limit(*self._free.get(device, (device, None)))
            if device in self._capacity:
                self._limits[device] = min(self._limits[device], self._capacity[device])
        return self._limits[device]

    @staticmethod
    def bound(rs: Sequence[Reservation]) -> dict[str, int]:
        """The most KV bytes per device that the requests `rs` can hold together."""
        out: dict[str, int] = {}
        by_member: dict[int, list] = {}
        for r in rs:
            for i, part in enumerate(r.parts):
                by_member.setdefault(i, []).append(part)
        for parts in by_member.values():
            dev, per_token, _, padded = parts[0]
            if not per_token:  # no KV cache here (a member on a server), or none known
                continue
            units = len(parts) * max(p[2] for p in parts) if padded else sum(p[2] for p in parts)
            out[dev] = out.get(dev, 0) + per_token * units
        return out

    def plan(self, members: Sequence[Any], prompt_ids: Sequence[Sequence[int]], max_new: int, rows: int) -> Reservation:
        """This request's bound (members without a known KV size count 0)."""
        parts = []
        for m, ids in zip(members, prompt_ids):
            kv = m.kv_account()
            per_token, dev = kv.per_token or 0, kv.device
            if kv.free is not None:  # measured where it runs (a Ray actor)
                self._free.setdefault(dev, kv.free)
            if kv.capacity:
                self._capacity.setdefault(dev, int(kv.capacity))
            if rows > 1:  # a token tree per member (smc): not padded to the others
                parts.append((dev, per_token, len(ids) + rows * max_new, False))
            elif not kv.padded:  # its own cells (llama.cpp), candidates' forks beside
                parts.append((dev, per_token, len(ids) + max_new + self.slack, False))
            else:
                parts.append((dev, per_token, 2 * (len(ids) + max_new) + self.slack + 1, True))
        return Reservation(parts)

    def _fits(self, rs: Sequence[Reservation]) -> bool:
        return all(self.limit(d) is None or n <= self.limit(d) for d, n in self.bound(rs).items())

    @contextlib.contextmanager
    def hold(self, res: Reservation, check: Callable[[], None]):
        """Run the block once `res` fits beside the running requests; `check()` raises when the
        request's deadline passes or its caller goes away while it waits."""
        if self.value is None:
            yield res
            return
        for dev, n in self.bound([res]).items():
            if self.limit(dev) is not None and n > self.limit(dev):
                raise KVBudgetError(
                    f"this request's KV cache may reach {_mb(n)} on {dev} (prompt + max_new_tokens, every "
                    f"member), over the kv_budget of {_mb(self.limit(dev))}; lower max_new_tokens, shorten "
                    "the prompt, or raise kv_budget."
                )
        t0 = time.monotonic()
        with self._cond:
            self._queue.append(res)
            try:
                with outside_steps():  # the steps of running requests do not wait for this one
                    while self._queue[0] is not res or not self._fits([*self._running, res]):
                        self._cond.wait(0.05)
                        check()
            finally:
                self._queue.remove(res)
                self._cond.notify_all()
            self._running.append(res)
        res.waited_s = time.monotonic() - t0
        try:
            yield res
        finally:
            with self._cond:
                self._running.remove(res)
                self._cond.notify_all()

    def limits(self) -> dict[str, int]:
        """The limit per device fixed so far (a device's is fixed at its first request)."""
        with self._cond:
            return dict(self._limits)

    def in_use(self) -> dict[str, int]:
        """The bound of the running requests per device, in bytes (for stats)."""
        with self._cond:
            return self.bound(self._running)
