"""Floor 1: hub members: a hub id or one GGUF file in a hub repo ('org/repo:file.gguf'), taken from
the local Hugging Face cache when it is complete there, else downloaded with huggingface_hub.

huggingface_hub does the transfer: its progress bars, the token from the usual places (HF_TOKEN,
`hf auth login`), a retry that resumes a broken transfer with an HTTP Range request, a file lock
per blob (two processes fetching one model download it once) and a process-unique temporary file
renamed into place only when complete (a half-written file is never in the cache). A snapshot
counts as present only when every file of its tree listing is there (huggingface_hub checks it).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from tqdm.auto import tqdm

from ..errors import ModelNotFoundError

# repo formats a causal LM never needs: never downloaded
OTHER_FORMATS = [
    "*.gguf",
    "*.onnx",
    "*.onnx_data",
    "*.msgpack",
    "*.h5",
    "*.ot",
    "*.tflite",
    "*.mlmodel",
    "*.nemo",
    "original/*",
    "onnx/*",
    "openvino/*",
    "coreml/*",
    "consolidated*",
]
PICKLED_WEIGHTS = ["*.bin", "*.pt", "*.pth"]  # fetched only when the repo has no safetensors
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "spiece.model", "tokenizer_config.json")
_REPO = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


class _Quiet(tqdm):
    """A progress bar that never shows (progress=False)."""

    def __init__(self, *args, **kwargs):
        kwargs["disable"] = True
        super().__init__(*args, **kwargs)


def split_hub_ref(text: str) -> tuple[str, str | None] | None:
    """('org/repo', None) for a hub id, ('org/repo', 'file.gguf') for 'org/repo:file.gguf', None
    for anything else (a path, a bundled name)."""
    repo, sep, filename = text.partition(":")
    if not _REPO.fullmatch(repo) or repo.startswith((".", "~")):
        return None
    if not sep:
        return repo, None
    if not filename.endswith(".gguf") or filename.startswith("/") or ".." in filename.split("/"):
        return None
    return repo, filename


def offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def _offline_error(what: str, download: str) -> ModelNotFoundError:
    return ModelNotFoundError(
        f"hub model {what} is not in the local Hugging Face cache and HF_HUB_OFFLINE=1 forbids downloading it. "
        f"Download it once where the hub is reachable (`{download}`), unset HF_HUB_OFFLINE to let ensemble_llm "
        "download it, or pass a local folder, a .gguf file or a bundled name."
    )


def _hub_error(exc: Exception, repo: str, revision: str | None, what: str) -> ModelNotFoundError:
    """A huggingface_hub failure as an error that names the repo and the fix."""
    from huggingface_hub import errors

    rev = f" at revision {revision!r}" if revision else ""
    if isinstance(exc, errors.GatedRepoError):
        msg = (
            f"hub repo {repo!r} is gated: accept its terms on the hub page, then log in "
            "(`hf auth login` or HF_TOKEN) and load it again."
        )
    elif isinstance(exc, errors.RepositoryNotFoundError):
        msg = (
            f"hub repo {repo!r} does not exist (or is private and no token with access was found). Check the "
            "id ('org/name'); for a private repo log in (`hf auth login`) or set HF_TOKEN."
        )
    elif isinstance(exc, errors.RevisionNotFoundError):
        msg = f"hub repo {repo!r} has no revision {revision!r}; pass an existing branch, tag or commit."
    elif isinstance(exc, errors.RemoteEntryNotFoundError):
        msg = f"hub repo {repo!r}{rev} has no file {what!r}; check the file name (it is case-sensitive)."
    else:
        msg = (
            f"downloading {what} from hub repo {repo!r}{rev} failed ({type(exc).__name__}: {exc}). Nothing "
            "half-written was kept; check the connection (or HF_ENDPOINT) and load it again."
        )
    return ModelNotFoundError(msg)


def usable(folder: Path) -> bool:
    """A cached snapshot a model can load from: config, tokenizer and every weight file (all the
    shards its index names). huggingface_hub checks a snapshot against its tree listing only when
    that listing is cached; a snapshot that a lone file download (config.json) started has none."""
    if not (folder / "config.json").is_file() or not any((folder / f).is_file() for f in TOKENIZER_FILES):
        return False
    for index in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        if (folder / index).is_file():
            try:
                shards = set(json.loads((folder / index).read_text())["weight_map"].values())
            except (OSError, ValueError, KeyError):
                return False
            return all((folder / s).is_file() for s in shards)
    return has_weights(folder)


def _cached(repo: str, revision: str | None, ignore: list[str]) -> Path | None:
    from huggingface_hub import errors, snapshot_download

    try:
        folder = Path(snapshot_download(repo, revision=revision, ignore_patterns=ignore, local_files_only=True))
    except (errors.LocalEntryNotFoundError, OSError):
        return None
    return folder if usable(folder) else None


def _snapshot(repo: str, revision: str | None, ignore: list[str], progress: bool) -> Path:
    """The repo's snapshot (files not matching `ignore`): from the cache when complete there, else
    downloaded."""
    from huggingface_hub import snapshot_download

    folder = _cached(repo, revision, ignore)
    if folder is not None:
        return folder
    if offline():
        return_rev = f" --revision {revision}" if revision else ""
        raise _offline_error(repr(repo), f"hf download {repo}{return_rev}")
    try:
        return Path(
            snapshot_download(repo, revision=revision, ignore_patterns=ignore, tqdm_class=None if progress else _Quiet)
        )
    except Exception as exc:  # noqa: BLE001 - re-raised with the repo and the fix
        raise _hub_error(exc, repo, revision, "its files") from exc


def has_weights(folder: Path) -> bool:
    return any(any(folder.glob(g)) for g in ("*.safetensors", "pytorch_model*.bin", "*.pt", "*.pth"))


def hub_folder(repo: str, revision: str | None = None, progress: bool = True) -> Path:
    """A transformers folder for hub id `repo`: safetensors weights when the repo has them,
    pickled weights (`*.bin`) only when it has no safetensors; other formats are never fetched."""
    folder = _snapshot(repo, revision, OTHER_FORMATS + PICKLED_WEIGHTS, progress)
    if has_weights(folder):
        return folder
    folder = _snapshot(repo, revision, OTHER_FORMATS, progress)
    if not has_weights(folder):
        raise ModelNotFoundError(
            f"hub repo {repo!r} holds no transformers weights (*.safetensors or pytorch_model*.bin); "
            "for a GGUF repo name the file: 'org/repo:file.gguf'."
        )
    return folder


def hub_file(repo: str, filename: str, revision: str | None = None, progress: bool = True) -> Path:
    """One file of a hub repo (a GGUF), from the cache or downloaded."""
    from huggingface_hub import errors, hf_hub_download

    try:
        return Path(hf_hub_download(repo, filename, revision=revision, local_files_only=True))
    except (errors.LocalEntryNotFoundError, OSError):
        pass
    if offline():
        return_rev = f" --revision {revision}" if revision else ""
        raise _offline_error(f"file {repo}:{filename}", f"hf download {repo} {filename}{return_rev}")
    try:
        return Path(hf_hub_download(repo, filename, revision=revision, tqdm_class=None if progress else _Quiet))
    except Exception as exc:  # noqa: BLE001 - re-raised with the repo and the fix
        raise _hub_error(exc, repo, revision, filename) from exc


def remote_safetensors(repo: str, revision: str | None) -> tuple[dict[str, int], dict] | None:
    """(parameters per safetensors dtype, config dict) of a hub repo read over the network without
    downloading the weights (safetensors headers by HTTP range requests, config.json), or None when
    offline or the hub does not say."""
    if offline():
        return None
    from huggingface_hub import get_safetensors_metadata, hf_hub_download

    try:
        meta = get_safetensors_metadata(repo, revision=revision)
        config = json.loads(Path(hf_hub_download(repo, "config.json", revision=revision)).read_text())
    except Exception:  # noqa: BLE001 - the plan then says the size is unknown
        return None
    return dict(meta.parameter_count), config


def cached_folder(repo: str, revision: str | None = None) -> Path | None:
    """The repo's complete snapshot in the local cache, or None (nothing is downloaded)."""
    for ignore in (OTHER_FORMATS + PICKLED_WEIGHTS, OTHER_FORMATS):
        folder = _cached(repo, revision, ignore)
        if folder is not None:
            return folder
    return None


def cached_file(repo: str, filename: str, revision: str | None = None) -> Path | None:
    """One file of the repo in the local cache, or None (nothing is downloaded)."""
    from huggingface_hub import errors, hf_hub_download

    try:
        return Path(hf_hub_download(repo, filename, revision=revision, local_files_only=True))
    except (errors.LocalEntryNotFoundError, OSError):
        return None
