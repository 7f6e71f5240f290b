"""A byte-level language model from a token-level member (the genlm-bytes construction, our code).

Why our own and not `genlm-bytes`: genlm-bytes drives its own LM backends through an async-only
API and steps the prompt byte by byte; SMC here needs every member's forwards batched across
particles on our KV caches, the prompt prefilled once at token level, and K >= 2 members.

The pieces:
- `VocabTrie`: the member's vocabulary as byte strings, sorted. A trie node is a byte prefix; the
  tokens below it are one contiguous range of the sorted list, so the probability mass under any
  node is a difference of one cumulative sum (`Context.cs`). Special tokens are left out (never
  spelled byte by byte); EOS ids become the end-of-sequence slot.
- `Context`: a token context (the prompt, then generated tokens), a tree shared by all beams and
  particles: each node holds its token's KV slice and, once computed, log p(. | context).
- `Beam`: hypotheses (context, partial token bytes) after a byte string x, each weighted by
  P(context) * mass(partial token). Their sum is the prefix probability P(x) marginalised over
  tokenizations. `ByteLM.next_logprobs` gives p(b | x) over 257 slots (256 bytes + EOS) for many
  beams at once, with one batched forward per call for all new contexts; `ByteLM.advance` consumes
  a byte. Beams keep `beam_width` hypotheses; when none can take a byte, the best one is healed by
  committing its partial token bytes as real tokens.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from typing import Any, Protocol, Sequence

import numpy as np
import torch

from .rows import Ready
from .vocab import Vocab, VocabTrie


class TreeMember(Protocol):
    """What a byte LM asks of its member (backends/transformers/member.py's `Member`, which builds its byte LMs
    from this module; llama.py's byte LM overrides the forwards)."""

    executor: Any  # steps.Executor
    vocab: Vocab

    def prefill(self, ids: Sequence[int]) -> Any: ...
    def kv_tensor(self, state: Any) -> torch.Tensor: ...
    def forward_rows(
        self, prefix_kv: torch.Tensor, paths: Sequence[Sequence[torch.Tensor]], tokens: Sequence[int]
    ) -> tuple[torch.Tensor, list[torch.Tensor]]: ...


EOS = 256  # index of the end-of-sequence slot in next-byte vectors (257 slots)
LOG_RESCUE = math.log(1e-4)  # a deferred fresh hypothesis is taken in above this share of a needed byte
NEG_INF = -math.inf


class Context:
    """A token context in the tree shared by beams and particles."""

    __slots__ = ("parent", "token", "depth", "kv", "cs", "root_mass", "p_eos", "children", "__weakref__")

    def __init__(self, parent: "Context | None", token: int | None, kv: torch.Tensor | None = None) -> None:
        self.parent, self.token, self.kv = parent, token, kv
        self.depth = 0 if parent is None else parent.depth + 1
        self.cs: np.ndarray | None = None  # cumulative probabilities in trie order, [n+1] float64
        self.root_mass: np.ndarray | None = None  # [256] mass of tokens starting with byte b
        self.p_eos = 0.0
        # weak: a child nobody's hypothesis points to any more (pruned) is freed with its KV
        self.children: weakref.WeakValueDictionary[int, Context] = weakref.WeakValueDictionary()

    def child(self, token: int) -> "Context":
        c = self.children.get(token)
        if c is None:
            c = self.children[token] = Context(self, token)
        return c

    def path(self) -> list[torch.Tensor]:
        """KV slices of the generated tokens, oldest first (the prompt is the root's kv)."""
        out, node = [], self
        while node.parent is not None:
            out.append(node.kv)
            node = node.parent
        return out[::-1]

    def mass(self, lo: int, hi: int) -> float:
        return max(float(self.cs[hi] - self.cs[lo]), 0.0)


@dataclass(frozen=True)
class Hyp:
    ctx: Context
    partial: bytes  # bytes of the current, unfinished token (b"" only at a fresh context)
    logp_ctx: float  # log P(ctx tokens after the prompt)
    logw: float  # log P(ctx) + log mass(partial)


class Beam:
    """Hypotheses after some byte string; immutable once built (particles share beams)."""

    __slots__ = ("hyps", "cands", "logq", "spare")

    def __init__(self, hyps: list[Hyp]) -> None:
        self.hyps = hyps
        self.cands: list[Hyp] | None = None  # set by ByteLM.next_logprobs
        self.logq: np.ndarray | None = None
        self.spare: Hyp | None = None  # the fresh hypothesis left out, when its forward is deferred

    @property
    def tokens(self) -> int:
        """Tokens written so far by the best hypothesis (a started partial token counts)."""
        if not self.hyps:
            return 0
        h = max(self.hyps, key=lambda h: h.logw)
        return h.ctx.depth + (1 if h.partial else 0)


def _log(x: float) -> float:
    return math.log(x) if x > 0 else NEG_INF


class ByteLM:
    """One member as a byte-level LM over 257 slots, for many beams at once."""

    def __init__(
        self,
        member: TreeMember,
        beam_width: int = 5,
        prune_threshold: float = 0.0,
        temperature: float = 1.0,
        keep_fresh: bool | str = False,
    ) -> None:
        self.member = member
        # keep_fresh: always keep the best "token ends here" hypothesis, however light. Under a
        # grammar the bytes only it can write may be the only allowed ones (a digit after '": '
        # when digits are separate tokens); pruned, they would get probability 0 and every
        # allowed continuation would die. keep_fresh="lazy" (scoring): keep it without its forward,
        # and take it in only where a byte the caller needs would move (`next_logprobs(need=...)`).
        self.keep_fresh = keep_fresh is True
        self.defer_fresh = keep_fresh == "lazy"
        self.beam_width = beam_width
        self.log_prune = _log(prune_threshold) if prune_threshold > 0 else NEG_INF
        self.temperature = temperature
        self.trie = byte_trie(member)
        self.heals = 0
        self.prefix_kv: torch.Tensor | None = None
        self.prompt_state = None  # the member's state after the prompt (`start`), for a scorer's own forwards
        self._filled: list[weakref.ref[Context]] = []
        self._root_starts = self.trie.node(b"").starts

    # ---- contexts --------------------------------------------------------------------------
    def _fill(self, ctxs: list[Context], logits: torch.Tensor) -> None:
        """Set each context's distribution from raw logits [B, V] (tempered, specials removed)."""
        order, eos = self.trie.order.to(logits.device), self.trie.eos.to(logits.device)
        allowed = logits.index_select(1, order).double() / self.temperature
        eos_l = (
            logits.index_select(1, eos).double() / self.temperature
            if len(eos)
            else allowed.new_full((len(ctxs), 1), NEG_INF)
        )
        lse = torch.logsumexp(torch.cat([allowed, eos_l], dim=1), dim=1, keepdim=True)
        p = torch.exp(allowed - lse)
        cs = torch.cat([p.new_zeros(len(ctxs), 1), torch.cumsum(p, dim=1)], dim=1).cpu().numpy()
        p_eos = torch.exp(eos_l - lse).sum(dim=1).cpu().numpy()
        st = self._root_starts
        self._filled += [weakref.ref(c) for c in ctxs]
        for r, ctx in enumerate(ctxs):
            ctx.cs = cs[r]
            ctx.root_mass = np.maximum(cs[r][st[1:]] - cs[r][st[:-1]], 0.0)
            ctx.p_eos = float(p_eos[r])

    def materialize(self, ctxs: list[Context]) -> None:
        """Compute log p(. | ctx) for contexts that lack it: one batched forward over all of them."""
        todo = self._todo(ctxs)
        if todo:
            self._apply(todo, *self._run_tree(todo))

    @staticmethod
    def _todo(ctxs: list[Context]) -> list[Context]:
        """The distinct contexts of `ctxs` that lack their distribution."""
        todo, seen = [], set()
        for c in ctxs:
            if c.cs is None and id(c) not in seen:
                seen.add(id(c))
                todo.append(c)
        # every parent is computed before its children (the beam only ever adds one token)
        assert all(c.parent.parent is None or c.parent.kv is not None for c in todo)
        return todo

    def _tree(self, todo: list[Context]) -> tuple:
        """The tree call (steps.Tree) that computes `todo`: (prefix_kv, paths, tokens)."""
        return self.prefix_kv, [c.parent.path() for c in todo], [c.token for c in todo]

    def _run_tree(self, todo: list[Context]) -> tuple:
        """(raw logits [len(todo), V], each context's new KV) from one forward of the member."""
        return self.member.forward_rows(*self._tree(todo))

    def _apply(self, todo: list[Context], logits: torch.Tensor, kvs: list[torch.Tensor]) -> None:
        for c, kv in zip(todo, kvs):
            c.kv = kv
        self._fill(todo, logits)

    def compact(self, beams: Sequence[Beam]) -> None:
        """Free the distributions of contexts no hypothesis of `beams` stands on (their ancestors
        keep only their KV): memory stays at about beam_width x particles distributions."""
        live = {id(h.ctx) for b in beams for h in b.hyps}
        kept = []
        for ref in self._filled:
            c = ref()
            if c is None or c.cs is None:
                continue
            if id(c) in live:
                kept.append(ref)
            else:
                c.cs = c.root_mass = None
        self._filled = kept

    def start(self, prompt_ids: Sequence[int]) -> Beam:
        """Prefill the prompt at token level (its canonical tokens, once) and return the empty beam."""
        state = self.prompt_state = self.member.prefill(prompt_ids)
        self.prefix_kv = self.member.kv_tensor(state)
        root = Context(None, None)
        self._fill([root], state.next_logits[None])
        return Beam([Hyp(root, b"", 0.0, 0.0)])

    # ---- bytes -----------------------------------------------------------------------------
    def _candidates(self, beam: Beam) -> list[Hyp]:
        """Split every hypothesis into 'the token goes on' and 'the token ends here, a new one
        starts' (one per token spelling exactly the partial bytes), then keep the best few (a
        fresh one left out is the beam's `spare` when its forward is deferred)."""
        out = []
        for h in beam.hyps:
            if not h.partial:
                out.append(h)
                continue
            node = self.trie.node(h.partial)
            ctx = h.ctx
            go_on = ctx.mass(node.end, node.hi)
            if go_on > 0:
                out.append(Hyp(ctx, h.partial, h.logp_ctx, h.logp_ctx + math.log(go_on)))
            for pos in range(node.lo, node.end):
                p = ctx.mass(pos, pos + 1)
                if p > 0:
                    lp = h.logp_ctx + math.log(p)
                    out.append(Hyp(ctx.child(self.trie.ids[pos]), b"", lp, lp))
        out.sort(key=lambda h: -h.logw)
        kept = out[: self.beam_width]
        if out and self.log_prune > NEG_INF:
            floor = out[0].logw + self.log_prune
            kept = [h for h in kept if h.logw >= floor]
        beam.spare = None
        if not any(not h.partial for h in kept):
            # keep the best fresh-token hypothesis as well: from a token boundary every byte the
            # vocabulary can write has probability > 0, so a narrow beam never rules text out.
            # With a prune threshold it must clear the same floor as every other hypothesis:
            # inside a word the "token ends here" split weighs far below 1/1000 of the best, and
            # keeping it anyway cost one forward per byte instead of about one per token (the
            # bytes only it could write carry less than the threshold; `advance` heals if one
            # is taken all the same).
            fresh = next((h for h in out if not h.partial), None)
            if fresh is not None and (
                self.keep_fresh or self.log_prune == NEG_INF or fresh.logw >= out[0].logw + self.log_prune
            ):
                kept.append(fresh)
            elif self.defer_fresh:
                beam.spare = fresh
        return kept

    def _logq(self, cands: list[Hyp]) -> np.ndarray:
        rows = []
        for h in cands:
            row = np.full(257, NEG_INF)
            with np.errstate(divide="ignore"):
                if not h.partial:
                    row[:256] = h.logw + np.log(h.ctx.root_mass)
                    row[EOS] = h.logw + _log(h.ctx.p_eos)
                else:
                    st = self.trie.node(h.partial).starts
                    cs = h.ctx.cs
                    row[:256] = h.logp_ctx + np.log(np.maximum(cs[st[1:]] - cs[st[:-1]], 0.0))
            rows.append(row)
        if not rows:
            return np.full(257, NEG_INF)
        m = np.logaddexp.reduce(np.stack(rows), axis=0)
        total = np.logaddexp.reduce(m)
        return m - total if total > NEG_INF else m

    def next_logprobs_async(self, beams: Sequence[Beam], need: Sequence[set[int]] | None = None) -> Ready:
        """`next_logprobs` as an answer with `.get()` (the form a member in an actor answers in)."""
        return Ready(self.next_logprobs(beams, need))

    def next_logprobs(self, beams: Sequence[Beam], need: Sequence[set[int]] | None = None) -> np.ndarray:
        """log p(b | x) for every beam, [len(beams), 257]; all new contexts in one forward.
        `need`: per beam, the bytes the caller will read (a scorer's texts), which a deferred
        fresh hypothesis must not leave wrong."""
        self.materialize(self._needed(beams))
        out = self._answers(beams)
        if need is not None and self.defer_fresh:
            self._rescue(beams, need, out)
        return out

    def _rescue(self, beams: Sequence[Beam], need: Sequence[set[int]], out: np.ndarray) -> None:
        """Take in each beam's deferred fresh hypothesis where it could move a needed byte's
        log-probability by more than LOG_RESCUE (relative), their contexts in one forward."""
        late = []
        for i, (beam, wanted) in enumerate(zip(beams, need)):
            h = beam.spare
            if h is not None:
                rel = h.logw - np.logaddexp.reduce([c.logw for c in beam.cands])  # its share of the beam
                if any(rel - out[i, b] > LOG_RESCUE for b in wanted):
                    late.append(i)
        for i in late:
            beam = beams[i]
            if beam.spare is not None:  # a beam may stand at several indices
                beam.cands, beam.spare, beam.logq = beam.cands + [beam.spare], None, None
        if late:
            self.materialize(self._todo([h.ctx for i in late for h in beams[i].cands]))
            out[late] = self._answers([beams[i] for i in late])

    def _needed(self, beams: Sequence[Beam]) -> list[Context]:
        """The contexts the beams' candidates stand on that lack their distribution."""
        need = []
        for beam in beams:
            if beam.cands is None:
                beam.cands = self._candidates(beam)
                need += [h.ctx for h in beam.cands if h.ctx.cs is None]
        return self._todo(need)

    def _answers(self, beams: Sequence[Beam]) -> np.ndarray:
        out = np.empty((len(beams), 257))
        for i, beam in enumerate(beams):
            if beam.logq is None:
                beam.logq = self._logq(beam.cands)
            out[i] = beam.logq
        return out

    def advance(self, beam: Beam, b: int) -> Beam:
        """The beam after byte b (0..255); heals when no hypothesis can take it."""
        if beam.cands is None:
            self.next_logprobs([beam])
        hyps = []
        for h in beam.cands:
            if not h.partial:
                m = float(h.ctx.root_mass[b])
                if m > 0:
                    hyps.append(Hyp(h.ctx, bytes([b]), h.logp_ctx, h.logp_ctx + math.log(m)))
                continue
            part = h.partial + bytes([b])
            node = self.trie.node(part)
            if node is not None:
                m = h.ctx.mass(node.lo, node.hi)
                if m > 0:
                    hyps.append(Hyp(h.ctx, part, h.logp_ctx, h.logp_ctx + math.log(m)))
        if not hyps and beam.cands:
            hyps = self._heal(max(beam.cands, key=lambda h: h.logw), b)
        hyps.sort(key=lambda h: -h.logw)
        return Beam(hyps[: self.beam_width])

    def _heal(self, h: Hyp, b: int) -> list[Hyp]:
        """Commit the hypothesis' partial bytes plus b as real tokens (greedy longest match), so
        the beam goes on; its weight is that one tokenization's probability."""
        self.heals += 1
        data = h.partial + bytes([b])
        try:
            positions = self.trie.split(data)
        except ValueError:  # a byte this vocabulary cannot write: the member gives the text probability 0
            return []
        ctx, lp = h.ctx, h.logp_ctx
        for pos in positions[:-1]:
            self.materialize([ctx])
            p = ctx.mass(pos, pos + 1)
            if p <= 0:
                return []
            lp += math.log(p)
            ctx = ctx.child(self.trie.ids[pos])
        self.materialize([ctx])
        last = self.trie.keys[positions[-1]]
        node = self.trie.node(last)
        m = ctx.mass(node.lo, node.hi)
        return [Hyp(ctx, last, lp, lp + math.log(m))] if m > 0 else []


def next_logprobs_many(asks: Sequence[tuple[ByteLM, Sequence[Beam]]], tallies: list | None = None) -> list[np.ndarray]:
    """`ByteLM.next_logprobs` for several byte LMs of ONE member (several requests' smc), every
    new context of all of them in one step of the member's executor (one tree forward). This is how a
    member's actor batches smc's steps: the requests are in the caller, their byte LMs here."""
    from .scheduler import DEFAULT_CONFIG
    from .steps import Tree

    todos = [lm._needed(beams) for lm, beams in asks]
    live = [i for i, todo in enumerate(todos) if todo]
    if live:
        member = asks[live[0]][0].member
        calls = [
            Tree(member, None, None if tallies is None else tallies[i], tree=asks[i][0]._tree(todos[i])) for i in live
        ]
        member.executor.run(calls, DEFAULT_CONFIG)
        for i, c in zip(live, calls):
            asks[i][0]._apply(todos[i], *c.result)
    return [lm._answers(beams) for lm, beams in asks]


def byte_trie(member: TreeMember) -> VocabTrie:
    """The member's VocabTrie, built once per member (owned by its Vocab)."""
    return member.vocab.trie()
