"""`unite`: UniTE (Yao et al., ICLR 2025) — ensemble at EVERY generated token.

Each step, every member gives its next-token distribution after its own tokenization of the
shared text (the primary on its own token history, the others on their canonical tokenization,
KV-cached, so a step costs about one forward per member); their top-k tokens are aligned by
string, each member's softmax over the union is averaged with the member weights, and the
argmax (or a sample) is appended. This is the baseline SAFE improves on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from ..errors import ConfigError
from ..members.rows import pick_token
from .align import EOS, start_members, turn_ends, union_distribution, valid_utf8_prefix, vocab_index
from .base import EVIDENCE, SOLO, Method, Request, RunStats, check_evidence, check_solo
from .text import Utf8Releaser


def check_weights(weights, n: int | None, owner: str) -> None:
    """Member weights: "auto" (calibrated, see calibrate.py), None (uniform) or one finite
    non-negative number per member with a positive sum."""
    if weights is None or (isinstance(weights, str) and weights == "auto"):
        return
    if (
        not isinstance(weights, (list, tuple))
        or not weights
        or any(isinstance(w, bool) or not isinstance(w, (int, float)) or not 0 <= w < math.inf for w in weights)
        or sum(weights) <= 0
    ):
        raise ConfigError(
            f"{owner}.weights must be 'auto', None (uniform) or a list of finite non-negative "
            f"numbers with a positive sum, got {weights!r}"
        )
    if n is not None and len(weights) != n:
        raise ConfigError(f"{owner}.weights has {len(weights)} entries for {n} members; give one per member.")


def check_main(value, owner: str) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise ConfigError(f"{owner} must be a member index >= 0, or None for the strongest member, got {value!r}")


def check_onto_main(value, owner: str) -> None:
    if not isinstance(value, bool):
        raise ConfigError(f"{owner}.onto_main must be True or False, got {value!r}")


def check_ensemble_members(method: str, members: list, index: int, field: str, weights) -> None:
    """Shared member checks of the ensembling methods: >= 2 members, a valid main index, weights."""
    owner = field.split(".")[0]
    if len(members) < 2:
        raise ConfigError(f"method {method!r} needs at least 2 members, got {len(members)}")
    if index is not None and index >= len(members):
        raise ConfigError(f"{field}={index} but there are {len(members)} members")
    check_weights(weights, len(members), owner)


@dataclass
class UniteConfig:
    top_k: int = 10
    weights: list[float] | str | None = "auto"  # "auto" (calibrated), None (uniform) or one per member
    primary: int | None = None  # the member whose tokens carry the text; None: the strongest
    solo: float | None = SOLO  # weights="auto": run a member alone where it holds this weight (evidence.py)
    evidence: float = EVIDENCE  # weights="auto": how far the shown answers move the weights (evidence.py)
    exam: bool = True  # weights="auto": a member that writes none of the shown answers steps aside (evidence.py)
    # True: each member's mass counted once, on the primary's first token of each key (align.onto_main_tokens);
    # False: UniTE's own rule (a key a member lacks takes its first sub-token's logit)
    onto_main: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or not 1 <= self.top_k <= 1000:
            raise ConfigError(f"UniteConfig.top_k must be an integer in [1, 1000], got {self.top_k!r}")
        check_onto_main(self.onto_main, "UniteConfig")
        check_main(self.primary, "UniteConfig.primary")
        check_weights(self.weights, None, "UniteConfig")
        check_solo(self.solo, "UniteConfig")
        check_evidence(self.evidence, "UniteConfig")
        if not isinstance(self.exam, bool):
            raise ConfigError(f"UniteConfig.exam must be True or False, got {self.exam!r}")


@dataclass
class UniteStats(RunStats):
    tokens_ensembled: int = 0  # positions decided by the union distribution
    skipped_incomplete_utf8: int = 0  # positions inside a multi-byte character (the primary alone)

    @property
    def ensembled_fraction(self) -> float:
        """E/T: ensembled positions over tokens written."""
        return self.tokens_ensembled / max(1, self.tokens_out)

    def to_dict(self) -> dict[str, Any]:
        return {**super().to_dict(), "ensembled_fraction": self.ensembled_fraction}

    @classmethod
    def summarize(cls, runs: list[RunStats]) -> dict[str, Any]:
        return {"ensembled_fraction": sum(r.tokens_ensembled for r in runs) / max(1, sum(r.tokens_out for r in runs))}


class Unite(Method):
    name = "unite"
    config_class = UniteConfig
    stats_class = UniteStats

    def check_members(self) -> None:
        check_ensemble_members(self.name, self.members, self.config.primary, "UniteConfig.primary", self.config.weights)

    def main_member(self) -> int | None:
        return self.config.primary

    def run(self, req: Request) -> Iterator[str]:
        r = _UniteRun(self.config, self.members, req)
        st, guide, emit = r.st, req.guide, Utf8Releaser()
        while st.tokens_out < req.max_new_tokens:
            key, ids, closed = r.next_key()
            if key is EOS:
                req.finish_reason = "stop"
                break
            r.text += key
            st.tokens_out += len(ids)
            piece = emit.take(r.text)
            if piece:
                yield piece
            if closed:  # cut by the budget, but closed: finish_reason stays "length"
                break
            if guide and guide.complete(r.text):  # the grammar allows nothing more
                req.finish_reason = "stop"
                break
            if st.tokens_out < req.max_new_tokens:
                r.prim.extend(r.pstate, ids)
        tail = emit.take(r.text, final=True)
        if tail:
            yield tail


class _UniteRun:
    """One request's UniTE run: the primary's cache, the other members' views, the text so far."""

    def __init__(self, cfg: UniteConfig, members: list, req: Request) -> None:
        self.cfg, self.req = cfg, req
        self.ordered, self.weights, self.pstate, self.views = start_members(
            members, req.main, req.weights, req.prompt_ids
        )
        self.ends = turn_ends(self.views, req.main, req.turn_ends)
        self.prim = self.ordered[0]
        self.pidx = vocab_index(self.prim)
        self.plen = len(self.pstate.ids)
        self.st = req.stats = UniteStats()
        self.text = b""
        if req.guide:
            req.guide.check_budget(req.main, req.max_new_tokens)

    def pick(self, logp: torch.Tensor) -> int:
        return pick_token(logp, self.req.temperature, self.req.top_p, self.req.generator)

    def next_key(self) -> tuple[Any, list[int] | None, bool]:
        """The next key (bytes or EOS), its ids in the primary's vocabulary, and whether it closes
        the reply (the grammar's shortest completion, written because the budget ends)."""
        req, guide, main, text = self.req, self.req.guide, self.req.main, self.text
        left = req.max_new_tokens - self.st.tokens_out
        prow, ids_so_far = self.pstate.next_logprobs, self.pstate.ids[self.plen :]
        forced = guide.forced_tokens(main, ids_so_far)[:left] if guide else []
        tail = guide.closing(main, text, left) if guide and not forced else None
        closed = False
        if forced:  # the grammar forces these tokens: written without sampling
            guide.forced += len(forced)
            key, ids = b"".join(self.pidx.key_of(t) for t in forced), forced
        elif tail is not None:  # the budget holds just the shortest completion: written now
            key, ids, closed = tail, guide.spell(main, tail)[:left], True
        elif valid_utf8_prefix(text) == len(text):
            key, ids = self.ensemble(prow)
        else:  # inside a multi-byte character: the primary completes it alone
            tok = self.pick(guide.mask_row(main, ids_so_far, prow) if guide else prow)
            key, ids = self.pidx.key_of(tok), [tok]
            self.st.skipped_incomplete_utf8 += 1
        if guide and not forced and not closed and key is not EOS and not guide.fits(main, text + key, left - len(ids)):
            # after this key the shortest completion would not fit: write the completion instead
            tail = guide.closing(main, text, 0) or b""
            key, ids, closed = tail, guide.spell(main, tail)[:left], True
        return key, ids, closed

    def ensemble(self, prow: torch.Tensor) -> tuple[Any, list[int] | None]:
        """The key picked from the weighted union of every member's next-token distribution
        (masked by the grammar); the primary's best allowed token when no union key is allowed."""
        guide, text = self.req.guide, self.text
        rows = [prow]
        for v in self.views:
            v.sync(text.decode("utf-8"), from_byte=len(text))
            rows.append(v.rows[len(text)])
        for end in self.ends:
            if end is not None:
                end.at = len(text)
        cfg, argmax = self.cfg, self.req.temperature == 0 and guide is None  # the pick is the argmax
        dist = union_distribution(
            self.ordered, rows, self.weights, cfg.top_k, cfg.onto_main, turn_ends=self.ends, argmax_only=argmax
        )
        logp = torch.log(dist.probs)
        if guide:  # only keys whose bytes the grammar allows here (None: no key is)
            logp = guide.key_logprobs(text, [None if k is EOS else k for k in dist.keys], logp)
        if logp is not None:
            key = dist.keys[self.pick(logp)]
            self.st.tokens_ensembled += 1
            return key, None if key is EOS else self.pidx.ids_for(key)
        tok = self.pick(guide.mask_row(self.req.main, self.pstate.ids[self.plen :], prow))
        return self.pidx.key_of(tok), [tok]
