"""ensemble_llm: token-level ensembles of local causal LMs with different tokenizers.

Core package; imports neither LangChain nor LlamaIndex (the facades live in `integrations/`).

The public names load on first use (PEP 562), so `import ensemble_llm.client` (the HTTP client)
or `ensemble_llm.errors` does not pull in torch and transformers; `from ensemble_llm import
Ensemble` loads the engine as before.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_WHERE = {
    "AsyncTextStream": "engine",
    "Ensemble": "engine",
    "TextStream": "engine",
    "ChecksumError": "errors",
    "ConfigError": "errors",
    "ContextLengthError": "errors",
    "EnsembleError": "errors",
    "GenerationError": "errors",
    "KVBudgetError": "errors",
    "ModelNotFoundError": "errors",
    "RequestCancelled": "errors",
    "RequestError": "errors",
    "RequestTimeout": "errors",
    "Constraint": "constraints",
    "BUNDLED": "members",
    "DEFAULT_MODELS": "members",
    "Member": "members",
    "GenerationParams": "params",
    "GenerationResult": "results",
    "ToolCall": "results",
    "Usage": "results",
    "METHODS": "methods",
    "SafeConfig": "methods",
    "SingleConfig": "methods",
    "SmcConfig": "methods",
    "SpecFuseConfig": "methods",
    "UniteConfig": "methods",
}

__all__ = [
    "AsyncTextStream",
    "BUNDLED",
    "ChecksumError",
    "ConfigError",
    "Constraint",
    "ContextLengthError",
    "DEFAULT_MODELS",
    "Ensemble",
    "EnsembleError",
    "GenerationError",
    "GenerationParams",
    "GenerationResult",
    "KVBudgetError",
    "METHODS",
    "Member",
    "ModelNotFoundError",
    "RequestCancelled",
    "RequestError",
    "RequestTimeout",
    "SafeConfig",
    "SingleConfig",
    "SmcConfig",
    "SpecFuseConfig",
    "TextStream",
    "ToolCall",
    "UniteConfig",
    "Usage",
]
assert sorted(__all__) == sorted(_WHERE)


def __getattr__(name: str) -> Any:
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module 'ensemble_llm' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{where}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_WHERE))


if TYPE_CHECKING:  # for type checkers and IDEs: the same names, imported eagerly
    from .constraints import Constraint
    from .engine import AsyncTextStream, Ensemble, TextStream
    from .errors import (
        ChecksumError,
        ConfigError,
        ContextLengthError,
        EnsembleError,
        GenerationError,
        KVBudgetError,
        ModelNotFoundError,
        RequestCancelled,
        RequestError,
        RequestTimeout,
    )
    from .members import BUNDLED, DEFAULT_MODELS, Member
    from .methods import METHODS, SafeConfig, SingleConfig, SmcConfig, SpecFuseConfig, UniteConfig
    from .params import GenerationParams
    from .results import GenerationResult, ToolCall, Usage
