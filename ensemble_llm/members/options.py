"""Floor 1: a member's own loading options (hub revision, accelerate device_map, max_memory,
offload folder, quantization), checked and frozen so they can key the per-process member cache."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError
from .backends import BACKENDS as _REGISTRY

OPTION_KEYS = ("revision", "device_map", "max_memory", "offload_folder", "quantization", "backend", "url", "timeout")
# "auto": a GGUF member (bundled, a .gguf file, a hub repo's .gguf) runs on llama.cpp when
# llama-cpp-python is installed, at the file's own quantization; any other member on transformers
BACKENDS = ("auto", *_REGISTRY)
QUANTIZATIONS = ("int8", "int4")
# bytes one quantized linear-layer parameter takes (scales and zero points not counted)
QUANT_BYTES = {"int8": 1.0, "int4": 0.5}
DEVICE_MAP_STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")
_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)


@dataclass(frozen=True)
class MemberOptions:
    """How one member loads beyond its device and dtype.

    revision: a hub branch, tag or commit (hub ids only). device_map: an accelerate strategy
    ("auto", "balanced", "balanced_low_0", "sequential") or module -> device pairs, so one member
    may span several GPUs, GPU and CPU, or CPU and disk. max_memory: device -> bytes it may use
    (GPU index, "cpu", "disk", "mps"); offload_folder: where layers that fit nowhere else go.
    backend: "auto", "llama.cpp", "transformers" or "server" (`BACKENDS`); url and timeout (seconds
    a call may wait) for backend="server", whose model runs in the server at `url`.
    max_memory or offload_folder without a device_map mean device_map="auto". quantization: None
    (the dtype's own weights), "int8" or "int4": the linear layers' weights are quantized as they
    load (bitsandbytes on CUDA, torchao on CPU; members/backends/transformers/load.py quantization_kwargs)."""

    revision: str | None = None
    device_map: str | tuple[tuple[str, int | str], ...] | None = None
    max_memory: tuple[tuple[int | str, int], ...] | None = None
    offload_folder: str | None = None
    quantization: str | None = None
    backend: str = "auto"
    url: str | None = None
    timeout: float | None = None

    @property
    def spans(self) -> bool:
        """True when accelerate places the layers (the member may span devices)."""
        return self.device_map is not None

    @property
    def transformers_only(self) -> bool:
        """True when an option only transformers applies is set (quantization, accelerate's placement)."""
        return self.quantization is not None or self.spans

    def device_map_arg(self) -> str | dict:
        return self.device_map if isinstance(self.device_map, str) else dict(self.device_map or ())

    def max_memory_dict(self) -> dict[int | str, int] | None:
        return dict(self.max_memory) if self.max_memory is not None else None


NO_OPTIONS = MemberOptions()


def parse_size(value: Any, where: str) -> int:
    """Bytes from an int or a string such as '10GiB', '500MB' (GB = 10**9, GiB = 2**30)."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ConfigError(f"{where} must be a number of bytes or a size such as '10GiB', got {value!r}")
    if isinstance(value, int):
        size = value
    else:
        m = _SIZE.match(value)
        if not m:
            raise ConfigError(f"{where} = {value!r} is not a size; write bytes (an int) or e.g. '10GiB', '500MB'.")
        size = int(float(m.group(1)) * _UNITS[(m.group(2) or "").upper()])
    if size < 0:
        raise ConfigError(f"{where} = {value!r} is negative; give a size of 0 or more bytes.")
    return size


def device_key(key: Any, where: str) -> int | str:
    """accelerate's name of a device: a GPU index (int), 'cpu', 'disk' or 'mps'; a GPU that
    torch does not see is an error."""
    if isinstance(key, bool):
        raise ConfigError(f"{where}: {key!r} is not a device; use a GPU index, 'cuda:N', 'cpu', 'disk' or 'mps'.")
    if isinstance(key, str) and key in ("cpu", "disk", "mps"):
        return key
    if isinstance(key, str) and re.fullmatch(r"cuda(:\d+)?|\d+", key):
        key = int(key.split(":")[1]) if ":" in key else 0 if key == "cuda" else int(key)
    if not isinstance(key, int) or key < 0:
        raise ConfigError(f"{where}: {key!r} is not a device; use a GPU index, 'cuda:N', 'cpu', 'disk' or 'mps'.")
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if key >= count:
        raise ConfigError(
            f"{where} names GPU {key}, which does not exist: torch sees {count} CUDA device(s); "
            "use 'cpu' (and 'disk' with an offload_folder) or an existing GPU index."
        )
    return key


def _order(key: int | str) -> tuple[int, int]:
    return (0, key) if isinstance(key, int) else (1, ("mps", "cpu", "disk").index(key))


def _max_memory(value: Any, where: str) -> tuple[tuple[int | str, int], ...]:
    if not isinstance(value, dict) or not value:
        raise ConfigError(
            f"{where} max_memory must be a non-empty dict of device -> size, e.g. {{0: '20GiB', 'cpu': '60GiB'}}; "
            f"got {value!r}"
        )
    out: dict[int | str, int] = {}
    for k, v in value.items():
        key = device_key(k, f"{where} max_memory")
        if key in out:
            raise ConfigError(f"{where} max_memory names device {key!r} twice ({k!r}); name each device once.")
        out[key] = parse_size(v, f"{where} max_memory[{k!r}]")
    return tuple(sorted(out.items(), key=lambda kv: _order(kv[0])))


def _device_map(value: Any, where: str) -> str | tuple[tuple[str, int | str], ...]:
    if isinstance(value, str):
        if value not in DEVICE_MAP_STRATEGIES:
            raise ConfigError(
                f"{where} device_map={value!r} is not an accelerate strategy; use one of "
                f"{list(DEVICE_MAP_STRATEGIES)} or a dict of module name -> device (a member on one device "
                "takes the engine's `device` instead)."
            )
        return value
    if not isinstance(value, dict) or not value:
        raise ConfigError(f"{where} device_map must be a strategy name such as 'auto' or a dict, got {value!r}")
    pairs = []
    for module, dev in value.items():
        if not isinstance(module, str):
            raise ConfigError(f"{where} device_map keys are module names (str), got {module!r}")
        pairs.append((module, device_key(dev, f"{where} device_map[{module!r}]")))
    return tuple(pairs)


def member_options(raw: dict, where: str) -> MemberOptions:
    """The options among a member dict's keys, checked; `where` names the member in errors."""
    unknown = sorted(set(raw) - set(OPTION_KEYS))
    if unknown:
        raise ConfigError(f"{where}: unknown option(s) {unknown}; the member options are {list(OPTION_KEYS)}.")
    revision = raw.get("revision")
    if revision is not None and (not isinstance(revision, str) or not revision.strip()):
        raise ConfigError(f"{where} revision must be a branch, tag or commit (a non-empty str), got {revision!r}")
    folder = raw.get("offload_folder")
    if folder is not None and not isinstance(folder, (str, os.PathLike)):
        raise ConfigError(f"{where} offload_folder must be a folder path (str), got {type(folder).__name__}")
    device_map = _device_map(raw["device_map"], where) if raw.get("device_map") is not None else None
    max_memory = _max_memory(raw["max_memory"], where) if raw.get("max_memory") is not None else None
    if max_memory is not None and any(k == "disk" for k, _ in max_memory) and folder is None:
        raise ConfigError(f"{where} max_memory gives 'disk' a size but no offload_folder; add an offload_folder.")
    quantization = raw.get("quantization")
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ConfigError(
            f"{where} quantization={quantization!r} is not supported; use one of {list(QUANTIZATIONS)} "
            "(or None for unquantized weights)."
        )
    if device_map is None and (max_memory is not None or folder is not None):
        device_map = "auto"
    backend = raw.get("backend", "auto")
    if backend not in BACKENDS:
        raise ConfigError(f"{where} backend={backend!r} is not one of {list(BACKENDS)}.")
    url, timeout = _server_options(raw, backend, where)
    return MemberOptions(
        revision=revision,
        device_map=device_map,
        max_memory=max_memory,
        offload_folder=os.fspath(folder) if folder is not None else None,
        quantization=quantization,
        backend=backend,
        url=url,
        timeout=timeout,
    )


def _server_options(raw: dict, backend: str, where: str) -> tuple[str | None, float | None]:
    """The url and timeout of a member on a server; each is an error on any other backend."""
    own = _REGISTRY[backend].own_options if backend in _REGISTRY else ()
    for key in ("url", "timeout"):
        if raw.get(key) is not None and key not in own:
            raise ConfigError(f"{where} {key}= applies to backend='server' (a model in a running server); add it.")
    if "url" not in own:  # a backend that reaches its model over HTTP takes these
        return None, None
    url = raw.get("url")
    if not isinstance(url, str) or not re.fullmatch(r"https?://[^\s/]+(/[^\s]*)?", url):
        raise ConfigError(
            f"{where} backend='server' needs url= the server's address, such as 'http://127.0.0.1:8080'; got {url!r}"
        )
    timeout = raw.get("timeout", 60.0)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ConfigError(f"{where} timeout must be a number of seconds > 0, got {timeout!r}")
    return url.rstrip("/"), float(timeout)
