"""`specfuse`: SpecFuse / SpecEM (arXiv 2412.07380): every member drafts a segment, every member
scores every segment in one forward, the best weighted segment is kept; Hedge weights online.

One round:
1. draft: each active member drafts up to `segment_len` tokens on its own KV cache (sampling or
   greedy); a draft that ends mid-word is cut back to its last space (unless it ended with EOS),
   and to complete UTF-8; the cache is then cropped back to the shared text. Members on different
   devices draft in parallel threads, and so do llama.cpp members on the CPU while the request
   runs alone (methods/side.py); otherwise they take turns (they would only contend).
2. verify in-line: each member scores all candidates in ONE forward on top of its cached context
   (`Member.score_inline`: candidates re-tokenized by that member, block attention mask, position
   ids restarting at the context length). The context's KV cache is reused across rounds.
3. score: S[v, c] = mean token log-prob of candidate c under member v (plus its EOS when the
   draft ended there), turned into a per-token geometric-mean probability exp(S) and L1-normalised
   over the candidates. `score="logit"` uses the mean raw logit instead (the released code), L1-
   normalised after shifting so the smallest is positive.
4. Hedge: reward r_i = #{(j, k): j != i, k != i, S[j, i] >= S[j, k]} / (K - 1)^2 (how the other
   members rank i's candidate), w <- w * exp(eta_t * r) with eta_t = hedge_lr * sqrt(1/K) / t,
   normalised; updated before this round's selection, as in the released code; reset per request.
5. select c* = argmax_c sum_v w_v S[v, c]; members whose weight falls below `exit_threshold` stop
   drafting for the rest of the request (they keep verifying; the best member never exits).
6. every member extends its cache with its canonical tokenization of the new text; the segment is
   streamed at once; stop on the winner's EOS or the token budget (in the first member's tokens).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

from ..errors import ConfigError
from ..members.protocol import LOGITS
from ..members.rows import pick_token
from .align import CanonicalView, valid_utf8_prefix, vocab_index
from .base import EVIDENCE, SOLO, Method, Request, RunStats, check_evidence, check_solo
from .side import SideBySide
from .text import Utf8Releaser
from .unite import check_ensemble_members, check_weights

SCORES = ("logprob", "logit")


@dataclass
class SpecFuseConfig:
    segment_len: int = 10
    score: str = "logprob"
    hedge: bool = True
    hedge_lr: float = 1.0
    exit_threshold: float | None = None
    weights: list[float] | str | None = "auto"  # initial member weights: "auto" (calibrated), None (uniform), a list
    solo: float | None = SOLO  # weights="auto": run a member alone where it holds this weight (evidence.py)
    evidence: float = EVIDENCE  # weights="auto": how far the shown answers move the weights (evidence.py)
    exam: bool = True  # weights="auto": a member that writes none of the shown answers steps aside (evidence.py)

    def __post_init__(self) -> None:
        check_solo(self.solo, "SpecFuseConfig")
        check_evidence(self.evidence, "SpecFuseConfig")
        if not isinstance(self.exam, bool):
            raise ConfigError(f"SpecFuseConfig.exam must be True or False, got {self.exam!r}")
        if not isinstance(self.segment_len, int) or self.segment_len < 1:
            raise ConfigError(f"SpecFuseConfig.segment_len must be an integer >= 1, got {self.segment_len!r}")
        if self.score not in SCORES:
            raise ConfigError(f"SpecFuseConfig.score must be one of {SCORES}, got {self.score!r}")
        if (
            isinstance(self.hedge_lr, bool)
            or not isinstance(self.hedge_lr, (int, float))
            or not 0 < self.hedge_lr < math.inf
        ):
            raise ConfigError(f"SpecFuseConfig.hedge_lr must be a finite number > 0, got {self.hedge_lr!r}")
        if self.exit_threshold is not None and (
            not isinstance(self.exit_threshold, (int, float)) or not 0 < self.exit_threshold < 1
        ):
            raise ConfigError(f"SpecFuseConfig.exit_threshold must be in (0, 1) or None, got {self.exit_threshold!r}")
        check_weights(self.weights, None, "SpecFuseConfig")


@dataclass
class Draft:
    member: int
    text: bytes  # the segment after cutting (complete UTF-8)
    eos: bool  # the draft ended with the member's EOS (and was not cut)
    stopped: bool = False  # the draft ends with a stop string (cut right after it)


def cut_draft(data: bytes, eos: bool) -> bytes:
    """A draft's kept bytes: complete UTF-8, and, unless it ended with EOS, no trailing partial
    word (cut before the last space when it ends in a letter or digit and has a space to cut at)."""
    data = data[: valid_utf8_prefix(data)]
    if eos:
        return data
    text = data.decode("utf-8")
    if text and re.match(r"\w", text[-1]):
        cut = max(text.rfind(" "), text.rfind("\n"))
        if cut > 0:
            text = text[:cut]
    return text.encode("utf-8")


def hedge_rewards(scores: torch.Tensor, owners: list[int]) -> torch.Tensor:
    """scores [V verifiers, C candidates], owners[c] = the member (verifier index) that drafted c
    -> reward per candidate: the fraction of (verifier j != owner, other candidate c') pairs in
    which j scores c at least as high as c'. With every member drafting this is SpecEM's
    wins_i / (K - 1)^2."""
    v, c = scores.shape
    out = torch.zeros(c, dtype=torch.float64)
    denom = (v - 1) * (c - 1)
    if denom <= 0:
        return out
    for a in range(c):
        wins = sum(1 for j in range(v) if j != owners[a] for b in range(c) if b != a and scores[j, a] >= scores[j, b])
        out[a] = wins / denom
    return out


def hedge_update(weights: torch.Tensor, rewards: torch.Tensor, eta: float) -> torch.Tensor:
    w = weights * torch.exp(eta * rewards)
    return w / w.sum()


def normalise(scores: torch.Tensor, mode: str) -> torch.Tensor:
    """Per verifier row, candidates' scores -> non-negative, summing to one."""
    if mode == "logprob":
        g = torch.exp(scores)  # geometric-mean token probability, in (0, 1]
    else:  # raw-logit means can be negative: shift each row so its smallest is a small positive
        g = scores - scores.min(dim=1, keepdim=True).values + 1e-6
    return g / g.sum(dim=1, keepdim=True)


@dataclass
class SpecFuseStats(RunStats):
    rounds: int = 0  # draft-score rounds
    wins: dict[str, int] = field(default_factory=dict)  # rounds won per member
    drafts_saved: int = 0  # drafts not written by members that exited (exit_threshold)
    segment_tokens: list[int] = field(default_factory=list)  # tokens kept per round
    kept_scored_kv: int = 0  # member-rounds whose scoring forward's KV was kept (no re-sync)
    weights: dict[str, float] = field(default_factory=dict)  # Hedge weights at the end
    active: dict[str, bool] = field(default_factory=dict)  # members still drafting at the end

    @classmethod
    def summarize(cls, runs: list[RunStats]) -> dict[str, Any]:
        names = list(runs[0].weights) if runs else []
        return {"hedge_weights_mean": {n: sum(r.weights[n] for r in runs) / len(runs) for n in names}}


class SpecFuse(Method):
    name = "specfuse"
    config_class = SpecFuseConfig
    stats_class = SpecFuseStats

    def check_members(self) -> None:
        check_ensemble_members(self.name, self.members, 0, "SpecFuseConfig.members", self.config.weights)

    def main_member(self) -> int | None:
        return None  # the strongest member counts the budget

    def needs(self) -> frozenset[str]:
        return frozenset({LOGITS}) if self.config.score == "logit" else frozenset()

    def scoring_f(self, weights, prior, aside) -> tuple[float, list[float]]:
        return 0.0, list(weights)  # a segment's score adds the members' weighted log-probabilities: the product

    # ---- one member's draft --------------------------------------------------------------
    def _draft(
        self,
        i: int,
        view: CanonicalView,
        n: int,
        req: Request,
        gen: torch.Generator | None,
        text: bytes = b"",
        left: int | None = None,
    ) -> Draft:
        """Member i drafts up to n tokens after the shared `text`, ending early at its EOS or at a
        stop string (cut right after it: nothing past a stop is drafted or scored). Under a grammar
        with `left` tokens of budget, the draft also ends before a token after which the shortest
        completion would no longer fit (counted in member i's tokens: an estimate of the main's)."""
        m, state = view.member, view.state
        idx = vocab_index(m)
        data, eos, stop_at = b"", False, None
        guide, plen, done = req.guide, view.prompt_len, 0

        def pick(row):
            return pick_token(row, req.temperature, req.top_p, gen)

        with m.scratch(state):  # the draft's tokens leave the cache as it was
            while done < n:
                forced = guide.take_forced(i, state.ids[plen:], n - done) if guide else []
                if forced:  # the grammar forces these tokens: drafted without sampling
                    new = forced
                else:
                    if guide and left is not None:
                        tok = guide.choose(i, state.ids[plen:], state.next_logprobs, left - done, pick)
                        if tok is None:
                            break
                    elif guide:
                        tok = pick(guide.mask_row(i, state.ids[plen:], state.next_logprobs))
                    else:
                        tok = pick(state.next_logprobs)
                    if tok in m.eos_ids:
                        eos = True
                        break
                    new = [tok]
                key = b"".join(idx.key_of(t) for t in new)
                data += key
                done += len(new)
                stop_at = req.stops.end(text + data, len(text) + len(data) - len(key))
                if stop_at is not None:
                    data = data[: stop_at - len(text)]
                    break
                if guide and guide.token_done(i, state.ids[plen:] + new):  # nothing may follow: the draft ends
                    eos = True
                    break
                if done < n:
                    m.extend(state, new)
        if stop_at is not None:
            return Draft(i, data, False, stopped=True)
        return Draft(i, cut_draft(data, eos) if data or eos else b"", eos)

    def _score(self, view: CanonicalView, drafts: list[Draft]) -> tuple[list[float], list[list[int]]]:
        """Member `view` scores every draft in one forward; the candidates' KV stays in its cache
        so the winner's can be kept (see `_advance`). Returns the scores and the token ids."""
        m = view.member
        eos = m.eos_id
        cands = []
        for d in drafts:
            ids = m.encode(d.text.decode("utf-8")) if d.text else []
            if d.eos and eos is not None:
                ids = ids + [eos]
            cands.append(ids)
        out = m.score_inline(view.state, cands, raw_logits=self.config.score == "logit", keep=True)
        return [float(x.mean()) for x in out], cands

    @staticmethod
    def _advance(view: CanonicalView, decoded: str, old: int, ids: list[int], index: int) -> bool:
        """Extend member `view` by the chosen segment. When the member's canonical tokenization
        of the whole text is its old tokens + the winner's tokens as it scored them, the KV the
        scoring forward computed for them is kept (no forward); otherwise the view re-syncs.
        Returns whether the scored KV was kept."""
        m, state = view.member, view.state
        if ids and state.ids[view.prompt_len :] + ids == m.encode(decoded):
            m.keep_candidate(state, index)
            return True
        m.drop_candidates(state)
        view.sync(decoded, from_byte=old)
        return False

    def run(self, req: Request) -> Iterator[str]:
        r = _FuseRun(self, req)
        try:
            while r.st.tokens_out < req.max_new_tokens:
                piece, done = r.round()
                if piece:
                    yield piece
                if done:
                    break
                r.advance()
        finally:
            r.close()


class _FuseRun:
    """One request's SpecFuse run, round by round: every active member drafts a segment, every
    member scores every draft, the Hedge weights move, the best-scored draft is committed."""

    def __init__(self, method: SpecFuse, req: Request) -> None:
        members = method.members
        self.method, self.cfg, self.req, self.members, self.k = method, method.config, req, members, len(members)
        self.views = [CanonicalView.start(m, ids) for m, ids in zip(members, req.prompt_ids)]
        self.main = members[req.main]
        w = torch.tensor(req.weights or [1.0] * self.k, dtype=torch.float64)
        self.w = w / w.sum()
        self.active = [True] * self.k
        self.st = req.stats = SpecFuseStats(wins={m.name: 0 for m in members})
        self.side = SideBySide(members)  # members apart, or sharing the CPU, draft and score in parallel threads
        parallel = self.side.on
        # one generator per member when drafting in parallel, so sampling stays reproducible
        self.gens = [req.generator] * self.k
        if parallel and req.generator is not None and req.temperature > 0:
            seed = int(torch.randint(0, 2**62, (), generator=req.generator))
            self.gens = [torch.Generator().manual_seed(seed + i) for i in range(self.k)]
        self.text, self.guide, self.must_close = b"", req.guide, False
        self.last = None  # what `advance` needs from the round that just committed
        self.emit = Utf8Releaser()  # the winners are whole characters: each is released as it is committed
        if self.guide:
            self.guide.check_budget(req.main, req.max_new_tokens)

    def map(self, fn, items) -> list:
        """fn over items: side by side when the members gain by it (methods/side.py)."""
        return self.side.map(fn, items)

    def round(self) -> tuple[str, bool]:
        """One round up to its commit: (the text committed, whether the reply ends). The members
        move past the committed text in `advance`, once the caller has taken it."""
        req, st, guide, cfg = self.req, self.st, self.guide, self.cfg
        self.last = None
        left = req.max_new_tokens - st.tokens_out
        tail = guide.closing(req.main, self.text, 0 if self.must_close else left) if guide else None
        if tail is not None or self.must_close:  # the budget holds just the shortest completion
            tail = tail or b""
            ids = guide.spell(req.main, tail)[:left]
            st.tokens_out += len(ids)
            st.segment_tokens.append(len(ids))
            self.text += tail
            return self.emit.take(self.text, final=True), True  # cut by the budget, but closed: "length"
        st.rounds += 1
        n, room, text = min(cfg.segment_len, left), left if guide else None, self.text
        todo = [i for i in range(self.k) if self.active[i]]
        st.drafts_saved += self.k - len(todo)
        drafts = self.map(lambda i: self.method._draft(i, self.views[i], n, req, self.gens[i], text, room), todo)
        drafts = [d for d in drafts if d.text or d.eos]
        if not drafts and guide:  # no member could write a token that leaves room to close
            self.must_close = True
            return "", False
        if not drafts:  # every member drafted only bytes that cannot stand alone
            req.finish_reason = "stop"
            return "", True
        scored = self.map(lambda v: self.method._score(v, drafts), self.views)
        best_i = self.select(drafts, scored)
        best = drafts[best_i]
        seg, ids, eos = self.fit(best)
        st.tokens_out += len(ids)
        st.segment_tokens.append(len(ids))
        old = len(self.text)
        self.text += seg
        piece = self.emit.take(self.text)
        if eos or (best.stopped and seg == best.text):
            req.finish_reason = "stop"
            return piece, True
        if st.tokens_out >= req.max_new_tokens:
            return piece, True
        self.last = (seg, best, best_i, scored, old)
        return piece, False

    def advance(self) -> None:
        """Every member past the committed segment: the scored KV of the winner kept where its
        tokenization matches, else a re-sync; nothing when the round committed nothing."""
        if self.last is None:
            return
        seg, best, best_i, scored, old = self.last
        if seg:
            decoded = self.text.decode("utf-8")
            for v, (_, cands) in zip(self.views, scored):
                self.st.kept_scored_kv += self.method._advance(
                    v, decoded, old, cands[best_i] if seg == best.text else [], best_i
                )
        else:
            for v in self.views:
                v.member.drop_candidates(v.state)

    def select(self, drafts: list[Draft], scored: list) -> int:
        """The Hedge step on the round's scores and the winning draft's index; members whose
        weight fell below `exit_threshold` stop drafting."""
        cfg, k, st = self.cfg, self.k, self.st
        raw = torch.tensor([sc for sc, _ in scored], dtype=torch.float64)  # [K, C]
        s = normalise(raw, cfg.score)
        owners = [d.member for d in drafts]
        if cfg.hedge and len(drafts) > 1:
            eta = cfg.hedge_lr * math.sqrt(1.0 / k) / st.rounds
            gain = torch.zeros(k, dtype=torch.float64)  # members not drafting keep their weight
            gain[owners] = hedge_rewards(s, owners)
            self.w = hedge_update(self.w, gain, eta)
        total = (self.w[:, None] * s).sum(dim=0)  # [C]
        best_i = int(torch.argmax(total))
        st.wins[self.members[drafts[best_i].member].name] += 1
        if cfg.exit_threshold is not None:
            for i in range(k):
                if self.active[i] and self.w[i] < cfg.exit_threshold and i != int(torch.argmax(self.w)):
                    self.active[i] = False
        return best_i

    def fit(self, best: Draft) -> tuple[bytes, list[int], bool]:
        """The winner as committed: cut at a token boundary to the budget (counted in the main
        member's tokens) and, under a grammar, to what leaves room for the shortest completion."""
        req, guide = self.req, self.guide
        seg = best.text
        ids, ends = self.main.encode_with_offsets(seg.decode("utf-8")) if seg else ([], [])
        room = req.max_new_tokens - self.st.tokens_out
        eos = best.eos
        if len(ids) > room:
            seg = seg[: valid_utf8_prefix(seg[: ends[room - 1]])]
            ids, eos = ids[:room], False
        while guide and ids and not eos and not guide.fits(req.main, self.text + seg, room - len(ids)):
            # the shortest completion after the winner would not fit: cut the winner at its
            # last token boundary that leaves room, and close next round
            ids = ids[:-1]
            seg = seg[: valid_utf8_prefix(seg[: ends[len(ids) - 1]])] if ids else b""
            self.must_close = True
        return seg, ids, eos

    def close(self) -> None:
        self.side.close()
        self.st.weights = {m.name: round(float(x), 4) for m, x in zip(self.members, self.w)}
        self.st.active = {m.name: a for m, a in zip(self.members, self.active)}
