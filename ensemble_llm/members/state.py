"""`StateMember`: the state API written once, for members whose forwards run in this process's steps.

Each call that changes a state is validated here, built as a typed call (steps.py) and run through
the step scheduler (`run_call`: batched with other requests' calls, or alone), and its answer
finishes the state here. A backend supplies the rest:
- `new_state()` and an `executor` (steps.Executor) that runs the calls on its model;
- three hooks on its own KV: `_cut` (roll a state back), `_keep_kv` (keep one scored candidate's
  KV), `_drop_kv` (drop the scored candidates' KV);
- `target_logprob` and `byte_lm`, which each backend runs its own way.

Every backend's member is one (backends/<name>/member.py): transformers, llama.cpp, and llama-server
(its executor sends each call at once, and the server batches). A member in a Ray actor runs a
`Member` there and forwards this API to it (ray/).
"""

from __future__ import annotations

import abc
import contextlib
import threading
from typing import Any, Sequence

import torch

from .context import Counted
from .protocol import PromptScore
from .scheduler import run_call
from .steps import Extend, Prefill, Score
from .view import TokenizerView


class StateMember(Counted, TokenizerView, abc.ABC):
    """The state API over a backend's executor and KV hooks (see the module). A state has `ids`,
    `next_logprobs` and `next_logits` (None after a crop until `ensure_next`) and `scored`
    (score_inline(keep=True)'s (context length, starts, candidates, rows after each))."""

    lock: threading.RLock  # one forward at a time; states and batched caches change under it
    executor: Any  # steps.Executor

    # ---- what a backend supplies ---------------------------------------------------------------
    @abc.abstractmethod
    def new_state(self) -> Any:
        """An empty state."""

    @abc.abstractmethod
    def _cut(self, state: Any, n: int) -> None:
        """Drop the KV of the state's tokens past its first `n` (fewer than it holds)."""

    @abc.abstractmethod
    def _keep_kv(self, state: Any, index: int) -> None:
        """The KV becomes the context's and scored candidate `index`'s; the other candidates' goes."""

    @abc.abstractmethod
    def _drop_kv(self, state: Any) -> None:
        """Drop the KV of the scored candidates."""

    def _fresh(self, state: Any) -> bool:
        """Whether a prompt into `state` runs as a prompt (a Prefill call): it holds nothing yet."""
        return not state.ids

    # ---- prompts -------------------------------------------------------------------------------
    def prefill(self, ids: Sequence[int]) -> Any:
        """A new state holding `ids` (the prompt); its next_logprobs is ready. The state that
        `score_prompt` left for the same ids is handed over instead of running the prompt again."""
        ready = self._take_ready(ids)
        if ready is not None:
            return ready
        self.count_prefill()
        state = self.new_state()
        self.extend(state, ids, last_only=True)
        return state

    def score_prompt(self, ids: Sequence[int], positions: Sequence[int]) -> list[PromptScore]:
        """log p(ids[p] | ids[:p]) and its gap to the row's best, for each position p >= 1, from the
        prompt's prefill (run with other requests' prompts). The prefilled state is kept for the
        next `prefill` of the same ids, so a request that scores its prompt runs it once."""
        if not ids:
            raise ValueError("score_prompt() needs at least one token id")
        self.ready_slot(take=True)
        self.count_prefill()
        state = self.new_state()
        scores = run_call(Prefill(self, state, ids=[int(i) for i in ids], positions=[int(p) for p in positions]))
        self.ready_slot(state)
        return scores

    # ---- tokens --------------------------------------------------------------------------------
    def extend(self, state: Any, ids: Sequence[int], last_only: bool = False) -> torch.Tensor:
        """Append `ids` to the state in one forward; log-probs [len(ids), V] (row i predicts the
        token after ids[i]), or only the last row [1, V] with `last_only` (a prompt: with Gemma's
        262k vocabulary, every position's row would cost 1 MB)."""
        if not ids:
            raise ValueError("extend() needs at least one token id")
        ids = [int(i) for i in ids]
        self.drop_candidates(state)
        if len(ids) > 1 and last_only and self._fresh(state):
            return run_call(Prefill(self, state, ids=ids))
        return run_call(Extend(self, state, tokens=ids, last_only=last_only))

    def crop(self, state: Any, n: int) -> None:
        """Roll the state back to its first `n` tokens. next_logprobs becomes unknown (None) unless
        nothing was removed; `ensure_next` recomputes it."""
        self.drop_candidates(state)
        if not 0 <= n <= len(state.ids):
            raise ValueError(f"crop({n}) out of range for a state of {len(state.ids)} tokens")
        if n == len(state.ids):
            return
        self._cut(state, n)
        del state.ids[n:]
        state.next_logprobs = state.next_logits = None

    def ensure_next(self, state: Any) -> torch.Tensor:
        """log p(. | state.ids), recomputing the last position after a crop."""
        if state.next_logprobs is None:
            last = state.ids[-1]
            self.crop(state, len(state.ids) - 1)
            self.extend(state, [last])
        return state.next_logprobs

    @contextlib.contextmanager
    def scratch(self, state: Any):
        """Tokens extended inside the block are a draft: on exit the state is cropped back and
        `next_logprobs` / `next_logits` are exactly what they were before (no recompute)."""
        base = len(state.ids)
        self.ensure_next(state)
        saved = (state.next_logprobs, state.next_logits)
        try:
            yield state
        finally:
            self.crop(state, base)
            state.next_logprobs, state.next_logits = saved

    # ---- specfuse's candidates -----------------------------------------------------------------
    def score_inline(
        self, state: Any, candidates: Sequence[Sequence[int]], raw_logits: bool = False, keep: bool = False
    ) -> list[torch.Tensor]:
        """Log-prob (or, with `raw_logits`, the raw logit) of every token of each candidate
        continuation of `state`, all candidates in one forward, each seeing the context and itself
        only. The state is left as it was; with `keep`, the candidates' KV stays until
        `keep_candidate` (one of them becomes the continuation with no forward) or `drop_candidates`."""
        if not candidates or any(len(c) == 0 for c in candidates):
            raise ValueError("score_inline needs non-empty candidates")
        self.drop_candidates(state)
        self.ensure_next(state)
        cands = [[int(t) for t in c] for c in candidates]
        logits = run_call(Score(self, state, cands=cands))  # with the other requests' steps of this member
        return self.scored(state, cands, logits, raw_logits, keep)

    def scored(
        self, state: Any, cands: list[list[int]], logits: torch.Tensor, raw_logits: bool, keep: bool
    ) -> list[torch.Tensor]:
        """score_inline's answer from the scoring forward's `logits` [total, V]. Of `logits` only the
        row after each candidate is kept until keep_candidate (its next distribution), and each
        token's log-prob is its logit less its row's logsumexp, with no log-softmax of the rows made
        (Gemma-3, two 10-token candidates: 2 MB kept per request instead of 21 MB)."""
        starts = [sum(len(c) for c in cands[:i]) for i in range(len(cands))]
        after = logits[[s + len(c) - 1 for s, c in zip(starts, cands)]].float()  # keep_candidate's next rows
        state.scored = (len(state.ids), starts, cands, after)
        if not keep:
            self.drop_candidates(state)
        first = state.next_logits if raw_logits else state.next_logprobs
        out = []
        for s, c in zip(starts, cands):
            rows = logits[s : s + len(c) - 1].float()
            got = rows.gather(1, torch.tensor(c[1:], dtype=torch.long, device=rows.device)[:, None])[:, 0]
            if not raw_logits:
                got = got - torch.logsumexp(rows, dim=-1)
            out.append(torch.cat([first[c[0]].reshape(1).float(), got]))
        return out

    def keep_candidate(self, state: Any, index: int) -> None:
        """After score_inline(keep=True): the state becomes context + candidate `index` and its
        next_logprobs the distribution after it, all from the scoring forward."""
        _, _, cands, after = state.scored
        self._keep_kv(state, index)
        state.ids.extend(cands[index])
        self._set_next(state, after[index])
        state.scored = None

    def _set_next(self, state: Any, logits: Any) -> None:
        """The state's next distribution from a kept candidate's row after it (raw logits here)."""
        state.next_logits = logits
        state.next_logprobs = torch.log_softmax(logits, dim=-1)

    def drop_candidates(self, state: Any) -> None:
        """Remove the KV of candidates kept by score_inline(keep=True) (no-op otherwise)."""
        if state.scored is not None:
            self._drop_kv(state)
            state.scored = None
