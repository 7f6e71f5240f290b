"""`safe`: SAFE, "When to Ensemble" (arXiv 2510.15346, ICLR 2026).

Generate -> verify -> ensemble, once per cycle:
1. the drafter drafts `lookahead` tokens on its KV cache;
2. every verifier re-tokenizes the whole generated text (committed + draft) canonically, keeps
   its cached common prefix and runs the rest in ONE forward, reading its next-token
   distribution at each of its token boundaries;
3. drafter position j (the token t_j after byte boundary b) may be ensembled only if b is a token
   boundary of every verifier (t_{j-1} is not OOV-like) and t_j lies in complete UTF-8 text;
4. it is skipped by consensus when every verifier's own next token at b spells the drafter's
   token and the weighted mean over all members of each one's probability of that token >
   `consensus` (with `onto_main=False`, UniTE's union: also where each is its verifier's top-1).
   Theorem 1: at `consensus` >= 1/2 either implies the ensemble argmax is the drafter's token
   (with `onto_main` the top-1 test does not: a verifier's other tokens may add up on another of
   the drafter's tokens, so it is not used);
5. at the first position failing both checks the UniTE distribution is built (sharpened when its
   max < 0.5) and a token picked; if it differs from t_j it replaces it, the rest of the
   lookahead is dropped and the drafter's cache is cropped back to that point (verifiers are
   cropped to their last common boundary at their next sync). Positions where the ensemble agrees
   with the drafter are accepted and checking goes on.
Text is yielded once its cycle is verified: it can no longer be rolled back.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator

import torch

from ..errors import ConfigError
from ..members.rows import pick_token, query_async, take_async
from .align import (
    EOS,
    NEWLINE,
    VocabIndex,
    sharpen,
    start_members,
    top_keys,
    turn_ends,
    union_distribution,
    valid_utf8_prefix,
    vocab_index,
)
from .base import EVIDENCE, SOLO, Method, Request, check_evidence, check_solo
from .text import Utf8Releaser
from .unite import UniteStats, check_ensemble_members, check_main, check_onto_main, check_weights

SHARPEN_MODES = ("heuristic", "geometric", None)


@dataclass
class SafeConfig:
    drafter: int | None = None  # None: the strongest member (largest calibrated weight)
    lookahead: int = 5
    top_k: int = 10
    consensus: float = 0.5
    # None by default: with small members' flat first-token distributions the heuristic pools
    # unrelated words ("L" gained "La", "Le", "L'" and beat "The"; see the README)
    sharpen: str | None = None  # with onto_main, "geometric" is over the members' masses on the drafter's tokens
    sharpen_lambda: float = 0.1
    weights: list[float] | str | None = "auto"  # "auto" (calibrated), None (uniform) or one per member
    # the lookahead follows the acceptance rate (transformers' "heuristic" schedule for assisted
    # decoding): +2 after a cycle whose draft was kept whole, -1 (not below 1) after a replacement;
    # `lookahead` is the start and `max_lookahead` the cap. False keeps `lookahead` fixed.
    adaptive: bool = True
    max_lookahead: int = 16
    solo: float | None = SOLO  # weights="auto": run a member alone where it holds this weight (evidence.py)
    evidence: float = EVIDENCE  # weights="auto": how far the shown answers move the weights (evidence.py)
    exam: bool = True  # weights="auto": a member that writes none of the shown answers steps aside (evidence.py)
    # the union's keys are the drafter's tokens, each member's mass counted once (as UniteConfig.onto_main);
    # then a consensus skip needs the weighted mean above `consensus`, the one test that stays lossless
    onto_main: bool = True

    def __post_init__(self) -> None:
        check_main(self.drafter, "SafeConfig.drafter")
        check_onto_main(self.onto_main, "SafeConfig")
        check_solo(self.solo, "SafeConfig")
        check_evidence(self.evidence, "SafeConfig")
        if not isinstance(self.exam, bool):
            raise ConfigError(f"SafeConfig.exam must be True or False, got {self.exam!r}")
        if isinstance(self.lookahead, bool) or not isinstance(self.lookahead, int) or not 1 <= self.lookahead <= 64:
            raise ConfigError(f"SafeConfig.lookahead must be an integer in [1, 64], got {self.lookahead!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or not 1 <= self.top_k <= 1000:
            raise ConfigError(f"SafeConfig.top_k must be an integer in [1, 1000], got {self.top_k!r}")
        if not isinstance(self.adaptive, bool):
            raise ConfigError(f"SafeConfig.adaptive must be True or False, got {self.adaptive!r}")
        if (
            isinstance(self.max_lookahead, bool)
            or not isinstance(self.max_lookahead, int)
            or not 1 <= self.max_lookahead <= 64
        ):
            raise ConfigError(f"SafeConfig.max_lookahead must be an integer in [1, 64], got {self.max_lookahead!r}")
        if not isinstance(self.consensus, (int, float)) or not 0 <= self.consensus <= 1:
            raise ConfigError(f"SafeConfig.consensus must be in [0, 1], got {self.consensus!r}")
        if self.sharpen not in SHARPEN_MODES:
            raise ConfigError(f"SafeConfig.sharpen must be one of {SHARPEN_MODES}, got {self.sharpen!r}")
        if not isinstance(self.sharpen_lambda, (int, float)) or not 0 <= self.sharpen_lambda < 1:
            raise ConfigError(f"SafeConfig.sharpen_lambda must be in [0, 1), got {self.sharpen_lambda!r}")
        check_weights(self.weights, None, "SafeConfig")


@dataclass
class SafeStats(UniteStats):
    skipped_oov: int = 0  # checked positions after a token no verifier can see as a boundary
    skipped_consensus: int = 0  # positions every verifier agreed with (no ensembling: Theorem 1)
    replacements: int = 0  # ensembled positions whose choice replaced the drafted token
    cycles: int = 0  # draft-verify cycles
    skipped_incomplete_utf8: int | None = None  # (unite's figure; SAFE skips those as oov)


class Safe(Method):
    name = "safe"
    config_class = SafeConfig
    stats_class = SafeStats

    def check_members(self) -> None:
        check_ensemble_members(self.name, self.members, self.config.drafter, "SafeConfig.drafter", self.config.weights)

    def main_member(self) -> int | None:
        return self.config.drafter

    def run(self, req: Request) -> Iterator[str]:
        r = _SafeRun(self.config, self.members, req)
        emit = Utf8Releaser()
        while not r.finished and r.st.tokens_out < r.budget:
            going = r.cycle()
            piece = emit.take(r.text)
            if piece:
                yield piece
            if not going:
                break  # cut by the budget, but closed: finish_reason stays "length"
        tail = emit.take(r.text, final=True)
        if tail:
            yield tail
        # the generator's return value (StopIteration.value): the final caches, for callers that
        # drive run() themselves (the engine ignores it)
        return {"drafter": r.dstate, "views": r.views, "text": r.text}


class _SafeRun:
    """One request's SAFE run, phase by phase: `cycle` closes, writes forced tokens, or drafts,
    verifies and commits once; `text` holds the bytes that can no longer be rolled back."""

    def __init__(self, cfg: SafeConfig, members: list, req: Request) -> None:
        self.cfg, self.req = cfg, req
        self.ordered, self.weights, self.dstate, self.views = start_members(
            members, req.main, req.weights, req.prompt_ids
        )
        self.wsum = sum(self.weights)
        self.ends = turn_ends(self.views, req.main, req.turn_ends)
        self.drafter, self.didx = self.ordered[0], vocab_index(self.ordered[0])
        self.st = req.stats = SafeStats()
        self.guide, self.main, self.plen = req.guide, req.main, len(self.dstate.ids)
        self.text, self.budget = b"", req.max_new_tokens
        self.finished, self.lookahead = False, cfg.lookahead
        self.must_close = False  # a drafted or chosen token would have left too little for the completion
        self.pending: int | None = None  # the cycle's last drafted token, not yet on the drafter's cache
        if self.guide:
            self.guide.check_budget(self.main, self.budget)

    def note(self, **entry) -> None:
        if self.req.trace is not None:
            self.req.trace.append(entry)

    def pick(self, logp: torch.Tensor) -> int:
        return pick_token(logp, self.req.temperature, self.req.top_p, self.req.generator)

    def cycle(self) -> bool:
        """One step of the request; False when the reply was closed (it ends here)."""
        guide, left = self.guide, self.budget - self.st.tokens_out
        forced = guide.forced_tokens(self.main, self.dstate.ids[self.plen :])[:left] if guide else []
        tail = None
        if guide and (self.must_close or not forced):
            tail = guide.closing(self.main, self.text, 0 if self.must_close else left)
        if tail is not None or self.must_close:  # the budget holds just the shortest completion: written now
            self.text += tail or b""
            self.st.tokens_out += len(guide.spell(self.main, tail or b""))
            self.note(byte=len(self.text), reason="closed", bytes=len(tail or b""))
            return False
        if forced:
            self.write_forced(forced)
            return True
        self.st.cycles += 1
        base = len(self.dstate.ids)
        drafts = self.draft(min(self.lookahead, left))
        if not drafts:  # no token leaves room for the completion: it is written next
            return True
        keys = [self.didx.key_of(t) for t, _ in drafts]
        starts, pos = [], len(self.text)
        for k in keys:
            starts.append(pos)
            pos += 0 if k is EOS else len(k)
        full = self.text + b"".join(k for k in keys if k is not EOS)
        cut = valid_utf8_prefix(full)
        for v in self.views:  # 2. verify: one forward per verifier
            v.sync(full[:cut].decode("utf-8"), from_byte=min(len(self.text), cut))
        replaced = self.check(drafts, keys, starts, full, cut)
        self.commit(keys, starts, full, base, replaced)
        return True

    def write_forced(self, forced: list[int]) -> None:
        """The grammar forces these tokens: written without drafting or verifying."""
        guide = self.guide
        guide.forced += len(forced)
        self.text += b"".join(self.didx.key_of(t) for t in forced)
        self.st.tokens_out += len(forced)
        self.note(byte=len(self.text), reason="forced", tokens=len(forced))
        self.finished = guide.complete(self.text)
        if self.finished:  # the forced tokens ended the match: the grammar, not the budget, ended the reply
            self.req.finish_reason = "stop"
        if not self.finished and self.st.tokens_out < self.budget:
            self.drafter.extend(self.dstate, forced)

    def draft(self, n: int) -> list[tuple[int, torch.Tensor]]:
        """1. The drafter drafts up to n tokens, up to EOS or a stop string (nothing after either
        is kept), on its cache; each with the row it was picked from."""
        guide, dstate, st = self.guide, self.dstate, self.st
        drafts: list[tuple[int, torch.Tensor]] = []
        drafted = self.text
        for j in range(n):
            row = dstate.next_logprobs
            if guide:  # the drafter writes only what the grammar allows, and what leaves room to close
                row = guide.mask_row(self.main, dstate.ids[self.plen :], row)
                tok = guide.pick(self.main, dstate.ids[self.plen :], row, self.budget - st.tokens_out - j, self.pick)
                if tok is None:
                    self.must_close = True
                    break
            else:
                tok = self.pick(row)
            drafts.append((tok, row))
            if tok in self.drafter.eos_ids:
                break
            key = self.didx.key_of(tok)
            drafted += key
            if self.req.stops.end(drafted, len(drafted) - len(key)) is not None:
                break  # the drafter's cache lacks this token: the request ends with this cycle
            if j + 1 == n:  # the last draft's forward waits for the check: a replacement drops it
                self.pending = tok
            elif st.tokens_out + j + 1 < self.budget:  # the budget's last token needs no forward
                self.drafter.extend(dstate, [tok])
        return drafts

    def check(self, drafts, keys, starts, full: bytes, cut: int) -> tuple[int, bytes] | None:
        """3-5. Each drafted position: skipped (oov, consensus) or ensembled; the first position
        whose ensemble choice differs from the drafted token, with that choice (None: all kept)."""
        st, views = self.st, self.views
        for j, ((tok, row), key) in enumerate(zip(drafts, keys)):
            b = starts[j]
            end = b if key is EOS else b + len(key)
            if end > cut or any(b not in v.rows for v in views):
                st.skipped_oov += 1
                self.note(byte=b, reason="oov")
                continue
            vrows = [v.rows[b] for v in views]
            if self.consensus(tok, row, key, b, vrows):
                st.skipped_consensus += 1
                if self.req.trace is not None:  # with what UniTE would have picked here (Theorem 1: the same)
                    dist = self.union([row] + vrows, b)
                    self.note(byte=b, reason="consensus", key=key, unite_pick=dist.keys[int(torch.argmax(dist.probs))])
                continue
            choice = self.ensemble(row, vrows, full[:b])
            if choice is None:  # none in the union is allowed: the drafter's (allowed) token stands
                continue
            self.note(byte=b, reason="ensemble", key=key, choice=choice)
            if choice != key:
                return j, choice
        return None

    def consensus(self, tok: int, row: torch.Tensor, key, b: int, vrows: list) -> bool:
        """4. Whether every verifier's own next token at byte b spells the drafter's token and either
        each is its verifier's top-1 or the weighted mean probability of the token exceeds
        `consensus` (Theorem 1: the ensemble's argmax is the drafter's token)."""
        # Consensus needs the verifiers' own next tokens to be the drafter's token string:
        # a verifier whose token spans further ("Orange" vs the drafter's "O") has not
        # agreed, and skipping there is not lossless (found by the Theorem-1 test).
        # one question per row (the verifiers' argmax and own-token values), all asked first
        views = self.views
        asks = [take_async(row, [tok])] + [
            query_async(vrow, vocab_index(v.member).eos if key is EOS else [v.next_tok[b]])
            for v, vrow in zip(views, vrows)
        ]
        agree, aligned, p_own = True, True, [math.exp(asks[0].get()[0])]
        for v, ask in zip(views, asks[1:]):
            best, vals = ask.get()
            if key is EOS:
                p_own.append(math.exp(VocabIndex.key_logprobs([EOS], vals, [(0, len(vals))])[0]))
                agree &= best in v.member.eos_ids
            else:
                own = v.next_tok[b]
                aligned &= vocab_index(v.member).key_of(own) == key
                p_own.append(math.exp(vals[0]))
                agree &= own == best
        # the weighted mean (App. H): above 1/2 the token is the weighted ensemble's argmax. Every
        # member's own top-1 being the token is enough with UniTE's rule (no key outweighs a member's
        # top-1 there), not with onto_main (a verifier's other tokens may add up on another key)
        p_mean = sum(w * p for w, p in zip(self.weights, p_own)) / self.wsum
        if key == NEWLINE and any(self.ends):  # part of a newline may count for EOS (TurnEnd): not a sure pick
            return False
        return aligned and ((agree and not self.cfg.onto_main) or p_mean > self.cfg.consensus)

    def union(self, rows: list, at: int):
        """The union at byte `at` of the text (where the members' turn ends are read)."""
        for end in self.ends:
            if end is not None:
                end.at = at
        cfg, req = self.cfg, self.req
        argmax = req.temperature == 0 and req.guide is None and cfg.sharpen is None  # the pick is the argmax
        return union_distribution(
            self.ordered, rows, self.weights, cfg.top_k, cfg.onto_main, turn_ends=self.ends, argmax_only=argmax
        )

    def ensemble(self, row: torch.Tensor, vrows: list, before: bytes):
        """5. The UniTE distribution over the drafter's and the verifiers' rows (sharpened when its
        max < 0.5), masked by the grammar after `before`; a key picked from it (None: no key allowed)."""
        cfg = self.cfg
        self.st.tokens_ensembled += 1
        dist = self.union([row] + vrows, len(before))
        probs = dist.probs
        if float(probs.max()) < 0.5:
            probs = sharpen(dist, top_keys(self.drafter, row, cfg.top_k), cfg.sharpen, cfg.sharpen_lambda, self.weights)
        logp = torch.log(probs)
        if self.guide:  # only keys the grammar allows after the text before this token
            logp = self.guide.key_logprobs(before, [None if k is EOS else k for k in dist.keys], logp)
            if logp is None:
                return None
        return dist.keys[self.pick(logp)]

    def commit(self, keys, starts, full: bytes, base: int, replaced: tuple[int, bytes] | None) -> None:
        """The cycle's verified text: the whole draft, or the draft up to the replaced position and
        the ensemble's choice there (the drafter's cache cropped back to it); the next lookahead."""
        st, guide, text = self.st, self.guide, self.text
        if replaced is None:
            st.tokens_out += sum(1 for k in keys if k is not EOS)
            self.finished = keys[-1] is EOS or self.req.stops.end(full, len(text)) is not None
            self.text = full
        else:
            j, choice = replaced
            if (
                guide
                and choice is not EOS
                and not guide.fits(self.main, full[: starts[j]] + choice, self.budget - st.tokens_out - j - 1)
            ):
                choice, self.must_close = b"", True  # the completion would not fit after it: closed instead
            st.replacements += 1
            new = full[: starts[j]] + (b"" if choice is EOS else choice)
            st.tokens_out += j + (0 if choice is EOS or not choice else 1)
            self.drafter.crop(self.dstate, base + j)
            self.finished = choice is EOS or self.req.stops.end(new, len(text)) is not None
            self.text = new
            if not self.finished and st.tokens_out < self.budget and choice:
                self.drafter.extend(self.dstate, self.didx.ids_for(choice))
        if guide and not self.finished and guide.complete(self.text):  # the grammar allows nothing more
            self.finished = True
        if replaced is None and self.pending is not None and not self.finished and st.tokens_out < self.budget:
            self.drafter.extend(self.dstate, [self.pending])  # the whole draft stands: its last token's forward
        self.pending = None
        if self.cfg.adaptive:
            cap = max(self.cfg.lookahead, self.cfg.max_lookahead)
            self.lookahead = min(cap, self.lookahead + 2) if replaced is None else max(1, self.lookahead - 1)
        if self.finished:
            self.req.finish_reason = "stop"
