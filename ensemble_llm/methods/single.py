"""`single`: one member alone, decoding on its KV cache. The baseline every benchmark divides by."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

from ..errors import ConfigError
from .base import Method, Request
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
        req.stats["tokens_out"] = 0
        for step in range(req.max_new_tokens):
            tok = pick_token(state.next_logprobs, req.temperature, req.top_p, req.generator)
            if tok in m.eos_ids:
                req.finish_reason = "stop"
                break
            req.stats["tokens_out"] += 1
            piece = decoder.add([tok])
            if piece:
                yield piece
            if step + 1 < req.max_new_tokens:
                m.extend(state, [tok])
        tail = decoder.flush()
        if tail:
            yield tail
