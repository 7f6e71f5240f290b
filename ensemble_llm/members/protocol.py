"""`TokenLM`: the whole of what an ensembling method may ask of a member.

`Member` (member.py, the transformers backend) implements it. Methods only call what is listed
here; they never set attributes on a member and never reach into a `KVState` (a member's cache
is changed through `extend`, `crop`, `scratch`, `score_inline`/`keep_candidate`). This is the
surface a remote member (the Ray placement issue) has to serve, so it is kept narrow, and its
results are small where a method allows: log-prob rows of one position, candidate scores,
257-slot byte distributions are computed from rows on the caller's side.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, Protocol, Sequence, runtime_checkable

import torch


@runtime_checkable
class TokenLM(Protocol):
    # ---- identity and vocabulary -------------------------------------------------------------
    name: str
    device: torch.device
    context_window: int
    vocab_size: int
    eos_ids: frozenset[int]
    n_params: int
    vocab: Any  # members.vocab.Vocab: token index, byte trie, llguidance tokenizer (built once, owned here)

    @property
    def vocab_bytes(self) -> list[bytes]: ...

    @property
    def special_ids(self) -> frozenset[int]: ...

    # ---- text <-> tokens -------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]: ...

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[int]]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...

    def prompt_ids(self, text: str) -> list[int]: ...

    # ---- KV state ----------------------------------------------------------------------------
    def prefill(self, ids: Sequence[int]) -> Any: ...

    def extend(self, state: Any, ids: Sequence[int], last_only: bool = False) -> torch.Tensor: ...

    def crop(self, state: Any, n: int) -> None: ...

    def scratch(self, state: Any) -> AbstractContextManager[Any]: ...

    def ensure_next(self, state: Any) -> torch.Tensor: ...

    # ---- batched and in-line forwards ----------------------------------------------------------
    def kv_tensor(self, state: Any) -> torch.Tensor: ...

    def forward_rows(self, prefix_kv: torch.Tensor, paths: Sequence[Sequence[torch.Tensor]],
                     tokens: Sequence[int]) -> tuple[torch.Tensor, list[torch.Tensor]]: ...

    def score_inline(self, state: Any, candidates: Sequence[Sequence[int]], raw_logits: bool = False,
                     keep: bool = False) -> list[torch.Tensor]: ...

    def keep_candidate(self, state: Any, index: int) -> None: ...

    def drop_candidates(self, state: Any) -> None: ...
