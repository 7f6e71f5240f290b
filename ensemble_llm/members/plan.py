"""Floor 1: a memory plan before loading: each member's weight bytes (safetensors headers or GGUF
tensor shapes, no weight read), KV-cache bytes per token (from its config) and devices, against
what those devices have free; `MemoryPlan.check()` refuses a set that does not fit, with numbers."""

from __future__ import annotations

import json
import math
import mmap
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch

from ..errors import ConfigError
from .options import NO_OPTIONS, QUANT_BYTES, MemberOptions

GiB = 2**30
DEFAULT_CONTEXT = 4096


def gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB" if n < 10 * GiB else f"{n / GiB:.1f} GiB"


# ---- sizes from files, no weights read -----------------------------------------------------
def safetensors_header(path: Path) -> dict:
    """The JSON header of a .safetensors file (its first 8 bytes give the header's length)."""
    with open(path, "rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        return json.loads(fh.read(n))


_NOT_QUANTIZED = ("embed", "lm_head", "wte", "wpe", "token_embd", "norm", "output.weight")


def quantizable(name: str, shape: Sequence[int]) -> bool:
    """A weight that int8/int4 loading quantizes: a 2-D linear weight, not an embedding, the
    output head or a norm (those stay in the dtype; an estimate: models differ)."""
    return len(shape) == 2 and name.endswith(".weight") and not any(k in name for k in _NOT_QUANTIZED)


def safetensors_counts(folder: Path) -> tuple[int, int] | None:
    """(parameters, those in quantizable linear weights) stored in a folder's safetensors files
    (sharded: the files its index names); None when the folder holds no safetensors."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted({folder / f for f in json.loads(index.read_text())["weight_map"].values()})
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        return None
    total = linear = 0
    for path in files:
        for name, info in safetensors_header(path).items():
            if name != "__metadata__":
                total += math.prod(info["shape"])
                linear += math.prod(info["shape"]) if quantizable(name, info["shape"]) else 0
    return total, linear


def safetensors_params(folder: Path) -> int | None:
    """Parameters stored in a folder's safetensors files; None when it holds none."""
    counts = safetensors_counts(folder)
    return None if counts is None else counts[0]


_GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


class _GGUF:
    """Reads a GGUF header (metadata and tensor shapes) straight from the mapped file: array
    values (a 262k-token vocabulary) are skipped, not decoded, so this takes well under a second."""

    def __init__(self, buf) -> None:
        self.buf, self.pos = buf, 0

    def take(self, fmt: str) -> Any:
        value = struct.unpack_from("<" + fmt, self.buf, self.pos)[0]
        self.pos += struct.calcsize("<" + fmt)
        return value

    def string(self) -> str:
        n = self.take("Q")
        self.pos += n
        return bytes(self.buf[self.pos - n : self.pos]).decode("utf-8", errors="replace")

    def value(self, kind: int) -> Any:
        if kind == 8:
            return self.string()
        if kind == 9:
            elem, count = self.take("I"), self.take("Q")
            if elem in _GGUF_SCALARS:
                self.pos += count * struct.calcsize("<" + _GGUF_SCALARS[elem])
            elif elem == 8:  # strings (a vocabulary): step over each by its length, undecoded
                for _ in range(count):
                    self.pos += 8 + struct.unpack_from("<Q", self.buf, self.pos)[0]
            else:
                for _ in range(count):
                    self.value(elem)
            return None  # arrays are not needed here
        return self.take(_GGUF_SCALARS[kind])


def gguf_params_and_config(path: Path) -> tuple[int, dict]:
    """(parameters, a config dict with the KV-cache fields) from a GGUF file's header; the config's
    "_quantizable_params" counts the parameters in quantizable linear weights."""
    with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        r = _GGUF(buf)
        if bytes(buf[:4]) != b"GGUF":
            raise ConfigError(f"{path} is not a GGUF file; re-download it.")
        r.pos = 4
        version, n_tensors, n_kv = r.take("I"), r.take("Q"), r.take("Q")
        if version < 2:
            raise ConfigError(f"{path} is GGUF version {version}; only versions 2 and later are read.")
        meta = {}
        for _ in range(n_kv):
            key = r.string()
            meta[key] = r.value(r.take("I"))
        params = linear = 0
        for _ in range(n_tensors):
            tensor = r.string()
            dims = [r.take("Q") for _ in range(r.take("I"))]
            r.take("I"), r.take("Q")  # type, offset
            params += math.prod(dims)
            linear += math.prod(dims) if quantizable(tensor, dims) else 0
    arch = meta.get("general.architecture", "")
    heads = meta.get(f"{arch}.attention.head_count")
    config = {
        "num_hidden_layers": meta.get(f"{arch}.block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": meta.get(f"{arch}.attention.head_count_kv", heads),
        "hidden_size": meta.get(f"{arch}.embedding_length"),
        "head_dim": meta.get(f"{arch}.attention.key_length"),
        "max_position_embeddings": meta.get(f"{arch}.context_length"),
        "_quantizable_params": linear,
    }
    return params, config


def text_config(config: dict) -> dict:
    """The decoder's part of a config dict (multimodal configs nest it under text_config)."""
    return config.get("text_config") or config


def kv_bytes_per_token(config: dict, dtype: torch.dtype) -> int | None:
    """2 (keys, values) x layers x KV heads x head dim x dtype bytes. Every layer counts, sliding-
    window ones too: a Member keeps a full cache in each layer (so it can be cropped anywhere)."""
    cfg = text_config(config)
    layers, heads = cfg.get("num_hidden_layers"), cfg.get("num_attention_heads")
    if not layers or not heads:
        return None
    kv_heads = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or (cfg.get("hidden_size") or 0) // heads
    if not head_dim:
        return None
    return 2 * int(layers) * int(kv_heads) * int(head_dim) * dtype.itemsize


@dataclass(frozen=True)
class ModelSize:
    """What the files say about one model: its parameters and config (None: unknown), and where
    the numbers came from (or why they are unknown). `linear`: the parameters in quantizable
    linear weights (None: unknown, then every parameter counts as quantizable)."""

    params: int | None
    config: dict | None
    origin: str
    linear: int | None = None


def folder_size(folder: Path) -> ModelSize:
    config = json.loads((folder / "config.json").read_text()) if (folder / "config.json").is_file() else None
    counts = safetensors_counts(folder)
    if counts is None:
        return ModelSize(None, config, f"{folder} has no safetensors: size unknown without loading")
    return ModelSize(counts[0], config, f"safetensors headers in {folder}", counts[1])


def gguf_size(path: Path) -> ModelSize:
    try:
        params, config = gguf_params_and_config(path)
    except (struct.error, ValueError, OverflowError, IndexError, UnicodeError) as exc:
        # a truncated or corrupt file: its size is unknown here, and loading it gives the clear
        # (and remembered) conversion error
        return ModelSize(None, None, f"the GGUF header of {path.name} is unreadable ({type(exc).__name__})")
    return ModelSize(params, config, f"GGUF tensors of {path.name}", config.pop("_quantizable_params", None))


def model_size(source, options: MemberOptions = NO_OPTIONS, cache_dir=None) -> ModelSize:
    """The size of a resolved `Source` (members/loader.py) read from files, never its weights:
    a hub model that is not downloaded is read from the hub's safetensors metadata when online."""
    from .convert import is_converted
    from .fetch import cache_root, fetch_bundled
    from .hub import cached_file, cached_folder, remote_safetensors, split_hub_ref
    from .registry import BUNDLED
    from .sources import gguf_file

    if source.kind == "dir":
        return folder_size(Path(source.ref))
    if source.kind in ("gguf", "store"):
        return gguf_size(gguf_file(source))
    if source.kind == "bundled":
        converted = cache_root(cache_dir) / "converted" / source.ref
        if is_converted(converted):
            return folder_size(converted)
        return gguf_size(fetch_bundled(BUNDLED[source.ref], cache_dir, progress=False))
    repo, filename = split_hub_ref(source.ref)
    if filename is not None:
        path = cached_file(repo, filename, options.revision)
        if path is not None:
            return gguf_size(path)
        return ModelSize(None, None, f"{source.ref} is not downloaded yet: size unknown until it is")
    folder = cached_folder(repo, options.revision)
    if folder is not None:
        return folder_size(folder)
    remote = remote_safetensors(repo, options.revision)
    if remote is None:
        return ModelSize(None, None, f"{repo} is not downloaded and the hub did not answer: size unknown")
    counts, config = remote
    return ModelSize(sum(counts.values()), config, f"hub safetensors metadata of {repo}")


# ---- devices ---------------------------------------------------------------------------------
def free_bytes(device: str) -> int | None:
    """What a device has free now: CUDA from the driver, CPU the available RAM; None: unknown."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return int(torch.cuda.mem_get_info(dev.index or 0)[0])
    if dev.type == "cpu":
        import psutil  # a dependency of accelerate

        return int(psutil.virtual_memory().available)
    return None


def _device_name(key: int | str) -> str:
    return f"cuda:{key}" if isinstance(key, int) else key


def _spread_devices(options: MemberOptions) -> list[tuple[str, int | None]]:
    """(device, the member's own limit) in accelerate's fill order: GPUs, then mps, cpu, disk."""
    if options.max_memory is not None:
        out = [(_device_name(k), v) for k, v in options.max_memory if k != "disk"]
    else:
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        out = [(f"cuda:{i}", None) for i in range(gpus)] + [("cpu", None)]
    return out


# ---- the plan --------------------------------------------------------------------------------
@dataclass(frozen=True)
class MemberPlan:
    """One member's row: its size, dtype, KV cache and the bytes planned on each device
    (weights + KV; "disk" holds offloaded weights only). `problem`: why it cannot be placed."""

    name: str
    params: int | None
    dtype: str
    weight_bytes: int | None
    kv_per_token: int | None
    context_tokens: int
    placement: tuple[tuple[str, int], ...]
    origin: str
    problem: str | None = None

    @property
    def kv_bytes(self) -> int | None:
        return None if self.kv_per_token is None else self.kv_per_token * self.context_tokens

    def describe(self) -> str:
        kv = f" + {gib(self.kv_bytes)} KV for {self.context_tokens} tokens" if self.kv_bytes else ""
        return f"{gib(self.weight_bytes or 0)} of weights{kv}"


_FIX = {
    "cuda": (
        "give the members different GPUs (device=[...]), spread one with {'model': ..., 'device_map': 'auto', "
        "'max_memory': {...}, 'offload_folder': ...}, load in bfloat16, or plan fewer context tokens"
    ),
    "cpu": (
        "free memory, load in bfloat16 (dtype='bfloat16'), let a member wait on disk ({'model': ..., "
        "'max_memory': {'cpu': '...'}, 'offload_folder': '/path'}), or use fewer or smaller members"
    ),
}


@dataclass(frozen=True)
class MemoryPlan:
    """Per-member rows and what each device has free (None: unknown, not checked)."""

    members: tuple[MemberPlan, ...]
    free: tuple[tuple[str, int | None], ...] = field(default=())

    def needs(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for m in self.members:
            for dev, n in m.placement:
                out[dev] = out.get(dev, 0) + n
        return out

    def problems(self) -> list[str]:
        out = [m.problem for m in self.members if m.problem]
        free = dict(self.free)
        for dev, need in self.needs().items():
            have = free.get(dev)
            if dev == "disk" or have is None or need <= have:
                continue
            on = [m for m in self.members if any(d == dev for d, _ in m.placement)]
            if len(on) == 1:
                who = f"member {on[0].name} needs {on[0].describe()} on {dev}"
            else:
                parts = ", ".join(f"{m.name} ({m.describe()})" for m in on)
                who = f"members {parts} need {gib(need)} together on {dev}"
            fix = _FIX.get(torch.device(dev).type if dev != "disk" else "cpu", _FIX["cpu"])
            out.append(f"{who}, which has {gib(have)} free; fix: {fix}")
        return out

    def check(self) -> MemoryPlan:
        """Self when every member fits; else ConfigError with the numbers and the fix."""
        problems = self.problems()
        if problems:
            raise ConfigError("the members do not fit in memory: " + "; ".join(problems) + ".")
        return self

    def table(self) -> str:
        rows = [("member", "params", "dtype", "weights", "KV/token", "KV", "tokens", "placement", "from")]
        for m in self.members:
            known = m.weight_bytes is not None
            rows.append(
                (
                    m.name,
                    f"{m.params / 1e6:.1f}M" if m.params is not None else "unknown",
                    m.dtype,
                    gib(m.weight_bytes) if known else "unknown",
                    f"{m.kv_per_token / 1024:.1f} KiB" if m.kv_per_token is not None else "unknown",
                    gib(m.kv_bytes) if m.kv_bytes is not None else "unknown",
                    str(m.context_tokens),
                    ", ".join(f"{d} {gib(n)}" for d, n in m.placement) or "-",
                    m.origin,
                )
            )
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1] for r in rows]
        free = dict(self.free)
        for dev, need in self.needs().items():
            have = free.get(dev)
            verdict = "no limit checked" if have is None else "fits" if need <= have else "DOES NOT FIT"
            have_text = "unknown" if have is None else gib(have)
            lines.append(f"{dev}: needs {gib(need)}, free {have_text}: {verdict}")
        return "\n".join(lines)


def _place(
    name: str, weight: int, kv: int, dev: torch.device, options: MemberOptions, free
) -> tuple[tuple[tuple[str, int], ...], str | None]:
    """Where a member's bytes go: all on `dev`, or spread like accelerate (fill each device up to
    min(free, the member's max_memory), then disk when there is an offload_folder). The KV cache
    follows the layers; the KV of offloaded layers lives on the first device."""
    if not options.spans:
        return ((str(dev), weight + kv),), None
    placed: dict[str, int] = {}
    left = weight
    for device, limit in _spread_devices(options):
        have = free(device)
        cap = min(x for x in (have, limit, left) if x is not None)
        if cap > 0:
            placed[device] = cap
            left -= cap
    problem = None
    if left > 0 and options.offload_folder is not None:
        placed["disk"] = left
    elif left > 0:
        limits = ", ".join(f"{d} {gib(placed.get(d, 0))}" for d, _ in _spread_devices(options))
        problem = (
            f"member {name} needs {gib(weight)} of weights, but its devices hold only {gib(weight - left)} "
            f"({limits}); fix: raise its max_memory, or add an offload_folder so the rest waits on disk"
        )
    on_devices = [d for d in placed if d != "disk"]
    out = {d: n for d, n in placed.items()}
    for i, d in enumerate(on_devices):
        share = placed[d] + (placed.get("disk", 0) if i == 0 else 0)
        out[d] += kv * share // max(weight, 1)
    return tuple(out.items()), problem


def weight_bytes(size: ModelSize, dtype: torch.dtype, quantization: str | None) -> int | None:
    """The weights' bytes in `dtype`; quantized, the linear weights take QUANT_BYTES per parameter
    (1 for int8, 0.5 for int4; scales not counted) and the rest (embeddings, norms) stays in dtype."""
    if size.params is None:
        return None
    if quantization is None:
        return size.params * dtype.itemsize
    linear = size.params if size.linear is None else size.linear
    return int((size.params - linear) * dtype.itemsize + linear * QUANT_BYTES[quantization])


def _labels(dtype: torch.dtype, quantization: str | None, origin: str) -> tuple[str, str]:
    """The plan's dtype cell ("float32+int8") and origin text, which says a quantized size is an estimate."""
    name = str(dtype).removeprefix("torch.")
    if quantization is None:
        return name, origin
    return f"{name}+{quantization}", (
        f"{origin}; {quantization} weights estimated at {QUANT_BYTES[quantization]:g} byte per linear-layer "
        "parameter, embeddings and norms unquantized (an estimate)"
    )


def _member_row(source, dev: torch.device, dt, opts: MemberOptions, cache_dir, context_tokens, free, slots):
    """One member's plan row. On llama.cpp a GGUF's weights are the file (mapped as it is, at its own
    quantization) and its KV cache is float16, its context's cells for `slots` requests."""
    from .backends import BACKENDS
    from .sources import LLAMA_CONTEXT, gguf_file, resolve_backend

    backend = resolve_backend(source, opts, cache_dir)
    if not BACKENDS[backend].in_process:  # its weights and KV cache are the server's
        return MemberPlan(source.name, None, backend, None, None, 0, (), f"in the {backend} at {opts.url}")
    if BACKENDS[backend].maps_file:
        path = gguf_file(source, cache_dir, progress=False, revision=opts.revision)
        size = gguf_size(path)
        weight, dtype_name, kv_dtype = path.stat().st_size, "gguf", torch.float16
        origin = f"{size.origin}; the file's size (llama.cpp maps it as it is)"
    else:
        size = model_size(source, opts, cache_dir)
        weight, dtype_name, kv_dtype = weight_bytes(size, dt, opts.quantization), str(dt).removeprefix("torch."), dt
        origin = size.origin
        if opts.quantization is not None and weight is not None:
            dtype_name += f"+{opts.quantization}"
            origin += (
                f"; {opts.quantization} weights estimated at {QUANT_BYTES[opts.quantization]:g} byte per linear-layer "
                "parameter, embeddings and norms unquantized (an estimate)"
            )
    cfg = text_config(size.config or {})
    window = int(cfg.get("max_position_embeddings") or DEFAULT_CONTEXT)
    tokens = context_tokens if context_tokens is not None else min(DEFAULT_CONTEXT, window)
    if dtype_name == "gguf" and slots:  # what the llama.cpp context allocates
        tokens = slots * min(window, LLAMA_CONTEXT)
    kv_token = kv_bytes_per_token(size.config or {}, kv_dtype)
    placement, problem = ((), None)
    if weight is not None:
        placement, problem = _place(source.name, weight, (kv_token or 0) * tokens, dev, opts, free)
    return MemberPlan(source.name, size.params, dtype_name, weight, kv_token, tokens, placement, origin, problem)


def plan_members(
    sources: Sequence,
    devices: Sequence,
    dtypes: Sequence[torch.dtype],
    options: Sequence[MemberOptions | None] | None = None,
    cache_dir=None,
    context_tokens: int | None = None,
    slots: int | None = None,
) -> MemoryPlan:
    """The memory plan of resolved `sources` (loader.Source) on `devices` in `dtypes`, with the KV
    cache of `context_tokens` tokens each (default: min(4096, the member's context window); a
    llama.cpp member with `slots`: the cells its context allocates for that many requests)."""
    options = list(options) if options is not None else [None] * len(sources)
    free_cache: dict[str, int | None] = {}

    def free(device: str) -> int | None:
        if device not in free_cache:
            free_cache[device] = free_bytes(device)
        return free_cache[device]

    rows = [
        _member_row(source, torch.device(dev), dt, opts or NO_OPTIONS, cache_dir, context_tokens, free, slots)
        for source, dev, dt, opts in zip(sources, devices, dtypes, options)
    ]
    for row in rows:
        for d, _ in row.placement:
            if d != "disk":
                free(d)
    return MemoryPlan(tuple(rows), tuple(free_cache.items()))
