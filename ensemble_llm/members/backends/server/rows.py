"""A row of a server member: what the server said about the next token after one prefix.

A server sends the top `k` log-probs of a position (from the raw logits, before any sampler) and
the log-prob of the token it wrote there, not the whole row. A row also holds the server's
continuation when one came with it (`token`, and `child`: the row after that token), so a method
that follows the member's own greedy or sampled tokens reads them without a request. A value the
row lacks is asked of the server, exactly (`ServerMember.value_at`); whatever needs the whole row
(a constrained pick, smc's byte walk) is refused by name (`CapabilityError`).
"""

from __future__ import annotations

import random
from typing import Any, Protocol, Sequence

from ....errors import CapabilityError
from ...rows import Ready


class RowSource(Protocol):
    """What a row asks of its member (member.py's `ServerMember`, which imports this module)."""

    name: str
    url: str
    vocab_size: int

    def value_at(self, row: ServerRow, token: int) -> float: ...
    def widen(self, row: ServerRow, n: int) -> None: ...
    def draw(self, row: ServerRow, temperature: float, top_p: float, seed: int) -> None: ...


def missing(member: Any, what: str, servers: str) -> CapabilityError:
    return CapabilityError(
        f"member {member.name!r} runs on a server ({member.url}), which gives the top log-probs of a position "
        f"and exact scores of given tokens, but {what}; {servers}"
    )


GREEDY = (0.0, 1.0)  # the (temperature, top_p) of a continuation the server wrote greedily
WIDE = 64  # top entries asked of a row once values outside its top are needed (unite, safe)
FULL_ROWS = "the whole row of next-token log-probs is needed here (constrained output: tools, JSON)"
ANY_SERVER = "run this member in process (drop backend='server') for it."


class ServerRow:
    """log p(. | prefix) as far as the server told it (see the module)."""

    __slots__ = ("member", "seq", "n", "values", "order", "token", "mode", "child", "used")

    def __init__(self, member: RowSource, seq: tuple[int, ...], n: int, top: Sequence[tuple[int, float]]) -> None:
        self.member, self.seq, self.n = member, seq, n  # prefix = seq[:n]
        self.values: dict[int, float] = dict(top)
        self.order = [t for t, _ in top]  # the top ids, best first
        self.token: int | None = None  # the server's token here (greedy, sampled or forced)
        self.mode: tuple[float, float] | None = None  # (temperature, top_p) `token` was drawn with; None: forced
        self.child: ServerRow | None = None  # the row after `token`
        self.used = False  # a drawn token is a sample once

    @property
    def shape(self) -> tuple[int]:
        return (self.member.vocab_size,)

    @property
    def prefix(self) -> list[int]:
        return list(self.seq[: self.n])

    def follow(self, token: int, value: float | None, mode: tuple[float, float] | None) -> None:
        self.token, self.mode, self.used = int(token), mode, False
        if value is not None:  # None: the server was asked for no log-probs
            self.values.setdefault(int(token), float(value))

    # ---- what members.rows asks ----------------------------------------------------------
    def top(self, n: int) -> Ready:
        if n > len(self.order) and len(self.order) < self.member.vocab_size:
            self.member.widen(self, n)
        return Ready(([self.values[t] for t in self.order[:n]], self.order[:n]))

    def take(self, ids: Sequence[int]) -> Ready:
        """The values at `ids`: from the top WIDE when they are there (one request), else each asked."""
        ids = [int(i) for i in ids]
        if any(t not in self.values for t in ids) and not self.order:  # a row asked with no log-probs
            self.member.widen(self, 1)  # its best (and the token the server wrote, when it is that)
        if any(t not in self.values for t in ids) and len(self.order) < WIDE:
            self.member.widen(self, WIDE)
        for t in ids:
            if t not in self.values:
                self.values[t] = self.member.value_at(self, t)
        return Ready([self.values[t] for t in ids])

    def query(self, ids: Sequence[int]) -> Ready:
        return Ready((self.top(1).get()[1][0], self.take(ids).get()))

    def pick(self, temperature: float, top_p: float, generator) -> int:
        """argmax at temperature 0; else a draw the server made at this position with these settings
        (softmax(logits / T) cut to top_p), each draw used once."""
        if temperature <= 0.0:
            if not self.order and self.token is not None and self.mode == GREEDY:
                return self.token  # the server's greedy token: its argmax
            return self.top(1).get()[1][0]
        if not (self.mode == (temperature, top_p) and self.token is not None and not self.used):
            seed = _draw(generator) if generator is not None else random.getrandbits(31)
            self.member.draw(self, temperature, top_p, seed)
        self.used = True
        return int(self.token)

    def masked(self, allowed, adds, n):
        raise missing(self.member, FULL_ROWS, ANY_SERVER)

    def merge(self, merges) -> None:
        raise missing(self.member, FULL_ROWS, ANY_SERVER)

    def fetch(self):
        raise missing(self.member, FULL_ROWS, ANY_SERVER)


def _draw(generator) -> int:
    import torch

    return int(torch.randint(0, 2**31 - 1, (1,), generator=generator))
