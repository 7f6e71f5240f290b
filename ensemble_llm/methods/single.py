"""`single`: one member alone, decoding on its KV cache. The baseline every benchmark divides by."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

from ..errors import ConfigError
from ..members.rows import pick_token
from .base import Method, Request, RunStats
from .text import IncrementalDecoder


@dataclass
class SingleConfig:
    member: int = 0  # which member decodes

    def __post_init__(self) -> None:
        if not isinstance(self.member, int) or self.member < 0:
            raise ConfigError(f"SingleConfig.member must be a member index >= 0, got {self.member!r}")


class Single(Method):
    name = "single"
    config_class = SingleConfig

    def check_members(self) -> None:
        if self.config.member >= len(self.members):
            raise ConfigError(
                f"SingleConfig.member={self.config.member} but the ensemble has {len(self.members)} member(s)"
            )

    def main_member(self) -> int:
        return self.config.member

    def run(self, req: Request) -> Iterator[str]:
        idx = self.config.member
        m = self.members[idx]
        state = m.prefill(req.prompt_ids[idx])
        decoder = IncrementalDecoder(m)
        guide, ids, budget = req.guide, [], req.max_new_tokens
        st = req.stats = RunStats()
        if guide:
            guide.check_budget(idx, budget)
        closed = False

        def pick(row):
            return pick_token(row, req.temperature, req.top_p, req.generator)

        while len(ids) < budget:
            left = budget - len(ids)
            new = guide.take_forced(idx, ids, left) if guide else []  # written without sampling
            closing = guide.closing_tokens(idx, ids, left) if guide and not new else None
            if closing is not None:  # the budget holds just the shortest completion: written now
                new, closed = closing, True
            elif not new:
                if guide:  # only a token after which the shortest completion still fits
                    tok = guide.choose(idx, ids, state.next_logprobs, left, pick)
                    if tok is None:
                        new, closed = guide.closing_tokens(idx, ids, 0) or [], True
                else:
                    tok = pick(state.next_logprobs)
                if not closed:
                    if tok in m.eos_ids:
                        req.finish_reason = "stop"
                        break
                    new = [tok]
            new = new[:left]
            ids += new
            st.tokens_out += len(new)
            piece = decoder.add(new)
            if piece:
                yield piece
            if closed:  # cut by the budget, but closed: finish_reason stays "length"
                break
            if guide and guide.token_done(idx, ids):  # the grammar allows nothing more
                req.finish_reason = "stop"
                break
            if len(ids) < budget:
                m.extend(state, new)
        tail = decoder.flush()
        if tail:
            yield tail
