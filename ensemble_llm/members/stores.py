"""Models already in a user's Ollama or LM Studio store, by name, run in process (no server).

- `ollama:NAME[:TAG]` (`ollama:qwen2.5:0.5b`, `ollama:user/model`, tag `latest` by default): the
  store's manifest (`manifests/registry.ollama.ai/library/NAME/TAG`) names the model layer
  (`application/vnd.ollama.image.model`), whose blob (`blobs/sha256-<digest>`) is the GGUF file.
  The store is `$OLLAMA_MODELS`, else `~/.ollama/models`, else the Linux service's
  `/usr/share/ollama/.ollama/models`. Ollama's own template, parameters and system prompt layers
  are not read: the GGUF's chat template is. A model with adapter or projector layers is refused
  (run in process, they would be silently left out).
- `lmstudio:PUBLISHER/REPO[/FILE.gguf]`: LM Studio keeps plain GGUF files under
  `~/.lmstudio/models` (older installs: `~/.cache/lm-studio/models`); a folder with more than one
  model file needs the file named.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..errors import ModelNotFoundError

PREFIXES = ("ollama:", "lmstudio:")
MODEL_LAYER = "application/vnd.ollama.image.model"
REFUSED_LAYERS = ("application/vnd.ollama.image.adapter", "application/vnd.ollama.image.projector")
REGISTRY = "registry.ollama.ai"


def is_store_ref(text: str) -> bool:
    return text.startswith(PREFIXES)


def store_gguf(text: str) -> tuple[Path, str]:
    """(the GGUF file, a display name) of an `ollama:` or `lmstudio:` reference."""
    kind, _, name = text.partition(":")
    if not name:
        raise ModelNotFoundError(f"{text!r} names no model; write {kind}:NAME (e.g. ollama:qwen2.5:0.5b).")
    return (_ollama(name), name) if kind == "ollama" else (_lmstudio(name), name)


def ollama_roots() -> list[Path]:
    env = os.environ.get("OLLAMA_MODELS")
    if env:
        return [Path(env).expanduser()]
    return [Path.home() / ".ollama" / "models", Path("/usr/share/ollama/.ollama/models")]


def _manifest_path(root: Path, name: str) -> Path:
    """NAME[:TAG] -> manifests/<host>/<namespace>/<model>/<tag>, as Ollama lays them out."""
    model, _, tag = name.partition(":")
    parts = model.split("/")
    if len(parts) == 1:
        parts = [REGISTRY, "library", *parts]
    elif len(parts) == 2:
        parts = [REGISTRY, *parts]
    if len(parts) != 3 or any(p in ("", ".", "..") for p in parts) or tag in (".", "..") or "/" in tag:
        raise ModelNotFoundError(
            f"ollama:{name} is not a model name; write ollama:NAME[:TAG] (e.g. ollama:qwen2.5:0.5b)."
        )
    return root.joinpath("manifests", *parts, tag or "latest")


def _ollama(name: str) -> Path:
    roots = ollama_roots()
    for root in roots:
        manifest = _manifest_path(root, name)
        if manifest.is_file():
            return _ollama_blob(root, manifest, name)
    where = " or ".join(str(r) for r in roots)
    raise ModelNotFoundError(
        f"ollama:{name} is not in the Ollama store ({where}); run `ollama pull {name}`, or set OLLAMA_MODELS "
        "to the store that holds it."
    )


def _ollama_blob(root: Path, manifest: Path, name: str) -> Path:
    try:
        layers = json.loads(manifest.read_text())["layers"]
        kinds = [layer["mediaType"] for layer in layers]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ModelNotFoundError(f"ollama:{name}: its manifest {manifest} cannot be read ({exc}).") from exc
    refused = [k for k in kinds if k in REFUSED_LAYERS]
    if refused:
        raise ModelNotFoundError(
            f"ollama:{name} has {', '.join(sorted(set(refused)))} layers, which run only inside Ollama; give the "
            "base model instead."
        )
    models = [layer for layer in layers if layer["mediaType"] == MODEL_LAYER]
    if len(models) != 1:
        raise ModelNotFoundError(
            f"ollama:{name} has {len(models)} GGUF model layers (its layers: {', '.join(kinds)}); only a model "
            "stored as one GGUF file runs here."
        )
    digest = str(models[0]["digest"])
    for blob in (root / "blobs" / digest.replace(":", "-"), root / "blobs" / digest):
        if blob.is_file():
            return blob
    raise ModelNotFoundError(f"ollama:{name}: its model blob {digest} is missing from {root / 'blobs'}; pull it again.")


def lmstudio_roots() -> list[Path]:
    return [Path.home() / ".lmstudio" / "models", Path.home() / ".cache" / "lm-studio" / "models"]


def _lmstudio(name: str) -> Path:
    parts = name.split("/")
    if len(parts) not in (2, 3) or any(p in ("", ".", "..") for p in parts):
        raise ModelNotFoundError(f"lmstudio:{name} is not a model; write lmstudio:PUBLISHER/REPO[/FILE.gguf].")
    for root in lmstudio_roots():
        path = root.joinpath(*parts)
        if len(parts) == 3 and path.is_file():
            return path
        if len(parts) == 2 and path.is_dir():
            return _one_gguf(path, name)
    where = " or ".join(str(r) for r in lmstudio_roots())
    raise ModelNotFoundError(f"lmstudio:{name} is not in LM Studio's models folder ({where}); download it there first.")


def _one_gguf(folder: Path, name: str) -> Path:
    files = sorted(p for p in folder.glob("*.gguf") if not p.name.startswith("mmproj"))
    if len(files) == 1:
        return files[0]
    if not files:
        raise ModelNotFoundError(f"lmstudio:{name}: {folder} holds no .gguf model file.")
    listed = ", ".join(f"lmstudio:{name}/{p.name}" for p in files)
    raise ModelNotFoundError(f"lmstudio:{name} holds {len(files)} model files; name one: {listed}.")
