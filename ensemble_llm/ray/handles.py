"""Caller-side handles to what lives on a member's actor: KV states (`RemoteState`), rows of
log-probs (`RemoteRows`, `RemoteRow`), pending answers (`Pending`) and smc's byte LM
(`RemoteByteLM`). Only small results cross the wire."""

from __future__ import annotations

import collections
from typing import Any, Iterator, Protocol, Sequence

import numpy as np
import torch

from ..members.scheduler import run_call
from ..members.steps import Tree


class Owner(Protocol):
    """What a handle asks of the member whose actor holds it (member.py's `RayMember`, which
    imports this module)."""

    vocab_size: int
    handle_ids: Iterator[int]
    dead_handles: collections.deque[int]

    def submit(self, op: str, *args, count: bool = True, tags: tuple | None = None) -> Any: ...
    def ask(self, op: str, *args) -> Pending: ...
    def fetch(self, ref, count: bool = True) -> Any: ...


# ---- handles in the caller ------------------------------------------------------------------
class _Handle:
    """An object on the actor; when the caller drops it, the actor frees it with the next call."""

    __slots__ = ("owner", "id", "__weakref__")

    def __init__(self, owner: Owner) -> None:
        self.owner, self.id = owner, next(owner.handle_ids)

    def __del__(self) -> None:
        try:
            self.owner.dead_handles.append(self.id)
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


class RemoteRows:
    """The log-prob rows [n, V] of one forward, held on the actor."""

    def __init__(self, owner: Owner, n: int) -> None:
        self.handle, self.n = _Handle(owner), n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> "RemoteRow":
        if not -self.n <= i < self.n:
            raise IndexError(f"row {i} of {self.n}")
        return RemoteRow(self, i % self.n)


class RemoteRow:
    """One row of log-probs [V] on the actor. `members.rows` asks it for small answers."""

    __slots__ = ("rows", "i")

    def __init__(self, rows: RemoteRows, i: int) -> None:
        self.rows, self.i = rows, i

    @property
    def owner(self) -> Owner:
        return self.rows.handle.owner

    def __len__(self) -> int:
        return self.owner.vocab_size

    @property
    def shape(self) -> tuple[int]:
        return (self.owner.vocab_size,)

    def ask(self, op: str, *args) -> "Pending":
        return self.owner.ask(op, self.rows.handle.id, self.i, *args)

    def top(self, n: int) -> "Pending":
        return self.ask("top", n)

    def take(self, ids: Sequence[int]) -> "Pending":
        return self.ask("take", [int(i) for i in ids])

    def query(self, ids: Sequence[int]) -> "Pending":
        return self.ask("query", [int(i) for i in ids])

    def pick(self, temperature: float, top_p: float, generator: torch.Generator | None) -> int:
        seed = None
        if temperature > 0:  # the caller's generator draws the actor's seed: reproducible for a given seed
            seed = (
                int(torch.randint(0, 2**62, (), generator=generator))
                if generator is not None
                else int(torch.randint(0, 2**62, ()))
            )
        return self.ask("pick", float(temperature), float(top_p), seed).get()

    def masked(self, allowed: np.ndarray, adds: list[tuple[int, float]], k: int) -> tuple["RemoteRow", Pending]:
        """A grammar's mask (`Guide.mask_row`) applied on the actor: a new row there with the forbidden
        tokens at -inf and `adds` logaddexp'd in, and the top k of it. 1 bit per token goes up."""
        rows = RemoteRows(self.owner, 1)
        best = self.ask(
            "mask", rows.handle.id, np.packbits(allowed), len(allowed), [(int(h), float(v)) for h, v in adds], int(k)
        )
        return rows[0], best

    def merge(self, merges: list[tuple[int, int]]) -> None:
        """out[heir] = logaddexp(out[heir], out[t]); out[t] = -inf for each pair, in order (no wait)."""
        if merges:
            self.owner.submit("merge", self.rows.handle.id, self.i, [(int(h), int(t)) for h, t in merges])

    def fetch(self) -> torch.Tensor:
        """The whole row (vocabulary-sized: only where a step needs every token, e.g. a grammar mask)."""
        return torch.tensor(self.ask("fetch").get())


class RemoteState:
    """A KV state on the actor; the caller mirrors its token ids and its latest row."""

    def __init__(self, owner: Owner) -> None:
        self.handle = _Handle(owner)
        self.ids: list[int] = []
        self.next_row: RemoteRow | None = None
        self.scored: list[list[int]] | None = None
        self.saved: list[tuple[int, RemoteRow | None]] = []

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def next_logprobs(self) -> RemoteRow | None:
        return self.next_row


class Pending:
    """A result the actor will send; `get()` waits for it (checking the request's deadline)."""

    __slots__ = ("owner", "ref")

    def __init__(self, owner: Owner, ref) -> None:
        self.owner, self.ref = owner, ref

    def get(self) -> Any:
        return self.owner.fetch(self.ref)


class _Rows:
    """A pending [distinct beams, 257] answer, expanded to one row per asked beam on `get()`."""

    __slots__ = ("pending", "index")

    def __init__(self, pending: Pending, index: list[int]) -> None:
        self.pending, self.index = pending, index

    def get(self) -> np.ndarray:
        return self.pending.get()[self.index]


class RemoteBeam:
    """A byte-LM beam on the actor (smc); `tokens` as in `Beam.tokens`."""

    __slots__ = ("handle", "lm", "_tokens", "__weakref__")

    def __init__(self, lm: "RemoteByteLM", tokens: int | None = None) -> None:
        self.handle, self.lm, self._tokens = _Handle(lm.member), lm, tokens

    @property
    def tokens(self) -> int:
        if self._tokens is None:
            self.lm._resolve()
        return self._tokens


class RemoteByteLM:
    """`ByteLM` with the member's byte LM on its actor: 257 log-probs per beam cross the wire."""

    def __init__(
        self,
        member: Owner,
        beam_width: int,
        prune_threshold: float,
        temperature: float,
        keep_fresh: bool | str = False,
    ) -> None:
        self.member = member
        self.handle = _Handle(member)
        # "lazy" (defer the fresh hypothesis' forward) is kept eagerly there: the same figures
        member.submit(
            "bytelm", self.handle.id, int(beam_width), float(prune_threshold), float(temperature), bool(keep_fresh)
        )
        self._pending: list[tuple[list[RemoteBeam], Pending]] = []
        self._advances: list[tuple[RemoteBeam, RemoteBeam, int]] = []
        self.heals = 0

    def _flush(self) -> None:
        """Send the advances made since the last call as one call (their token counts come back)."""
        if self._advances:
            todo, self._advances = self._advances, []
            pairs = [(new.handle.id, old.handle.id, b) for new, old, b in todo]
            self._pending.append(
                ([new for new, _, _ in todo], self.member.ask("bytelm_advance", self.handle.id, pairs))
            )

    def start(self, prompt_ids: Sequence[int]) -> RemoteBeam:
        self._flush()
        beam = RemoteBeam(self)
        beam._tokens = self.member.ask("bytelm_start", self.handle.id, beam.handle.id, list(prompt_ids)).get()
        return beam

    def _resolve(self) -> None:
        self._flush()
        pending, self._pending = self._pending, []
        for beams, p in pending:
            for b, t in zip(beams, p.get()):
                b._tokens = t

    def next_logprobs_async(self, beams: Sequence[RemoteBeam], need: Sequence[set[int]] | None = None) -> "_Rows":
        # particles share beams after resampling: each distinct beam's 257 log-probs cross once
        self._flush()
        uniq: dict[int, int] = {}
        index = [uniq.setdefault(b.handle.id, len(uniq)) for b in beams]
        # with the other requests' byte LMs of this member: one actor call, one forward there
        part = run_call(Tree(self.member, None, tree=("bytelm", self.handle.id, list(uniq))))
        return _Rows(part, index)

    def next_logprobs(self, beams: Sequence[RemoteBeam], need: Sequence[set[int]] | None = None) -> np.ndarray:
        return self.next_logprobs_async(beams, need).get()

    def advance(self, beam: RemoteBeam, b: int) -> RemoteBeam:
        new = RemoteBeam(self)
        # sent with the next call of this byte LM, all advances of a step in one; the new beam's
        # token count is read only when asked
        self._advances.append((new, beam, int(b)))
        return new

    def compact(self, beams: Sequence[RemoteBeam]) -> None:
        self._resolve()
        self.heals = self.member.ask("bytelm_compact", self.handle.id, [b.handle.id for b in beams]).get()
