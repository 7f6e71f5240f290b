"""Floor 1: resolve a member spec (bundled name, local folder, local .gguf, hub id, 'org/repo:file.gguf')
and load it once per process, on one device or spread by accelerate (device_map, max_memory),
its linear layers quantized as they load when asked (bitsandbytes on CUDA, torchao on CPU)."""

from __future__ import annotations

import hashlib
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Sequence

import torch

from ..errors import ConfigError
from .backends import BACKENDS, LoadRequest, loader_of
from .convert import convert_gguf, extract_tokenizer, is_converted, load_cached_tokenizer
from .fetch import cache_root, fetch_bundled
from .hub import hub_file, hub_folder, split_hub_ref
from .options import NO_OPTIONS, MemberOptions
from .protocol import TokenLM
from .registry import BUNDLED
from .sources import (
    Source,
    gguf_file,
    resolve_backend,
    resolve_source,
)


def gguf_tokenizer_folder(source: Source, path: Path, cache_dir=None) -> Path:
    """A folder with the transformers tokenizer of a GGUF file, read once from it without its weights."""
    root = cache_root(cache_dir)
    if source.kind == "bundled":
        converted = root / "converted" / source.ref
        folder = converted if is_converted(converted) else root / "tokenizers" / source.ref
    else:
        st = path.stat()
        key = hashlib.sha256(f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:12]
        folder = root / "tokenizers" / f"{path.stem}-{key}"
    if not is_converted(folder):
        extract_tokenizer(path, folder)
    return folder


def gguf_tokenizer(source: Source, path: Path, cache_dir=None):
    """The transformers tokenizer of a GGUF file (`gguf_tokenizer_folder`)."""
    return load_cached_tokenizer(gguf_tokenizer_folder(source, path, cache_dir))


def check_options(source: Source, options: MemberOptions) -> None:
    """Options that do not apply to this kind of source are an error, not ignored."""
    if options.revision is not None and source.kind not in ("hub", "hub-gguf"):
        raise ConfigError(
            f"member {source.ref!r} is a {source.kind} model, but revision={options.revision!r} applies to hub "
            "ids only; drop the revision or name the hub id."
        )


def resolve_device(device: str | torch.device | None) -> torch.device:
    """'auto' picks CUDA when present, else CPU; a device that does not exist is an error."""
    if device is None or device == "auto":
        return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ConfigError(
            f"device {device!r} is not a valid torch device ({exc}); use 'auto', 'cpu', 'cuda' or 'cuda:N'."
        ) from exc
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(
                f"device {device!r} asks for CUDA but torch sees no CUDA GPU; use device='cpu' or 'auto'."
            )
        index = dev.index or 0
        if index >= torch.cuda.device_count():
            raise ConfigError(
                f"device {device!r} does not exist: torch sees {torch.cuda.device_count()} CUDA device(s)."
            )
        return torch.device("cuda", index)
    if dev.type == "mps" and not torch.backends.mps.is_available():
        raise ConfigError(f"device {device!r} is not available here; use 'cpu' or 'auto'.")
    if dev.type not in ("cpu", "cuda", "mps"):
        raise ConfigError(f"device {device!r} is not supported; use 'auto', 'cpu', 'cuda' or 'cuda:N'.")
    return dev


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    if dtype is None or dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    table = {
        "float32": torch.float32,
        "fp32": torch.float32,
        "bfloat16": torch.bfloat16,
        "bf16": torch.bfloat16,
        "float16": torch.float16,
        "fp16": torch.float16,
    }
    if dtype not in table:
        raise ConfigError(f"dtype {dtype!r} is not supported; use 'auto' or one of {sorted(table)}.")
    return table[dtype]


def local_dir(source: Source, cache_dir=None, progress: bool = True, revision: str | None = None) -> Path:
    """A transformers folder for `source`, fetching (or downloading from the hub) and converting
    once if needed; `revision` is a hub branch, tag or commit."""
    root = cache_root(cache_dir)
    if source.kind == "dir":
        return Path(source.ref)
    if source.kind == "bundled":
        out = root / "converted" / source.ref
        if not is_converted(out):
            model = BUNDLED[source.ref]
            gguf = fetch_bundled(model, cache_dir, progress=progress)
            convert_gguf(gguf, out, {"bundled": model.name, "sha256": model.sha256})
        return out
    if source.kind in ("gguf", "store"):
        p = gguf_file(source)
        st = p.stat()
        key = hashlib.sha256(f"{p}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:12]
        out = root / "converted" / f"{p.stem}-{key}"
        if not is_converted(out):
            convert_gguf(p, out)
        return out
    if source.kind == "hub-gguf":
        repo, filename = split_hub_ref(source.ref)
        gguf = hub_file(repo, filename, revision, progress=progress)
        blob = gguf.resolve()  # huggingface_hub names a blob by its etag (sha256 for LFS files)
        key = hashlib.sha256(f"{repo}|{filename}|{blob.name}|{blob.stat().st_size}".encode()).hexdigest()[:12]
        out = root / "converted" / f"{Path(filename).stem}-{key}"
        if not is_converted(out):  # convert_gguf locks the folder and renames it into place when complete
            convert_gguf(gguf, out, {"hub": source.ref, "revision": revision or "main"})
        return out
    return hub_folder(source.ref, revision, progress=progress)


def config_window(path: Path, trust_remote_code: bool = False) -> int:
    """A model folder's context window, read from its config (no weights load)."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code).get_text_config(decoder=True)
    return int(getattr(cfg, "max_position_embeddings", None) or 2048)


def tokenizer_dir(name: str, cache_dir=None, progress: bool = True) -> Path:
    """A folder with the tokenizer of bundled model `name`: its converted folder when there is one,
    else the tokenizer alone, extracted from the fetched GGUF without converting the weights."""
    if name not in BUNDLED:
        raise ConfigError(f"{name!r} is not a bundled model; bundled: {sorted(BUNDLED)}")
    root = cache_root(cache_dir)
    converted = root / "converted" / name
    if is_converted(converted):
        return converted
    model = BUNDLED[name]
    return extract_tokenizer(fetch_bundled(model, cache_dir, progress=progress), root / "tokenizers" / name)


_CACHE: dict[tuple, Any] = {}  # the loaded members (TokenLM)
_CACHE_LOCK = threading.Lock()
_KEY_LOCKS: dict[tuple, threading.Lock] = {}


def load_member(
    spec,
    *,
    device="auto",
    dtype="auto",
    cache_dir=None,
    trust_remote_code: bool = False,
    progress: bool = True,
    options: MemberOptions | None = None,
    context_tokens: int | None = None,
    slots: int = 8,
) -> TokenLM:
    """Load (once per process) the member described by `spec` on `device` (or where its
    `options` place it). Before anything is downloaded or loaded, the member's memory plan
    (members/plan.py: weights + KV cache for `context_tokens`, default min(4096, its context
    window)) is checked against what its devices have free: ConfigError with the numbers. A GGUF
    member runs on llama.cpp (`resolve_backend`), its context sized for `slots` requests at once."""
    options = options or NO_OPTIONS
    source = resolve_source(spec)
    check_options(source, options)
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    backend = resolve_backend(source, options, cache_dir, progress)
    key = (source, str(dev), str(dt), str(cache_dir), trust_remote_code, options, backend)
    key += (slots,) if BACKENDS[backend].slots else ()  # its context is sized for them
    with _CACHE_LOCK:
        lock = _KEY_LOCKS.setdefault(key, threading.Lock())
    with lock:  # one load per model; different models may load in parallel
        if key in _CACHE:
            return _CACHE[key]
        load = loader_of(backend)
        req = LoadRequest(source, dev, dt, options, cache_dir, progress, trust_remote_code, context_tokens, slots)
        _CACHE[key] = load(req)
        return _CACHE[key]


def load_members(specs: Sequence, devices: Sequence, dtypes: Sequence, options: Sequence, progress: bool, **kw) -> list:
    """`load_member` for several members at once, in threads: llama.cpp loads its model and the
    tokenizers parse their files outside Python's lock, so the pair is ready sooner."""

    jobs = list(zip(specs, devices, dtypes, options))
    if len(jobs) == 1:
        return [load_member(s, device=d, dtype=t, progress=progress, options=o, **kw) for s, d, t, o in jobs]
    with ThreadPoolExecutor(len(jobs)) as pool:
        futures = [
            pool.submit(load_member, s, device=d, dtype=t, progress=progress, options=o, **kw) for s, d, t, o in jobs
        ]
        return [f.result() for f in futures]


def release_members(members: list) -> None:
    """Drop these members from the cache and empty the list (an engine's close()): their memory is
    freed once no other engine holds them (a llama.cpp member frees its model and context when its
    runner goes)."""
    import gc

    held = {id(m) for m in members}
    with _CACHE_LOCK:
        for key in [k for k, m in _CACHE.items() if id(m) in held]:
            del _CACHE[key]
    with _HeapReturn():
        members.clear()
        for _ in range(3):  # a method's cycles hold the members, and the members' own cycles their tensors
            if not gc.collect():
                break


class _HeapReturn:
    """While members are freed, hand the freed heap back to the OS (glibc; elsewhere a no-op).

    A load raises glibc's trim threshold (up to 64 MiB) as it frees big buffers, and then the
    memory a loader thread's arena frees stays resident: malloc_trim() alone does not give it
    back (tests/test_heap_return.py). A low threshold while the members go does; it then goes
    back to that 64 MiB ceiling (benchmarks/results/close_memory). A threshold the user set
    (MALLOC_TRIM_THRESHOLD_) is left as it is."""

    M_TRIM_THRESHOLD = -1  # mallopt's parameter numbers, from glibc's malloc.h
    LOW, CEILING = 128 * 1024, 64 * 1024 * 1024

    def __init__(self) -> None:
        import ctypes
        import ctypes.util

        try:
            self.libc = ctypes.CDLL(ctypes.util.find_library("c"))
            self.libc.mallopt, self.libc.malloc_trim  # noqa: B018 - glibc has both; musl, macOS, Windows do not
        except (OSError, AttributeError, TypeError):
            self.libc = None
        self.user_set = "MALLOC_TRIM_THRESHOLD_" in os.environ

    def __enter__(self) -> "_HeapReturn":
        if self.libc is not None and not self.user_set:
            self.libc.mallopt(self.M_TRIM_THRESHOLD, self.LOW)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.libc is not None:
            self.libc.malloc_trim(0)
            if not self.user_set:
                self.libc.mallopt(self.M_TRIM_THRESHOLD, self.CEILING)


def clear_cache() -> None:
    """Forget every loaded member (frees memory once no engine holds them)."""
    with _CACHE_LOCK:
        _CACHE.clear()
