"""Loading a member on transformers: from_pretrained with its placement (one device, or accelerate's
device_map / max_memory / offload_folder) and its linear layers quantized as they load when asked
(bitsandbytes on CUDA, torchao on the CPU)."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from ....errors import ConfigError
from ...convert import TRANSFORMERS_LOADS, load_cached_tokenizer
from ...loader import local_dir
from ...options import QUANTIZATIONS, MemberOptions
from ...sources import GGUF_KINDS
from .. import LoadRequest
from .member import Member


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
    the dtype (weight-only): it moved SmolLM2's log-probs less than torchao's dynamic int8
    activations x int8 weights and decoded faster than it (optimum-quanto was slower still).
    torchao's int4 weight-only layout has no CPU kernel, so quantization_kwargs refuses int4 here."""
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


def accepts(source, options: MemberOptions, cache_dir, progress: bool, named: bool) -> bool:
    """Every member: a folder or hub id as it is, a GGUF file converted once (convert.py)."""
    return True


def load_hf_member(req: LoadRequest) -> Member:
    """A member on transformers, its memory plan checked first (members/plan.py)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ...plan import plan_members

    source, dev, dt, options, cache_dir = req.source, req.device, req.dtype, req.options, req.cache_dir
    trust_remote_code, context_tokens, progress = req.trust_remote_code, req.context_tokens, req.progress
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
