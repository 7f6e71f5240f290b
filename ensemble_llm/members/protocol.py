"""`TokenLM`: the whole of what an ensembling method may ask of a member.

`Member` (member.py, the transformers backend, in this process) and `LlamaMember` (llama.py)
implement it through `StateMember` (state.py, the state API written once over each one's executor
and KV hooks); `RayMember` (ensemble_llm/ray/, the model in a Ray actor) and `ServerMember`
(server/, the model in a llama.cpp server) forward it over their transport; what a member lacks of
`capabilities` is refused up front (methods/base.py `check_capabilities`). Methods only call what
is listed here; they never set attributes on a member and only read a state's `ids` and
`next_logprobs` (a member's cache is changed through `extend`, `crop`, `scratch`,
`score_inline`/`keep_candidate`). A row of log-probs (`next_logprobs`, a row of what `extend`
returns) is a tensor for a member here and a handle for a member in an actor: methods ask rows for
small answers through `members.rows` (top-k, values at ids, argmax) and `rows.pick_token`, never
index them directly, so vocabulary-sized work stays where the model is.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, NamedTuple, Protocol, Sequence, runtime_checkable

import torch

from .rows import Row


class PromptScore(NamedTuple):
    """A scored prompt token (`score_prompt`): log p(token | the ids before it), and how far that
    is below the row's best token (0: the member's greedy choice; evidence.py's shot exam)."""

    logprob: float
    gap: float


class KVAccount(NamedTuple):
    """What the KV budget (kvbudget.py) counts for a member: where its KV cache lives (a device,
    or a context or actor of its own), bytes per token of context (None: nothing here to count),
    whether a batch pads its rows to the longest, the most bytes its context holds, and (device,
    free bytes) measured where it runs when that is not this process."""

    device: str
    per_token: int | None
    padded: bool
    capacity: int | None = None
    free: tuple[str, int] | None = None


# What a member may lack (`TokenLM.capabilities`), and what needs each: a method's `needs`, a
# request's constraint. An in-process member has all of them.
FULL_ROWS = "full_rows"  # every token's log-prob at a position (a constrained pick masks the row)
LOGITS = "logits"  # raw logits (specfuse's score="logit")
BYTE_LM = "byte_lm"  # the member as a byte-level LM (smc, scoring)
SHARES_CORES = "shares_cores"  # its decodes split this CPU's cores when members decode at once
IN_PROCESS = frozenset({FULL_ROWS, LOGITS, BYTE_LM})


def prompt_score(row: torch.Tensor, token: int, normalizer: float = 0.0) -> PromptScore:
    """The PromptScore of `token` from one row [V]: log-probs, or logits with their logsumexp as
    `normalizer` (the row is not copied to normalise it)."""
    x = float(row[token])
    return PromptScore(x - normalizer, x - float(row.max()))


def greedy_continues(member: Any, state: Any, continuation: Sequence[int], tie: float = 1e-4) -> bool:
    """Whether `member`'s greedy continuation of `state` begins with `continuation` (each token
    within `tie` of its row's best): the state's next row first, and only if that token is the
    greedy one, the rest in one extend inside `scratch` (the state is left as it was)."""
    cont = [int(t) for t in continuation]
    row = member.ensure_next(state)
    if float(row[cont[0]]) < float(row.max()) - tie:
        return False
    if len(cont) == 1:
        return True
    with member.scratch(state):
        rows = member.extend(state, cont[:-1])
        return all(float(r[t]) >= float(r.max()) - tie for r, t in zip(rows, cont[1:]))


@runtime_checkable
class TokenLM(Protocol):
    # ---- identity and vocabulary -------------------------------------------------------------
    name: str
    device: torch.device
    context_window: int
    vocab_size: int
    eos_ids: frozenset[int]
    eos_id: int | None  # the one EOS id a method writes
    remote: bool  # the model runs in a Ray actor: its forwards run apart from this process
    n_params: int
    backend: str  # members/backends/'s name for what runs it
    dtype: torch.dtype
    numerics: str  # what computes its log-probs where it is not transformers here ("" if it is)
    quantized: str | None  # how its weights are quantized ("gguf": a GGUF file's own), None: not
    capabilities: frozenset[str]  # of FULL_ROWS, LOGITS, BYTE_LM, SHARES_CORES
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

    # rows after each of ids (a [n, V] tensor here, a sequence of RowHandle elsewhere: rows.py)
    def extend(self, state: Any, ids: Sequence[int], last_only: bool = False) -> Sequence[Row]: ...

    def crop(self, state: Any, n: int) -> None: ...

    def scratch(self, state: Any) -> AbstractContextManager[Any]: ...

    def ensure_next(self, state: Any) -> Row: ...

    # ---- in-line scoring and whole prompts ---------------------------------------------------------
    def score_inline(
        self, state: Any, candidates: Sequence[Sequence[int]], raw_logits: bool = False, keep: bool = False
    ) -> list[torch.Tensor]: ...

    def keep_candidate(self, state: Any, index: int) -> None: ...

    def drop_candidates(self, state: Any) -> None: ...

    def score_prompt(self, ids: Sequence[int], positions: Sequence[int]) -> list[PromptScore]: ...

    def forget_prompt(self, ids: Sequence[int]) -> None: ...

    def greedy_after(self, ids: Sequence[int], continuation: Sequence[int]) -> bool: ...

    def target_logprob(self, prompt_ids: Sequence[int], target_ids: Sequence[int]) -> float: ...

    def byte_lm(
        self, beam_width: int, prune_threshold: float, temperature: float, keep_fresh: bool | str = False
    ) -> Any: ...

    # ---- accounting ------------------------------------------------------------------------------
    def counters(self) -> tuple[int, float, int, int, int]: ...

    def prompt_reused(self) -> int | None: ...  # prompt tokens the request took from a stored prompt

    def kv_account(self) -> KVAccount: ...

    def sharing_cores(self, members: int) -> AbstractContextManager[Any]: ...  # with SHARES_CORES
