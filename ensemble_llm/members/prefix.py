"""Prompt prefix reuse: the KV of recent prompts, per member, so that a prompt which begins like
one of them runs only its new tokens (what vLLM's automatic prefix caching and SGLang's
RadixAttention do; here over whole prompts, kept in LRU order under a byte bound).

Prompts to one engine share long beginnings: a chat prompt starts with its template's system
prompt or the member's preamble (Gemma-3's is 89 of a short chat prompt's 100 tokens), and the
few-shot prompts of one task share their shots. On a CPU a prompt's forward is compute-bound, so
every shared token that is not run again is saved outright, and under concurrent load a saved
prefill no longer stalls the other requests' decode steps.

How: after a prompt's forward, its KV (every layer's keys and values over the prompt's tokens,
copied out of the batch it ran in) is kept with its token ids. A later prompt takes the stored
prompt with the longest common beginning of at least `MIN_TOKENS` tokens, starts its state from
a copy of that many tokens' KV (at least its own last token always runs, for its next-token
log-probs) and runs only the rest. The KV a token gets depends only on the tokens before it, so
the result is the full prompt's forward up to float rounding (tested against it).

A prompt scored for the per-request weights (`Member.score_prompt`: log p of the shown answers'
tokens) keeps those scores by position with its KV; a later prompt that shares the shots takes the
scores of its positions inside the common beginning from there, so its evidence costs only the
positions past it. Where a position inside the common beginning has no stored score, the reuse
stops just before it.

The bound is per member: `ENSEMBLE_LLM_PREFIX_CACHE` (bytes or a size such as "256MiB"; "0"
turns reuse off), read when a member loads; `DEFAULT_BYTES` otherwise. The stored KV lives on the
member's devices beside the running requests' caches (kvbudget.py does not count it); on
llama.cpp it is the bytes of the prompt's cells, in host memory, outside the context (llama.py).
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from .options import parse_size
from .protocol import PromptScore

ENV = "ENSEMBLE_LLM_PREFIX_CACHE"
DEFAULT_BYTES = 64 * 2**20  # per member: about 17 of Gemma-3-270m's 100-token chat prompts in float32
MIN_TOKENS = 8  # a shorter common beginning is not reused


def configured_bytes() -> int:
    """The bound from `ENSEMBLE_LLM_PREFIX_CACHE`, else DEFAULT_BYTES."""
    value = os.environ.get(ENV)
    if value is None or not value.strip():
        return DEFAULT_BYTES
    return parse_size(int(value) if value.strip().isdigit() else value, ENV)


@dataclass(eq=False)
class Entry:
    """One stored prompt: its ids, every layer's (keys, values) [1, heads, tokens, dim] over them,
    and the log-probs it scored, by position (score_prompt)."""

    ids: tuple[int, ...]
    kv: Any  # transformers: every layer's (keys, values); llama.cpp: the sequence holding the prompt
    scores: dict[int, PromptScore] = field(default_factory=dict)
    size: int | None = None  # bytes, when the KV is not tensors here (a llama.cpp sequence)

    @property
    def nbytes(self) -> int:
        if self.size is not None:
            return self.size
        return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in self.kv)


def common_length(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens `a` and `b` share."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = (torch.as_tensor(a[:n]) != torch.as_tensor(b[:n])).nonzero()
    return int(diff[0, 0]) if len(diff) else n


class PrefixCache:
    """The stored prompts of one member (see the module). Thread-safe; `hits` and `reused` count
    the prompts that started from a stored one and the tokens they did not run."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = int(max_bytes)
        self._entries: OrderedDict[tuple[int, ...], Entry] = OrderedDict()
        self._lock = threading.Lock()
        self.bytes = 0
        self.hits = 0
        self.reused = 0

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.bytes = 0

    def match(
        self, ids: Sequence[int], positions: Sequence[int] | None = None, align: int = 1
    ) -> tuple[int, Entry | None]:
        """(n, entry): the stored prompt whose first n tokens `ids` starts with, n as large as
        possible but below len(ids) (the last token runs), and, with `positions` (to score), such
        that every position p <= n has its score in the entry (the positions past n are run: the
        rows before them are). The entry returned holds only the scores that hold for `ids`.
        (0, None) when no stored prompt shares MIN_TOKENS. `align`: n is a multiple of it (llama.cpp
        runs prompts in aligned pieces: llama.py `prompt_pieces`)."""
        if self.max_bytes <= 0 or len(ids) <= MIN_TOKENS:
            return 0, None
        with self._lock:
            entries = list(self._entries.values())
        best, found, want = 0, None, sorted(set(positions or ()))
        for e in entries:
            shared = common_length(e.ids, ids)
            n = min(shared, len(ids) - 1)
            for p in want:  # a position up to n is read from the entry: the first it lacks runs
                if p > n:
                    break
                if not (p < shared and p in e.scores):
                    n = p - 1
                    break
            n = n // align * align
            if n > best:  # the entry's scores as far as they hold for `ids`
                best, found = n, Entry(e.ids, e.kv, {p: v for p, v in e.scores.items() if p < shared}, e.size)
        if best < MIN_TOKENS:
            return 0, None
        with self._lock:
            if found.ids in self._entries:
                self._entries.move_to_end(found.ids)
            self.hits += 1
            self.reused += best
        return best, found

    def keeps(self, n_tokens: int) -> bool:
        """Whether a prompt of n_tokens would be kept (a caller can skip copying out its KV)."""
        return self.max_bytes > 0 and n_tokens > MIN_TOKENS

    def put(self, ids: Sequence[int], kv: Any, scores: dict[int, PromptScore], size: int | None = None) -> None:
        """Keep a prompt's KV (tensors the caller will not change, or a sequence of `size` bytes)
        and scores; stored prompts that it begins with go (it holds what they hold); the least
        recently used go past the bound."""
        key = tuple(int(i) for i in ids)
        if not self.keeps(len(key)):
            return
        entry = Entry(key, kv, dict(scores), size)
        if entry.nbytes > self.max_bytes:
            return
        with self._lock:
            for other in [e for e in self._entries.values() if e.ids == key[: len(e.ids)]]:
                entry.scores = {**other.scores, **entry.scores}
                self._drop(other)
            self._entries[key] = entry
            self.bytes += entry.nbytes
            while self.bytes > self.max_bytes:
                self._drop(next(iter(self._entries.values())))

    def _drop(self, entry: Entry) -> None:
        del self._entries[entry.ids]
        self.bytes -= entry.nbytes


def seed_cache(entry: Entry, n: int):
    """A DynamicCache holding a copy of the entry's first n tokens' KV (made by the layers' own
    `update`, whose torch.cat is the copy: no clone before it)."""
    from transformers import DynamicCache

    return DynamicCache(ddp_cache_data=[(k[:, :, :n], v[:, :, :n]) for k, v in entry.kv])
