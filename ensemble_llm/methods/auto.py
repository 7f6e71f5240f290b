"""`auto` (the default for 2+ members): one method for raw prompts and another for chat messages,
each request run by the method of its kind (`Method.for_kind`).

Why two: measured on the formats set's tune half (docs/benchmarks/formats.md), specfuse leads
with few-shot raw prompts, while in chat its segment choice follows the member whose short
replies are the sharpest, right or not; safe keeps the drafter's reply (the member that answers
best in chat, calibrate.py) and lets the others act only at contested tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

from ..errors import ConfigError
from .base import Method, Request
from .safe import Safe
from .specfuse import SpecFuse

KINDS = {"raw": SpecFuse, "chat": Safe}  # the default method per prompt kind


@dataclass
class AutoConfig:
    raw: Any = None  # the raw-prompt method's config: a SpecFuseConfig or a dict of its fields
    chat: Any = None  # the chat method's config: a SafeConfig or a dict of its fields

    def __post_init__(self) -> None:
        for kind, cls in KINDS.items():
            try:
                setattr(self, kind, cls.make_config(getattr(self, kind)))
            except ConfigError as exc:
                raise ConfigError(f"AutoConfig.{kind}: {exc}") from None


class Auto(Method):
    name = "auto"
    config_class = AutoConfig

    def __init__(self, members, config: AutoConfig | None = None) -> None:
        super().__init__(members, config or AutoConfig())
        self.by_kind = {kind: cls(members, getattr(self.config, kind)) for kind, cls in KINDS.items()}

    def for_kind(self, raw: bool) -> Method:
        return self.by_kind["raw" if raw else "chat"]

    def check_members(self) -> None:
        for m in self.by_kind.values():
            m.check_members()

    @classmethod
    def check_request(cls, config: Any, *, temperature: float, top_p: float) -> None:
        for kind, method in KINDS.items():
            method.check_request(getattr(config, kind), temperature=temperature, top_p=top_p)

    def needs(self) -> frozenset[str]:
        return frozenset().union(*(m.needs() for m in self.by_kind.values()))

    def kv_rows(self) -> int:
        return max(m.kv_rows() for m in self.by_kind.values())

    def run(self, req: Request) -> Iterator[str]:
        raise RuntimeError("auto runs through the method of the request's kind (Method.for_kind)")
