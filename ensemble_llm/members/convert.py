"""Convert a GGUF checkpoint once into a plain transformers folder (safetensors + tokenizer files).

transformers dequantizes GGUF weights at load time (20-110 s here) and then refuses
`save_pretrained` because the model still carries its GGUF quantizer. The weights are already
plain floating-point tensors at that point, so we detach the quantizer the way
`PreTrainedModel.dequantize()` does (`hf_quantizer.remove_quantization_config`) after checking
that no quantized module is left, and save normally. Later loads read safetensors in seconds.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import time
from pathlib import Path

from ..errors import ModelNotFoundError

MARKER = "ensemble_llm_source.json"


def is_converted(out_dir: Path) -> bool:
    return (out_dir / MARKER).is_file() and (out_dir / "config.json").is_file()


def _verdict_key(gguf_path: Path) -> str:
    """What a failed conversion depends on: the file (path, size, mtime) and the transformers version."""
    import transformers

    st = gguf_path.stat()
    return f"{gguf_path.resolve()}|{st.st_size}|{st.st_mtime_ns}|transformers={transformers.__version__}"


def failed_verdict(gguf_path: Path, out_dir: Path) -> str | None:
    """The error of an earlier failed conversion of this very file, if any (None: never failed,
    or the file or transformers changed since)."""
    path = out_dir.parent / f".{out_dir.name}.failed.json"
    try:
        verdict = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return verdict.get("error") if verdict.get("key") == _verdict_key(gguf_path) else None


def convert_gguf(gguf_path: Path, out_dir: Path, source: dict | None = None) -> Path:
    """Dequantize `gguf_path` into `out_dir` (atomic: a half-written folder is never used).

    A file transformers cannot read fails in seconds to minutes; the verdict is kept next to the
    output folder, so later loads of the same unchanged file fail at once with the same error."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path = Path(gguf_path)
    if not gguf_path.is_file():
        raise ModelNotFoundError(f"GGUF file {gguf_path} does not exist; pass the path of an existing .gguf file.")
    earlier = failed_verdict(gguf_path, out_dir)
    if earlier is not None:
        raise ModelNotFoundError(
            f"{earlier} (remembered from an earlier attempt on this unchanged file; replace the file to try again)"
        )
    from filelock import FileLock

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(out_dir.parent / f".{out_dir.name}.lock"):
        if is_converted(out_dir):  # another process finished it while we waited
            return out_dir
        t0 = time.perf_counter()
        print(
            f"[ensemble-llm] converting {gguf_path.name} once into {out_dir} (this takes up to two minutes)…",
            flush=True,
        )
        try:
            tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
            model = AutoModelForCausalLM.from_pretrained(
                gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
            )
        except Exception as exc:  # noqa: BLE001 - re-raised with the fix
            message = (
                f"transformers could not read {gguf_path} ({type(exc).__name__}: {exc}). The file may be "
                f"truncated or of an architecture transformers cannot load from GGUF; re-download it."
            )
            verdict = out_dir.parent / f".{out_dir.name}.failed.json"
            verdict.write_text(json.dumps({"key": _verdict_key(gguf_path), "error": message}))
            raise ModelNotFoundError(message) from exc
        quantizer = getattr(model, "hf_quantizer", None)
        if quantizer is not None:
            bad = [n for n, p in model.named_parameters() if not p.dtype.is_floating_point]
            if bad:
                raise ModelNotFoundError(
                    f"{gguf_path.name} kept {len(bad)} quantized tensors after loading (e.g. {bad[0]}); "
                    "uninstall the `kernels` package so transformers dequantizes GGUF weights, then retry."
                )
            quantizer.remove_quantization_config(model)
        tmp = out_dir.with_name(out_dir.name + ".partial")
        shutil.rmtree(tmp, ignore_errors=True)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        info = {"gguf": str(gguf_path), "converted_in_s": round(time.perf_counter() - t0, 1), **(source or {})}
        (tmp / MARKER).write_text(json.dumps(info, indent=2))
        shutil.rmtree(out_dir, ignore_errors=True)
        os.replace(tmp, out_dir)
        print(f"[ensemble-llm] converted in {time.perf_counter() - t0:.0f} s", flush=True)
    return out_dir


def extract_tokenizer(gguf_path: Path, out_dir: Path) -> Path:
    """Only the tokenizer of a GGUF file, saved as a transformers tokenizer folder (seconds, where
    converting the weights takes up to two minutes): what tokenizer-level work needs (the tests'
    tiny random-weight models use the real tokenizers)."""
    from filelock import FileLock
    from transformers import AutoTokenizer

    out_dir = Path(out_dir)
    if (out_dir / MARKER).is_file():
        return out_dir
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(out_dir.parent / f".{out_dir.name}.lock"):
        if (out_dir / MARKER).is_file():
            return out_dir
        tmp = out_dir.with_name(out_dir.name + ".partial")
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name).save_pretrained(tmp)
        except Exception as exc:  # noqa: BLE001 - re-raised with the fix
            raise ModelNotFoundError(
                f"transformers could not read the tokenizer of {gguf_path} ({type(exc).__name__}: {exc}); "
                "re-download the file."
            ) from exc
        (tmp / MARKER).write_text(json.dumps({"gguf": str(gguf_path), "tokenizer_only": True}, indent=2))
        shutil.rmtree(out_dir, ignore_errors=True)
        os.replace(tmp, out_dir)
    return out_dir


TOKENIZER_PICKLE = "tokenizer.ensemble_llm.pkl"


def _tokenizer_key() -> str:
    import tokenizers
    import transformers

    return f"transformers={transformers.__version__};tokenizers={tokenizers.__version__}"


def load_cached_tokenizer(folder: Path):
    """The tokenizer of a folder that WE converted, from a pickle written next to it.

    Parsing Gemma's 33 MB tokenizer.json through AutoTokenizer takes ~4 s here; the pickled
    tokenizer loads in ~2 s, which keeps a warm load of the default pair under 5 s. The pickle is
    our own cache file (in our cache folder, never a user's model folder); it is keyed by the
    transformers/tokenizers versions and rebuilt from tokenizer.json when they change or it fails.
    """
    from transformers import AutoTokenizer

    path = Path(folder) / TOKENIZER_PICKLE
    key = _tokenizer_key()
    if path.is_file():
        try:
            with open(path, "rb") as fh:
                stored_key, tokenizer = pickle.load(fh)
            if stored_key == key:
                return tokenizer
        except Exception:  # noqa: BLE001 - a stale or broken cache file is rebuilt below
            pass
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tmp = path.with_suffix(".partial")
    try:
        with open(tmp, "wb") as fh:
            pickle.dump((key, tokenizer), fh, protocol=pickle.HIGHEST_PROTOCOL)
        os.replace(tmp, path)
    except OSError:  # read-only cache: just skip the speed-up
        tmp.unlink(missing_ok=True)
    return tokenizer
