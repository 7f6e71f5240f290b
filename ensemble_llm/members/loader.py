"""Floor 1: resolve a member spec (bundled name, local folder, local .gguf, hub id, 'org/repo:file.gguf')
and load it once per process, on one device or spread by accelerate (device_map, max_memory),
its linear layers quantized as they load when asked (bitsandbytes on CUDA, torchao on CPU)."""

from __future__ import annotations

import hashlib
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Sequence

import torch

from ..errors import ConfigError
from .backends import BACKENDS, loader_of
from .convert import TRANSFORMERS_LOADS, convert_gguf, extract_tokenizer, is_converted, load_cached_tokenizer
from .fetch import cache_root, fetch_bundled
from .hub import hub_file, hub_folder, split_hub_ref
from .member import Member
from .options import NO_OPTIONS, QUANTIZATIONS, MemberOptions
from .registry import BUNDLED
from .sources import (
    GGUF_KINDS,
    LLAMA_CONTEXT,
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


def load_llama_member(source: Source, dev: torch.device, dt, options: MemberOptions, cache_dir, progress, *args):
    """A GGUF member on llama.cpp (llama.py), its context sized for `slots` requests (the last of
    `args`: trust_remote_code, context_tokens, slots; the backends' one signature)."""
    slots = args[-1]
    from .llama import LlamaMember, check_tokenizer, open_runner
    from .plan import gguf_params_and_config, kv_bytes_per_token

    path = gguf_file(source, cache_dir, progress, options.revision)
    t0 = time.perf_counter()
    folder = gguf_tokenizer_folder(source, path, cache_dir)
    _, config = gguf_params_and_config(path)
    window = int(config.get("max_position_embeddings") or LLAMA_CONTEXT)
    n_ctx = -(-max(1, slots) * min(window, LLAMA_CONTEXT) // 256) * 256
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


_CACHE: dict[tuple, Member] = {}
_CACHE_LOCK = threading.Lock()
_KEY_LOCKS: dict[tuple, threading.Lock] = {}


def placement_kwargs(dev: torch.device, options: MemberOptions) -> dict:
    """from_pretrained's placement arguments: the whole member on `dev`, or accelerate's
    device_map / max_memory / offload_folder (the member may span GPUs, the CPU and disk)."""
    if not options.spans:
        return {"device_map": {"": dev}}
    kw: dict = {"device_map": options.device_map_arg()}
    if options.max_memory is not None:
        kw["max_memory"] = options.max_memory_dict()
    if options.offload_folder is not None:
        Path(options.offload_folder).expanduser().mkdir(parents=True, exist_ok=True)
        kw["offload_folder"] = str(Path(options.offload_folder).expanduser())
    return kw


def prequantized(folder: Path) -> str | None:
    """The quant_method of a checkpoint saved quantized (GPTQ, AWQ, bitsandbytes, torchao, ...:
    its config.json has a quantization_config), else None."""
    cfg_path = Path(folder) / "config.json"
    if not cfg_path.is_file():
        return None
    import json

    qc = json.loads(cfg_path.read_text()).get("quantization_config")
    if not qc:
        return None
    return str(qc.get("quant_method", "unknown")) if isinstance(qc, dict) else "unknown"


def _need(module: str, what: str, package: str) -> None:
    import importlib.util

    if importlib.util.find_spec(module) is None:
        raise ConfigError(
            f"{what} needs the {package} package, which is not installed; run `pip install {package}` "
            "(or `pip install 'ensemble-llm[quantize]'` for the CPU path), or drop the member's quantization."
        )


def bitsandbytes_config(quantization: str, dtype: torch.dtype):
    """transformers' BitsAndBytesConfig for CUDA: LLM.int8() for "int8", NF4 with `dtype` compute
    (double quantization) for "int4"."""
    from transformers import BitsAndBytesConfig

    if quantization == "int8":
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype, bnb_4bit_use_double_quant=True
    )


def torchao_config(quantization: str = "int8"):
    """transformers' TorchAoConfig for the CPU "int8": int8 per-channel weights, activations left in
    the dtype (weight-only). On this CPU it moved SmolLM2's log-probs a third as much as torchao's
    dynamic int8 activations x int8 weights (0.2 against 0.58 nat, top-50 tokens) and decoded faster
    than it (optimum-quanto was far slower still). torchao's int4 weight-only layout has no CPU
    kernel, so quantization_kwargs refuses int4 here."""
    from torchao.quantization import Int8WeightOnlyConfig
    from transformers import TorchAoConfig

    return TorchAoConfig(Int8WeightOnlyConfig())


def quantization_kwargs(folder: Path, dev: torch.device, dtype: torch.dtype, options: MemberOptions) -> dict:
    """from_pretrained's quantization_config for the member's `quantization` on `dev`; {} when
    none is asked. A checkpoint saved quantized loads as it is (transformers reads its own config),
    so asking quantization on top of one is an error."""
    method = prequantized(folder)
    if options.quantization is None:
        return {}
    if method is not None:
        raise ConfigError(
            f"{folder} is already quantized ({method}: its config.json has a quantization_config), so "
            f"quantization={options.quantization!r} cannot apply on top; drop the member's quantization."
        )
    if options.quantization not in QUANTIZATIONS:
        raise ConfigError(f"quantization={options.quantization!r} is not one of {list(QUANTIZATIONS)}.")
    on_cuda = dev.type == "cuda" or (options.spans and torch.cuda.is_available())
    if on_cuda:
        _need("bitsandbytes", f"quantization={options.quantization!r} on CUDA", "bitsandbytes")
        return {"quantization_config": bitsandbytes_config(options.quantization, dtype)}
    if dev.type != "cpu":
        raise ConfigError(
            f"quantization={options.quantization!r} runs on CUDA (bitsandbytes) or the CPU (torchao), not on "
            f"{dev.type}; use device='cpu' or a CUDA device, or drop the member's quantization."
        )
    if options.quantization != "int8":
        raise ConfigError(
            f"quantization={options.quantization!r} needs CUDA (bitsandbytes): torchao has no CPU kernel for int4 "
            "weights; use quantization='int8' on the CPU, or a CUDA device."
        )
    _need("torchao", f"quantization={options.quantization!r} on the CPU", "torchao")
    return {"quantization_config": torchao_config(options.quantization)}


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
) -> Member:
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
        _CACHE[key] = load(source, dev, dt, options, cache_dir, progress, trust_remote_code, context_tokens, slots)
        return _CACHE[key]


def load_hf_member(
    source: Source, dev, dt, options: MemberOptions, cache_dir, progress, trust_remote_code, context_tokens, slots=8
) -> Member:
    """A member on transformers, its memory plan checked first (members/plan.py)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .plan import plan_members

    plan_members([source], [dev], [dt], [options], cache_dir, context_tokens=context_tokens).check()
    folder = local_dir(source, cache_dir, progress=progress, revision=options.revision)
    t0 = time.perf_counter()
    tokenizer = (
        load_cached_tokenizer(folder)
        if source.kind in GGUF_KINDS
        else AutoTokenizer.from_pretrained(folder, trust_remote_code=trust_remote_code)
    )
    kwargs = {**placement_kwargs(dev, options), **quantization_kwargs(folder, dev, dt, options)}
    try:
        with TRANSFORMERS_LOADS:
            model = AutoModelForCausalLM.from_pretrained(
                folder, dtype=dt, trust_remote_code=trust_remote_code, **kwargs
            )
    except ImportError as exc:
        method = prequantized(folder)
        if method is None:
            raise
        raise ConfigError(
            f"{folder} is a checkpoint saved quantized ({method}), and transformers cannot load it here: {exc} "
            "Install the package it names (GPTQ/AWQ checkpoints usually need a CUDA GPU too)."
        ) from exc
    member = Member(source.name, model, tokenizer, source=str(folder))
    if source.kind in GGUF_KINDS:
        member.tokenizer_folder = str(folder)  # its tokenizer cache holds the token bytes too
    member.load_seconds = time.perf_counter() - t0
    return member


def load_members(specs: Sequence, devices: Sequence, dtypes: Sequence, options: Sequence, progress: bool, **kw) -> list:
    """`load_member` for several members at once, in threads: llama.cpp loads its model and the
    tokenizers parse their files outside Python's lock, so the pair is ready about 1 s sooner."""

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
