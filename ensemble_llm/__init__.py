"""ensemble_llm: token-level ensembles of local causal LMs with different tokenizers.

Core package; imports neither LangChain nor LlamaIndex (the facades live in `integrations/`).
"""

from .engine import Ensemble, GenerationResult, TextStream, AsyncTextStream, Usage
from .errors import (ChecksumError, ConfigError, EnsembleError, GenerationError, ModelNotFoundError, RequestCancelled,
                     RequestError, RequestTimeout)
from .constraints import Constraint
from .members import BUNDLED, DEFAULT_MODELS, Member
from .params import GenerationParams
from .methods import METHODS, SafeConfig, SingleConfig, SmcConfig, SpecFuseConfig, UniteConfig

__version__ = "0.1.0"

__all__ = [
    "AsyncTextStream", "BUNDLED", "ChecksumError", "ConfigError", "Constraint", "GenerationParams", "DEFAULT_MODELS", "Ensemble", "EnsembleError",
    "GenerationError", "GenerationResult", "METHODS", "Member", "ModelNotFoundError", "RequestCancelled", "RequestError",
    "RequestTimeout", "SafeConfig", "SingleConfig", "SmcConfig", "SpecFuseConfig", "TextStream", "UniteConfig", "Usage",
]
