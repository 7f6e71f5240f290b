"""What the methods ask of a row of next-token log-probs, wherever the row lives.

A row is a `torch.Tensor` [V] for a member in this process, or a `RemoteRow` handle for a member
in a Ray actor (ensemble_llm/ray/), whose answers come back small: the top n, the values at some ids,
the argmax. The `*_async` forms return something with `.get()`: for remote rows the question is
sent at once, so asking every member's row before reading any answer lets their actors work
(and their forwards finish) in parallel.
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence, Union

import torch


class Answer(Protocol):
    """A question's answer: here already (`Ready`), or on its way (a Ray actor's `Pending`)."""

    def get(self) -> Any: ...


class RowHandle(Protocol):
    """A row that lives elsewhere (a Ray actor's `RemoteRow`, a server's `ServerRow`): it answers
    the questions below, small, instead of handing over its [V] values."""

    @property
    def shape(self) -> tuple[int]: ...

    def top(self, n: int) -> Answer: ...  # (values, ids) of the n largest, largest first
    def take(self, ids: Sequence[int]) -> Answer: ...  # the values at ids
    def query(self, ids: Sequence[int]) -> Answer: ...  # (argmax, the values at ids)


# the one row type of TokenLM: log p(. | context) as a tensor [V] in this process, else a handle;
# the methods ask it through this module's functions, whichever it is
Row = Union[torch.Tensor, RowHandle]


class Ready:
    """An answer already here (a row in this process)."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def get(self) -> Any:
        return self.value


def is_local(row) -> bool:
    return isinstance(row, torch.Tensor)


def top_async(row, n: int):
    """(values, ids) of the n largest entries, largest first."""
    if is_local(row):
        vals, ids = torch.topk(row, min(n, row.shape[-1]))
        return Ready((vals.tolist(), ids.tolist()))
    return row.top(n)


def take_async(row, ids: Sequence[int]):
    """The row's values at `ids` (python floats)."""
    if is_local(row):
        return Ready(row[list(ids)].tolist() if len(ids) else [])
    return row.take(ids)


def query_async(row, ids: Sequence[int]):
    """(argmax, values at ids) in one question."""
    if is_local(row):
        return Ready((int(torch.argmax(row)), row[list(ids)].tolist() if len(ids) else []))
    return row.query(ids)


def take(row, ids: Sequence[int]) -> list[float]:
    return take_async(row, ids).get()


def top(row, n: int) -> tuple[list[float], list[int]]:
    return top_async(row, n).get()


def as_tensor(row) -> torch.Tensor:
    """The whole row here (fetched from the actor for a remote one: vocabulary-sized, counted)."""
    return row if is_local(row) else row.fetch()


def mask_heal(row: torch.Tensor, allowed: torch.Tensor, adds: Sequence[tuple[int, float]]) -> torch.Tensor:
    """A copy of `row` with the tokens `allowed` (bool [V]) forbids at -inf, and each (heir, v)
    of `adds` logaddexp'd into its heir (a forbidden token's mass lent to its valid prefix)."""
    out = row.masked_fill(~allowed.to(row.device), float("-inf"))
    for heir, v in adds:
        out[heir] = torch.logaddexp(out[heir], torch.tensor(v, dtype=out.dtype))
    return out


def merge_into(row: torch.Tensor, merges: Sequence[tuple[int, int]]) -> None:
    """In place, in order: row[heir] = logaddexp(row[heir], row[t]); row[t] = -inf."""
    for heir, t in merges:
        row[heir] = torch.logaddexp(row[heir], row[t])
        row[t] = float("-inf")


def masked_async(row, allowed, adds: Sequence[tuple[int, float]], n: int):
    """`mask_heal` on the row wherever it lives, and the new row's top n (values, ids) to `.get()`.
    A remote row's mask goes to its actor as 1 bit per token; the new row stays there."""
    if is_local(row):
        out = mask_heal(row, torch.as_tensor(allowed), adds)
        return out, top_async(out, n)
    return row.masked(allowed, adds, n)


def merge(row, merges: Sequence[tuple[int, int]]) -> None:
    """`merge_into` wherever the row lives (a remote row's merge is sent without waiting)."""
    if is_local(row):
        merge_into(row, merges)
    else:
        row.merge(merges)


def can_repick(row) -> bool:
    """Whether a second pick from a changed copy of the row is cheap: it is here, not in an actor."""
    return is_local(row)


def pick_token(
    logprobs: torch.Tensor, temperature: float = 0.0, top_p: float = 1.0, generator: torch.Generator | None = None
) -> int:
    """argmax when temperature == 0, else a sample from softmax(logprobs / T) cut to top_p mass.
    A remote row (a member in a Ray actor) picks on its actor, with a seed drawn from `generator`."""
    if not isinstance(logprobs, torch.Tensor):
        return logprobs.pick(temperature, top_p, generator)
    if temperature <= 0.0:
        return int(torch.argmax(logprobs))
    logits = logprobs.float() / temperature
    probs = torch.softmax(logits, dim=-1)
    if top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        cum = torch.cumsum(sorted_p, dim=-1)
        keep = cum - sorted_p < top_p  # smallest prefix reaching top_p (always keeps the first)
        sorted_p = torch.where(keep, sorted_p, torch.zeros_like(sorted_p))
        idx = torch.multinomial(sorted_p.cpu(), 1, generator=generator)
        return int(order[idx.to(order.device)])
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))
