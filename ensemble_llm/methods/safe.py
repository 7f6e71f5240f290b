"""`safe`: SAFE, "When to Ensemble" (arXiv 2510.15346, ICLR 2026).

Generate -> verify -> ensemble, once per cycle:
1. the drafter drafts `lookahead` tokens on its KV cache;
2. every verifier re-tokenizes the whole generated text (committed + draft) canonically, keeps
   its cached common prefix and runs the rest in ONE forward, reading its next-token
   distribution at each of its token boundaries;
3. drafter position j (the token t_j after byte boundary b) may be ensembled only if b is a token
   boundary of every verifier (t_{j-1} is not OOV-like) and t_j lies in complete UTF-8 text;
4. it is skipped by consensus when every verifier's own next token at b spells the drafter's
   token and either each is its verifier's top-1, or the mean over all members of each one's
   probability of that token > `consensus` (Theorem 1: both imply the ensemble argmax is the
   drafter's token);
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
from .align import EOS, VocabIndex, sharpen, start_members, top_keys, union_distribution, valid_utf8_prefix, vocab_index
from .base import Method, Request
from .unite import Emitter, UniteStats, check_ensemble_members, check_main, check_weights

SHARPEN_MODES = ("heuristic", "geometric", None)


@dataclass
class SafeConfig:
    drafter: int | None = None  # None: the strongest member (largest calibrated weight)
    lookahead: int = 5
    top_k: int = 10
    consensus: float = 0.5
    # None by default: with small members' flat first-token distributions the heuristic pools
    # unrelated words ("L" gained "La", "Le", "L'" and beat "The"; see the README)
    sharpen: str | None = None
    sharpen_lambda: float = 0.1
    weights: list[float] | str | None = "auto"  # "auto" (calibrated), None (uniform) or one per member
    # the lookahead follows the acceptance rate (transformers' "heuristic" schedule for assisted
    # decoding): +2 after a cycle whose draft was kept whole, -1 (not below 1) after a replacement;
    # `lookahead` is the start and `max_lookahead` the cap. False keeps `lookahead` fixed.
    adaptive: bool = True
    max_lookahead: int = 16

    def __post_init__(self) -> None:
        check_main(self.drafter, "SafeConfig.drafter")
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
        cfg, members = self.config, self.members
        ordered, weights, dstate, views = start_members(members, req.main, req.weights, req.prompt_ids)
        wsum = sum(weights)
        drafter, didx = ordered[0], vocab_index(ordered[0])
        st = req.stats = SafeStats()
        trace = req.trace
        guide, main, plen = req.guide, req.main, len(dstate.ids)
        text, emit, budget = b"", Emitter(), req.max_new_tokens
        finished, lookahead = False, cfg.lookahead
        if guide:
            guide.check_budget(main, budget)
        must_close = False  # a drafted or chosen token would have left too little for the completion
        while not finished and st.tokens_out < budget:
            forced = guide.forced_tokens(main, dstate.ids[plen:])[: budget - st.tokens_out] if guide else []
            tail = None
            if guide and (must_close or not forced):
                tail = guide.closing(main, text, 0 if must_close else budget - st.tokens_out)
            if tail is not None or must_close:  # the budget holds just the shortest completion: written now
                text += tail or b""
                st.tokens_out += len(guide.spell(main, tail or b""))
                if trace is not None:
                    trace.append({"byte": len(text), "reason": "closed", "bytes": len(tail or b"")})
                piece = emit.take(text)
                if piece:
                    yield piece
                break  # cut by the budget, but closed: finish_reason stays "length"
            if forced:  # the grammar forces these tokens: written without drafting or verifying
                guide.forced += len(forced)
                text += b"".join(didx.key_of(t) for t in forced)
                st.tokens_out += len(forced)
                if trace is not None:
                    trace.append({"byte": len(text), "reason": "forced", "tokens": len(forced)})
                finished = guide.complete(text)
                if finished:  # the forced tokens ended the match: the grammar, not the budget, ended the reply
                    req.finish_reason = "stop"
                if not finished and st.tokens_out < budget:
                    drafter.extend(dstate, forced)
                piece = emit.take(text)
                if piece:
                    yield piece
                continue
            st.cycles += 1
            n = min(lookahead, budget - st.tokens_out)
            base = len(dstate.ids)
            drafts: list[tuple[int, torch.Tensor]] = []
            drafted = text
            for j in range(n):  # 1. draft, up to EOS or a stop string (nothing after either is kept)
                row = dstate.next_logprobs
                if guide:  # the drafter writes only what the grammar allows, and what leaves room to close
                    row = guide.mask_row(main, dstate.ids[plen:], row)
                    tok = guide.pick(
                        main,
                        dstate.ids[plen:],
                        row,
                        budget - st.tokens_out - j,
                        lambda r: pick_token(r, req.temperature, req.top_p, req.generator),
                    )
                    if tok is None:
                        must_close = True
                        break
                else:
                    tok = pick_token(row, req.temperature, req.top_p, req.generator)
                drafts.append((tok, row))
                if tok in drafter.eos_ids:
                    break
                key = didx.key_of(tok)
                drafted += key
                if req.stop_end(drafted, len(drafted) - len(key)) is not None:
                    break  # the drafter's cache lacks this token: the request ends with this cycle
                if st.tokens_out + j + 1 < budget:  # the budget's last token needs no forward
                    drafter.extend(dstate, [tok])
            if not drafts:  # no token leaves room for the completion: it is written next
                continue
            keys = [didx.key_of(t) for t, _ in drafts]
            starts, pos = [], len(text)
            for k in keys:
                starts.append(pos)
                pos += 0 if k is EOS else len(k)
            full = text + b"".join(k for k in keys if k is not EOS)
            cut = valid_utf8_prefix(full)
            for v in views:  # 2. verify: one forward per verifier
                v.sync(full[:cut].decode("utf-8"), from_byte=min(len(text), cut))
            replaced = None
            for j, ((tok, row), key) in enumerate(zip(drafts, keys)):  # 3-5. check, maybe ensemble
                b = starts[j]
                end = b if key is EOS else b + len(key)
                if end > cut or any(b not in v.rows for v in views):
                    st.skipped_oov += 1
                    if trace is not None:
                        trace.append({"byte": b, "reason": "oov"})
                    continue
                vrows = [v.rows[b] for v in views]
                # Consensus needs the verifiers' own next tokens to be the drafter's token string:
                # a verifier whose token spans further ("Orange" vs the drafter's "O") has not
                # agreed, and skipping there is not lossless (found by the Theorem-1 test).
                # one question per row (the verifiers' argmax and own-token values), all asked first
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
                # the weighted mean (App. H): above 1/2 the token is the weighted ensemble's argmax
                p_mean = sum(w * p for w, p in zip(weights, p_own)) / wsum
                if aligned and (agree or p_mean > cfg.consensus):
                    st.skipped_consensus += 1
                    if trace is not None:  # with what UniTE would have picked here (Theorem 1: the same)
                        dist = union_distribution(ordered, [row] + vrows, weights, cfg.top_k)
                        trace.append(
                            {
                                "byte": b,
                                "reason": "consensus",
                                "key": key,
                                "unite_pick": dist.keys[int(torch.argmax(dist.probs))],
                            }
                        )
                    continue
                st.tokens_ensembled += 1
                dist = union_distribution(ordered, [row] + vrows, weights, cfg.top_k)
                probs = dist.probs
                if float(probs.max()) < 0.5:
                    probs = sharpen(dist, top_keys(drafter, row, cfg.top_k), cfg.sharpen, cfg.sharpen_lambda, weights)
                logp = torch.log(probs)
                if guide:  # only keys the grammar allows after the text before this token
                    logp = guide.key_logprobs(full[:b], [None if k is EOS else k for k in dist.keys], logp)
                    if logp is None:  # none in the union: the drafter's (allowed) token stands
                        continue
                choice = dist.keys[pick_token(logp, req.temperature, req.top_p, req.generator)]
                if trace is not None:
                    trace.append({"byte": b, "reason": "ensemble", "key": key, "choice": choice})
                if choice != key:
                    replaced = (j, choice)
                    break
            if replaced is None:
                st.tokens_out += sum(1 for k in keys if k is not EOS)
                finished = keys[-1] is EOS or req.stop_end(full, len(text)) is not None
                text = full
            else:
                j, choice = replaced
                if (
                    guide
                    and choice is not EOS
                    and not guide.fits(main, full[: starts[j]] + choice, budget - st.tokens_out - j - 1)
                ):
                    choice, must_close = b"", True  # the completion would not fit after it: closed instead
                st.replacements += 1
                new = full[: starts[j]] + (b"" if choice is EOS else choice)
                st.tokens_out += j + (0 if choice is EOS or not choice else 1)
                drafter.crop(dstate, base + j)
                finished = choice is EOS or req.stop_end(new, len(text)) is not None
                text = new
                if not finished and st.tokens_out < budget and choice:
                    drafter.extend(dstate, didx.ids_for(choice))
            if guide and not finished and guide.complete(text):  # the grammar allows nothing more
                finished = True
            if cfg.adaptive:
                cap = max(cfg.lookahead, cfg.max_lookahead)
                lookahead = min(cap, lookahead + 2) if replaced is None else max(1, lookahead - 1)
            if finished:
                req.finish_reason = "stop"
            piece = emit.take(text)
            if piece:
                yield piece
        tail = emit.take(text, final=True)
        if tail:
            yield tail
        # the generator's return value (StopIteration.value): the final caches, for callers that
        # drive run() themselves (the engine ignores it)
        return {"drafter": dstate, "views": views, "text": text}
