"""`single`: one member alone, decoding on its KV cache. The baseline every benchmark divides by."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

from ..errors import ConfigError
from .base import Method, Request, RunStats
from .sampling import pick_token
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
            raise ConfigError(f"SingleConfig.member={self.config.member} but the ensemble has "
                              f"{len(self.members)} member(s)")

    def main_member(self) -> int:
        return self.config.member

    def run(self, req: Request) -> Iterator[str]:
        idx = self.config.member
        m = self.members[idx]
        state = m.prefill(req.prompt_ids[idx])
        decoder = IncrementalDecoder(m)
        guide, ids, budget = req.guide, [], req.max_new_tokens
        st = req.stats = RunStats()
        while len(ids) < budget:
            new = guide.forced_tokens(idx, ids)[: budget - len(ids)] if guide else []
            if new:  # the grammar forces these tokens: written without sampling
                guide.forced += len(new)
            else:
                row = guide.mask_row(idx, ids, state.next_logprobs) if guide else state.next_logprobs
                tok = pick_token(row, req.temperature, req.top_p, req.generator)
                if tok in m.eos_ids:
                    req.finish_reason = "stop"
                    break
                new = [tok]
            ids += new
            st.tokens_out += len(new)
            piece = decoder.add(new)
            if piece:
                yield piece
            if guide and guide.token_done(idx, ids):  # the grammar allows nothing more
                req.finish_reason = "stop"
                break
            if len(ids) < budget:
                m.extend(state, new)
        tail = decoder.flush()
        if tail:
            yield tail
