"""Loading a GGUF member on llama.cpp: the model opened while its tokenizer (read from the GGUF) loads."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import torch

from ....errors import ConfigError
from ...convert import load_cached_tokenizer
from ...loader import gguf_tokenizer_folder
from ...options import MemberOptions
from ...plan import gguf_params_and_config, kv_bytes_per_token
from ...sources import GGUF_KINDS, LLAMA_CONTEXT, Source, gguf_file
from .. import LoadRequest
from .health import installed, tell_fallback, unhealthy_error, verdict
from .member import LlamaMember, check_tokenizer, open_runner
from .runner import binding


def accepts(source: Source, options: MemberOptions, cache_dir, progress: bool, named: bool) -> bool:
    """A GGUF file with no transformers-only option, llama-cpp-python installed, and a CPU that
    survives its build (health.py; with backend="auto" a crash falls back to transformers, with
    one line that says why)."""
    gguf = source.kind in GGUF_KINDS
    only_hf = options.transformers_only
    if not named:
        if not (gguf and not only_hf and installed()):
            return False
        v = verdict(gguf_file(source, cache_dir, progress, options.revision), cache_dir)
        if not v.healthy:
            tell_fallback(v, source.ref)
        return v.healthy
    if not gguf:
        raise ConfigError(
            f"member {source.ref!r} is a {source.kind} model, but backend='llama.cpp' runs GGUF files; give a "
            "bundled name, a .gguf file or 'org/repo:file.gguf', or backend='transformers'."
        )
    if only_hf:
        raise ConfigError(
            f"member {source.ref!r}: quantization and device_map/max_memory/offload_folder apply to "
            "backend='transformers'; a GGUF on llama.cpp runs at its own quantization. Drop them or "
            "give backend='transformers'."
        )
    if not installed():
        binding()  # a ConfigError that says how to install it
    v = verdict(gguf_file(source, cache_dir, progress, options.revision), cache_dir)
    if not v.healthy:
        raise unhealthy_error(v, source.ref)
    return True


def load_llama_member(req: LoadRequest) -> LlamaMember:
    """A GGUF member on llama.cpp (member.py), its context sized for `req.slots` requests."""
    source, dev, cache_dir = req.source, req.device, req.cache_dir
    path = gguf_file(source, cache_dir, req.progress, req.options.revision)
    t0 = time.perf_counter()
    folder = gguf_tokenizer_folder(source, path, cache_dir)
    _, config = gguf_params_and_config(path)
    window = int(config.get("max_position_embeddings") or LLAMA_CONTEXT)
    n_ctx = -(-max(1, req.slots) * min(window, LLAMA_CONTEXT) // 256) * 256
    with ThreadPoolExecutor(1) as pool:  # llama.cpp opens the model (outside the GIL) while the tokenizer loads
        runner = pool.submit(open_runner, str(path), n_ctx, dev, cache_dir=cache_dir)
        tokenizer = load_cached_tokenizer(folder)
        member = LlamaMember(
            source.name,
            str(path),
            tokenizer,
            n_ctx=n_ctx,
            kv_per_token=kv_bytes_per_token(config, torch.float16),
            device=dev,
            source=str(path),
            runner=runner.result(),
        )
    check_tokenizer(member)
    member.tokenizer_folder = str(folder)  # what a Ray actor sends its caller; holds the token bytes
    member.load_seconds = time.perf_counter() - t0
    return member
