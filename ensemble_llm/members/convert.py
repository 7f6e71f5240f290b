"""Convert a GGUF checkpoint once into a plain transformers folder (safetensors + tokenizer files).

transformers dequantizes GGUF weights at load time (slowly) and then refuses
`save_pretrained` because the model still carries its GGUF quantizer. The weights are already
plain floating-point tensors at that point, so we detach the quantizer the way
`PreTrainedModel.dequantize()` does (`hf_quantizer.remove_quantization_config`) after checking
that no quantized module is left, and save normally. Later loads read safetensors in seconds.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path

from ..errors import ModelNotFoundError

MARKER = "ensemble_llm_source.json"
# transformers loads take turns, process-wide: two in threads at once go wrong through its
# process-wide state. Its from_pretrained switches weight initialisation off globally (its
# no_init_weights context), so one model's weights came out "newly initialized" (random); and it
# reads GGUF through lazily imported modules that two threads must not import at once (2 of 3
# cold starts of the pair failed with "cannot import name 'GGUF_CONFIG_ARCHS'"). llama.cpp's
# loads need no turn.
TRANSFORMERS_LOADS = threading.Lock()


def is_converted(out_dir: Path) -> bool:
    """A complete conversion: its marker and config are there, and a bundled model's marker
    records the sha256 the registry pins (a conversion of another file is done again)."""
    from .registry import BUNDLED

    if not (out_dir / "config.json").is_file():
        return False
    try:
        marker = json.loads((out_dir / MARKER).read_text())
    except (OSError, ValueError):
        return False
    bundled = BUNDLED.get(marker.get("bundled")) if isinstance(marker, dict) else None
    return isinstance(marker, dict) and (bundled is None or marker.get("sha256") == bundled.sha256)


def _temp_dir(out_dir: Path) -> Path:
    """A new folder next to `out_dir` with a name no other process uses (renamed into place when complete)."""
    return Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}.", suffix=".partial"))


def _write_text(path: Path, text: str) -> None:
    """`text` into `path` through a uniquely named temporary file: a reader never sees half of it."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".partial")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


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
            with TRANSFORMERS_LOADS:
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
            _write_text(verdict, json.dumps({"key": _verdict_key(gguf_path), "error": message}))
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
        info = {"gguf": str(gguf_path), "converted_in_s": round(time.perf_counter() - t0, 1), **(source or {})}
        _save_converted(model, tokenizer, out_dir, info)
        print(f"[ensemble-llm] converted in {time.perf_counter() - t0:.0f} s", flush=True)
    return out_dir


def _save_converted(model, tokenizer, out_dir: Path, info: dict) -> None:
    """The converted folder, saved into a uniquely named folder beside `out_dir` and renamed into place."""
    tmp = _temp_dir(out_dir)
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / MARKER).write_text(json.dumps(info, indent=2))
        shutil.rmtree(out_dir, ignore_errors=True)
        os.replace(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # only left when something failed


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
        tmp = _temp_dir(out_dir)
        try:
            try:
                with TRANSFORMERS_LOADS:
                    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
                tokenizer.save_pretrained(tmp)
            except Exception as exc:  # noqa: BLE001 - re-raised with the fix
                raise ModelNotFoundError(
                    f"transformers could not read the tokenizer of {gguf_path} ({type(exc).__name__}: {exc}); "
                    "re-download the file."
                ) from exc
            (tmp / MARKER).write_text(json.dumps({"gguf": str(gguf_path), "tokenizer_only": True}, indent=2))
            shutil.rmtree(out_dir, ignore_errors=True)
            os.replace(tmp, out_dir)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


TOKENIZER_CACHE = ".ensemble_llm-tokenizer"  # the built tokenizer, saved in a folder we own
_CACHE_MANIFEST = "ensemble_llm_tokenizer.json"
TOKEN_BYTES = "token_bytes.bin"  # vocab.token_bytes of the cached tokenizer (slow to build for Gemma-3)
_TOKENIZER_SUFFIXES = (".json", ".jinja", ".model", ".txt")


def _tokenizer_key(folder: Path) -> dict:
    """What a cached tokenizer depends on: the library versions and the source files (name, size, mtime)."""
    import tokenizers
    import transformers

    files = sorted(  # the files a tokenizer reads (not the weights, locks or our own marker)
        f
        for f in folder.iterdir()
        if f.is_file() and not f.name.startswith(".") and f.suffix in _TOKENIZER_SUFFIXES and f.name != MARKER
    )
    return {
        "versions": f"transformers={transformers.__version__};tokenizers={tokenizers.__version__}",
        "files": [[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in files],
        "format": 3,  # 2: the config lists the added tokens (`_list_added_tokens`); 3: `TOKEN_BYTES`
    }


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _cached(cache: Path, key: dict):
    """The tokenizer saved in `cache` when its manifest matches `key` and every file its sha256, else None."""
    from transformers import PreTrainedTokenizerFast

    try:
        manifest = json.loads((cache / _CACHE_MANIFEST).read_text())
        if manifest["key"] != key or any(_digest(cache / n) != h for n, h in manifest["sha256"].items()):
            return None
        return PreTrainedTokenizerFast.from_pretrained(cache, padding_side=manifest["padding_side"])
    except Exception:  # noqa: BLE001 - missing, stale or broken: rebuilt by the caller
        return None


def load_cached_tokenizer(folder: Path):
    """The tokenizer of a folder that WE wrote (a converted model, a Ray member's tokenizer files).

    AutoTokenizer rebuilds Gemma's tokenizer in Python from its 33 MB tokenizer.json, slowly.
    Once built, it is saved with `save_pretrained` into `TOKENIZER_CACHE` inside the folder:
    tokenizers' own `tokenizer.json` and its config, plain JSON that no load can run as code (a
    pickle in a shared cache could). Later loads read it straight into the Rust tokenizer as a
    `PreTrainedTokenizerFast` (faster; the same ids, offsets, decoding, special tokens and
    chat template, tested). The cache is keyed by the library versions and the source files, each
    of its files is checked against the sha256 its manifest records, and it is rebuilt on any
    mismatch; it is written under a lock, through a uniquely named folder renamed into place."""
    folder = Path(folder)
    cache, key = folder / TOKENIZER_CACHE, _tokenizer_key(folder)
    tokenizer = _cached(cache, key)
    if tokenizer is not None:
        return tokenizer
    from transformers import AutoTokenizer  # after the cache: importing it scans every model folder

    tokenizer = AutoTokenizer.from_pretrained(folder)
    try:
        _save_cache(tokenizer, cache, key)
    except OSError:  # a read-only cache: just skip the speed-up
        pass
    return tokenizer


def _save_cache(tokenizer, cache: Path, key: dict) -> None:
    from filelock import FileLock

    with FileLock(cache.parent / f"{cache.name}.lock"):
        if (cache / _CACHE_MANIFEST).is_file() and _cached(cache, key) is not None:
            return  # another process saved it while we built ours
        tmp = _temp_dir(cache)
        try:
            tokenizer.save_pretrained(tmp)
            _list_added_tokens(tmp)
            _save_token_bytes(tokenizer, tmp / TOKEN_BYTES)
            digests = {f.name: _digest(f) for f in sorted(tmp.iterdir()) if f.is_file()}
            manifest = {"key": key, "sha256": digests, "padding_side": tokenizer.padding_side}
            (tmp / _CACHE_MANIFEST).write_text(json.dumps(manifest, indent=1))
            shutil.rmtree(cache, ignore_errors=True)
            os.replace(tmp, cache)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


def _save_token_bytes(tokenizer, path: Path) -> None:
    """Every token's bytes and the special ids (`vocab.token_bytes`) as raw little-endian arrays:
    the token count, the special count, each token's end offset, the special ids, then the bytes.
    Plain numbers read back with `frombuffer`, so no load can run code (an .npy loader could)."""
    import numpy as np

    from .vocab import token_bytes

    pieces, special = token_bytes(tokenizer)
    ends = np.cumsum([len(p) for p in pieces], dtype="<i8")
    head = np.array([len(pieces), len(special)], dtype="<i8")
    path.write_bytes(
        head.tobytes() + ends.tobytes() + np.array(sorted(special), dtype="<i8").tobytes() + b"".join(pieces)
    )


def cached_token_bytes(folder: Path) -> tuple[list[bytes], frozenset[int]] | None:
    """The token bytes saved with the tokenizer cache of `folder` (`load_cached_tokenizer`), or
    None when there are none or they are not what its manifest records."""
    import numpy as np

    cache = Path(folder) / TOKENIZER_CACHE
    try:
        manifest = json.loads((cache / _CACHE_MANIFEST).read_text())
        raw = (cache / TOKEN_BYTES).read_bytes()
    except (OSError, ValueError):
        return None
    if not isinstance(manifest, dict) or manifest.get("sha256", {}).get(TOKEN_BYTES) != hashlib.sha256(raw).hexdigest():
        return None
    n, n_special = np.frombuffer(raw, dtype="<i8", count=2).tolist()
    ends = np.frombuffer(raw, dtype="<i8", count=n, offset=16).tolist()
    special = np.frombuffer(raw, dtype="<i8", count=n_special, offset=16 + 8 * n).tolist()
    blob = raw[16 + 8 * (n + n_special) :]
    return [blob[a:b] for a, b in zip([0] + ends[:-1], ends)], frozenset(special)


def _list_added_tokens(folder: Path) -> None:
    """Copy tokenizer.json's added tokens into tokenizer_config.json as `added_tokens_decoder`.

    Without that list, every load json-parses the whole tokenizer.json in Python only to read its
    added tokens (Gemma's is 33 MB: the list more than halves the cached load). The entries are
    those tokenizer.json holds, so the load builds the same AddedTokens either way (tested)."""
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    if "added_tokens_decoder" in config:
        return
    added = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8")).get("added_tokens", [])
    config["added_tokens_decoder"] = {str(t["id"]): {k: v for k, v in t.items() if k != "id"} for t in added}
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
