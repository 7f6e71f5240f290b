"""Ensembling methods, one file each, all behind `Method` (see base.py)."""

from __future__ import annotations

from ..errors import ConfigError
from .auto import Auto, AutoConfig
from .base import Method, Request
from .safe import Safe, SafeConfig
from .single import Single, SingleConfig
from .smc import Smc, SmcConfig
from .specfuse import SpecFuse, SpecFuseConfig
from .unite import Unite, UniteConfig

MethodConfig = SingleConfig | UniteConfig | SafeConfig | SpecFuseConfig | SmcConfig | AutoConfig  # what `config=` takes

METHODS: dict[str, type[Method]] = {cls.name: cls for cls in (Single, Unite, Safe, SpecFuse, Smc, Auto)}


def get_method(name: str) -> type[Method]:
    if name not in METHODS:
        raise ConfigError(f"unknown method {name!r}; valid methods: {', '.join(sorted(METHODS))}")
    return METHODS[name]


__all__ = [
    "Auto",
    "AutoConfig",
    "MethodConfig",
    "METHODS",
    "Method",
    "Request",
    "Safe",
    "SafeConfig",
    "Single",
    "SingleConfig",
    "Smc",
    "SmcConfig",
    "SpecFuse",
    "SpecFuseConfig",
    "Unite",
    "UniteConfig",
    "get_method",
]
