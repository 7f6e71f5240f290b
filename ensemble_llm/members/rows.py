"""What the methods ask of a row of next-token log-probs, wherever the row lives.

A row is a `torch.Tensor` [V] for a member in this process, or a `RemoteRow` handle for a member
in a Ray actor (remote.py), whose answers come back small: the top n, the values at some ids,
the argmax. The `*_async` forms return something with `.get()`: for remote rows the question is
sent at once, so asking every member's row before reading any answer lets their actors work
(and their forwards finish) in parallel.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch


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
