"""The interface every ensembling method implements.

A method gets the loaded members and a `Request` (each member's prompt ids, the token budget,
sampling settings) and is a generator of *final* text pieces: text it yields is never rolled
back, so the engine can stream it (after holding back a possible stop-string prefix). When the
engine closes the generator early (a stop string was found), the method just ends. The method
records its own figures in `Request.stats` (tokens out, tokens ensembled, skips by reason...);
forward passes and time per member are counted by the members themselves.

How the planned methods fit:
- single: one member decodes on its KV cache.
- unite / safe: the drafter's KVState advances token by token; verifiers `extend` their own
  canonical tokenization of the drafted text in one pass, read log-probs at their token
  boundaries (`encode_with_offsets`), and `crop` on rollback. Only text that no later rollback
  can touch is yielded.
- specfuse: each member drafts a segment on its own KVState; `score_inline` scores all segments
  in one pass per member; the winner is yielded as soon as it is chosen.
- smc: byte-level beams over each member's vocabulary trie (`bytelm.py`); `forward_rows` runs
  all particles' new token contexts in one batched forward per member; the prefix that all
  particles agree on is yielded.
"""

from __future__ import annotations

import abc
import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar, Iterator

import torch

from ..errors import ConfigError
from ..members import Member


@dataclass
class Request:
    prompt_ids: list[list[int]]  # per member, its own prompt tokens (own template, own BOS)
    max_new_tokens: int  # budget, in the tokens of the method's main member
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    generator: torch.Generator | None = None
    stats: dict[str, Any] = field(default_factory=dict)
    finish_reason: str = "length"  # the method sets "stop" when it ends on EOS
    stop: list[str] = field(default_factory=list)  # the engine cuts these too; smc ends particles on them


class Method(abc.ABC):
    name: ClassVar[str]
    config_class: ClassVar[type | None] = None

    def __init__(self, members: list[Member], config: Any = None) -> None:
        self.members = members
        self.config = config

    @classmethod
    def make_config(cls, config: Any) -> Any:
        """Validate `config` (None, a dict or the method's config dataclass)."""
        if cls.config_class is None:
            if config not in (None, {}):
                raise ConfigError(f"method {cls.name!r} takes no config, got {config!r}")
            return None
        if config is None:
            return cls.config_class()
        if isinstance(config, dict):
            names = {f.name for f in dataclasses.fields(cls.config_class)}
            unknown = sorted(set(config) - names)
            if unknown:
                raise ConfigError(f"{cls.config_class.__name__} has no field(s) {unknown}; valid: {sorted(names)}")
            return cls.config_class(**config)
        if not isinstance(config, cls.config_class):
            raise ConfigError(f"method {cls.name!r} needs a {cls.config_class.__name__} (or a dict), "
                              f"got {type(config).__name__}")
        return config

    def check_members(self) -> None:
        """Raise ConfigError when the members do not suit this method (called once members load)."""

    def main_member(self) -> int:
        """Index of the member whose tokens count the budget and the usage."""
        return 0

    @abc.abstractmethod
    def run(self, req: Request) -> Iterator[str]:
        """Yield final text pieces; set req.finish_reason and req.stats."""
