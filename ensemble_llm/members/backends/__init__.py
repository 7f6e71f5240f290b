"""Floor 1: the backends a member runs on, by name, and what loads each one.

A backend is a folder of its own here (`backends/<name>/`: its member, executor, loader and
checks) plus one entry in `BACKENDS`: the loader (`module:function` under this package, imported
only when a member of that backend loads, called with one `LoadRequest`), whether its
weights and KV cache live in this process (the memory plan and the KV budget size them), and the
member options that apply to it alone, and what the memory plan and the loader must know of it.
`options`, `sources`, `loader`, `plan` and `requests` read this table; a member says what it is
itself (`backend`, `numerics`, `capabilities`, `quantized`).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class Backend:
    name: str
    loader: str  # "module:function", relative to ensemble_llm.members.backends
    # "module:function" that says whether it takes a member: (source, options, cache_dir, progress,
    # named) -> bool; where the user named this backend (`named`), a member it cannot run is a ConfigError
    accepts: str
    in_process: bool  # its weights and KV cache are this process's to plan
    own_options: tuple[str, ...] = ()  # member options that only this backend takes
    # its weights are the GGUF file mapped as it is, its KV float16 (the memory plan reads the file)
    maps_file: bool = False
    # its context is sized for the engine's request slots (a loaded member is kept per slot count)
    slots: bool = False


@dataclass(frozen=True)
class LoadRequest:
    """What a backend's loader is given: the resolved source, device and dtype, the member's options,
    and the engine's settings that concern a load."""

    source: Any  # sources.Source
    device: Any  # torch.device
    dtype: Any  # torch.dtype
    options: Any  # options.MemberOptions
    cache_dir: Any = None
    progress: bool = True
    trust_remote_code: bool = False
    context_tokens: int | None = None  # the memory plan's context (default: min(4096, its window))
    slots: int = 8  # requests at once (a backend with `slots` sizes its context for them)


BACKENDS: dict[str, Backend] = {
    b.name: b
    for b in (
        Backend(
            "llama.cpp",
            "llama_cpp.load:load_llama_member",
            "llama_cpp.load:accepts",
            in_process=True,
            maps_file=True,
            slots=True,
        ),
        Backend("transformers", "transformers.load:load_hf_member", "transformers.load:accepts", in_process=True),
        Backend(
            "server",
            "server.load:load_server_member",
            "server.load:accepts",
            in_process=False,
            own_options=("url", "timeout"),
        ),
    )
}
AUTO_ORDER = ("llama.cpp", "transformers")  # backend="auto": the first that takes the member


def loader_of(name: str) -> Callable[[LoadRequest], Any]:
    """The function that loads a member of backend `name` from a LoadRequest (see `load_member`)."""
    return _function(BACKENDS[name].loader)


def accepts_of(name: str) -> Callable[..., bool]:
    """The function that says whether backend `name` takes a member (`Backend.accepts`)."""
    return _function(BACKENDS[name].accepts)


def _function(ref: str) -> Callable:
    module, func = ref.split(":")
    return getattr(importlib.import_module(f"ensemble_llm.members.backends.{module}"), func)
