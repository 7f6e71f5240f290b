"""Errors raised by ensemble_llm. Every message names the problem and the fix."""

from __future__ import annotations


class EnsembleError(Exception):
    """Base class of every error raised on purpose by ensemble_llm."""


class ConfigError(EnsembleError, ValueError):
    """A bad argument to a constructor or a config dataclass."""


class ModelNotFoundError(ConfigError):
    """A model name, path or hub id that cannot be resolved offline."""


class ChecksumError(EnsembleError):
    """A downloaded or assembled model file whose sha256 is not the expected one."""


class RequestError(EnsembleError, ValueError):
    """A bad generation request (empty prompt, prompt too long, bad sampling values...)."""

    code: str | None = None  # the OpenAI-style error code the server answers with, where one fits


class ContextLengthError(RequestError):
    """A prompt that does not fit a member's context window."""

    code = "context_length_exceeded"


class KVBudgetError(RequestError):
    """A request whose KV cache could never fit the engine's `kv_budget`, even alone."""

    code = "kv_budget_exceeded"


class CapabilityError(RequestError):
    """A method or request needs what a member's backend does not give (a member on a server has no
    whole rows of log-probs, for instance); the engine stays usable after it."""

    code = "unsupported_by_member"


class GenerationError(EnsembleError, RuntimeError):
    """A failure inside generation; the engine stays usable after it."""


class RequestTimeout(EnsembleError, TimeoutError):
    """A request that ran past its `timeout`; the engine stays usable after it."""


class RequestCancelled(EnsembleError):
    """A request whose caller went away (an abandoned stream, a cancelled task) was stopped."""
