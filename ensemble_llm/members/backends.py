"""Floor 1: the backends a member runs on, by name, and what loads each one.

A backend is a folder or module of its own plus one entry here: the loader (`module:function`
under ensemble_llm.members, imported only when a member of that backend loads), whether its
weights and KV cache live in this process (the memory plan and the KV budget size them), and the
member options that apply to it alone, and what the memory plan and the loader must know of it.
`options`, `sources`, `loader`, `plan` and `requests` read this table; a member says what it is
itself (`backend`, `numerics`, `capabilities`, `quantized`).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Backend:
    name: str
    loader: str  # "module:function", relative to ensemble_llm.members
    in_process: bool  # its weights and KV cache are this process's to plan
    own_options: tuple[str, ...] = ()  # member options that only this backend takes
    # its weights are the GGUF file mapped as it is, its KV float16 (the memory plan reads the file)
    maps_file: bool = False
    # its context is sized for the engine's request slots (a loaded member is kept per slot count)
    slots: bool = False


BACKENDS: dict[str, Backend] = {
    b.name: b
    for b in (
        Backend("llama.cpp", "loader:load_llama_member", in_process=True, maps_file=True, slots=True),
        Backend("transformers", "loader:load_hf_member", in_process=True),
        Backend("server", "server.load:load_server_member", in_process=False, own_options=("url", "timeout")),
    )
}


def loader_of(name: str) -> Callable:
    """The function that loads a member of backend `name` (see `load_member`)."""
    module, func = BACKENDS[name].loader.split(":")
    return getattr(importlib.import_module(f"ensemble_llm.members.{module}"), func)
