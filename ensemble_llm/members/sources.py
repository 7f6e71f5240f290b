"""Where a member's weights come from, resolved without loading anything: the `Source` of a member
spec, its GGUF file and the backend that runs it (below loader.py and plan.py, which both read it)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigError, ModelNotFoundError
from .fetch import fetch_bundled
from .hub import hub_file, split_hub_ref
from .options import MemberOptions
from .registry import BUNDLED
from .stores import is_store_ref, store_gguf

GGUF_KINDS = ("bundled", "gguf", "hub-gguf", "store")  # sources that are one GGUF file
LLAMA_CONTEXT = 2048  # llama.cpp: KV cells per request slot (a member's context holds max_batch of them)


@dataclass(frozen=True)
class Source:
    """Where a member's weights come from, resolved without loading anything."""

    kind: str  # "bundled" | "dir" | "gguf" | "hub" | "hub-gguf" | "store"
    ref: str  # bundled name, absolute path, hub id, "org/repo:file.gguf" or "ollama:name:tag"/"lmstudio:..."
    name: str  # short display name


def resolve_source(spec: str | os.PathLike) -> Source:
    """Classify a member spec; raise ModelNotFoundError with the valid choices when it is none."""
    if not isinstance(spec, (str, os.PathLike)):
        raise ConfigError(f"a member must be a model name or path (str), got {type(spec).__name__}: {spec!r}")
    text = os.fspath(spec)
    if text in BUNDLED:
        return Source("bundled", text, text)
    if is_store_ref(text):  # a model in the user's Ollama or LM Studio store: its GGUF file
        blob, name = store_gguf(text)
        check_gguf(blob)
        return Source("store", text, name)
    path = Path(text).expanduser()
    hub = split_hub_ref(text)
    if hub is not None and hub[1] is not None and not path.exists():
        return Source("hub-gguf", text, Path(hub[1]).stem)
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelNotFoundError(f"GGUF file {path} does not exist; pass the path of an existing .gguf file.")
        check_gguf(path)
        return Source("gguf", str(path.resolve()), path.stem)
    if path.is_dir():
        check_model_folder(path)
        return Source("dir", str(path.resolve()), path.name)
    if hub is not None:
        return Source("hub", text, text.split("/")[1])
    raise ModelNotFoundError(
        f"unknown model {text!r}. Use a bundled name ({', '.join(sorted(BUNDLED))}), a local transformers "
        "folder, a local .gguf file, a hub id ('org/name'), a GGUF file in a hub repo ('org/name:file.gguf') "
        "or a model in your Ollama or LM Studio store ('ollama:qwen2.5:0.5b', 'lmstudio:publisher/repo')."
    )


def check_gguf(path: Path) -> None:
    """A file's first bytes must say it is a GGUF file."""
    with open(path, "rb") as fh:
        magic = fh.read(4)
    if magic != b"GGUF":
        raise ModelNotFoundError(
            f"{path} is not a GGUF file (it starts with {magic!r}, not b'GGUF'); it may be "
            "truncated or another format: re-download it."
        )


def resolve_backend(source: Source, options: MemberOptions, cache_dir=None, progress: bool = False) -> str:
    """The backend that runs this member (`BACKENDS`): the one named, if it takes the member (else
    its ConfigError says why); with "auto", the first in `AUTO_ORDER` that takes it (llama.cpp for
    a GGUF file on a CPU it survives, else transformers)."""
    from .backends import AUTO_ORDER, BACKENDS, accepts_of

    if options.backend in BACKENDS:  # named
        accepts_of(options.backend)(source, options, cache_dir, progress, True)
        return options.backend
    return next(b for b in AUTO_ORDER if accepts_of(b)(source, options, cache_dir, progress, False))


def gguf_file(source: Source, cache_dir=None, progress: bool = True, revision: str | None = None) -> Path:
    """The GGUF file of a GGUF source (fetched or downloaded once)."""
    if source.kind == "bundled":
        return fetch_bundled(BUNDLED[source.ref], cache_dir, progress=progress)
    if source.kind == "gguf":
        return Path(source.ref)
    if source.kind == "store":
        return store_gguf(source.ref)[0]
    repo, filename = split_hub_ref(source.ref)
    return hub_file(repo, filename, revision, progress=progress)


WEIGHT_FILES = ("*.safetensors", "pytorch_model*.bin", "model.safetensors.index.json", "pytorch_model.bin.index.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "spiece.model", "tokenizer_config.json")


def check_model_folder(path: Path) -> None:
    """A transformers folder needs a config, weights and a tokenizer; say which is missing now,
    rather than at the first request."""
    if not (path / "config.json").is_file():
        raise ModelNotFoundError(f"{path} is a folder but holds no config.json; pass a transformers model folder.")
    if not any(any(path.glob(g)) for g in WEIGHT_FILES):
        raise ModelNotFoundError(
            f"{path} holds a config.json but no weights (*.safetensors or pytorch_model*.bin); "
            "copy the weight files into it, or pass the folder that has them."
        )
    if not any((path / f).is_file() for f in TOKENIZER_FILES):
        raise ModelNotFoundError(
            f"{path} holds no tokenizer files ({', '.join(TOKENIZER_FILES)}); save the "
            "model's tokenizer into it (tokenizer.save_pretrained(path))."
        )
