"""Members named by their place in the user's Ollama or LM Studio store (members/stores.py): stores
built here in those layouts, resolved to their GGUF files, and a bundled GGUF run from an Ollama
store end to end, answering as the bundled member does."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest

from ensemble_llm import Ensemble, ModelNotFoundError
from ensemble_llm.members.sources import gguf_file, resolve_source

FAKE_GGUF = b"GGUF" + bytes(60)  # resolution reads only the magic


def ollama_store(root: Path, name: str, tag: str, data: bytes, layers: tuple[str, ...] = ()) -> Path:
    """A store as `ollama pull` leaves it: the manifest under manifests/<host>/<ns>/<model>/<tag>, each
    layer a blob named by its digest."""
    blobs = root / "blobs"
    blobs.mkdir(parents=True, exist_ok=True)

    def blob(payload: bytes, media: str) -> dict:
        digest = hashlib.sha256(payload).hexdigest()
        (blobs / f"sha256-{digest}").write_bytes(payload)
        return {"mediaType": media, "digest": f"sha256:{digest}", "size": len(payload)}

    model, _, _ = name.partition(":")
    parts = model.split("/") if "/" in model else ["library", model]
    manifest = root / "manifests" / "registry.ollama.ai" / Path(*parts) / tag
    manifest.parent.mkdir(parents=True, exist_ok=True)
    body = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
        "config": blob(b"{}", "application/vnd.docker.container.image.v1+json"),
        "layers": [
            blob(data, "application/vnd.ollama.image.model"),
            blob(b"{{ .Prompt }}", "application/vnd.ollama.image.template"),
            *(blob(m.encode(), m) for m in layers),
        ],
    }
    manifest.write_text(json.dumps(body))
    return blobs / f"sha256-{hashlib.sha256(data).hexdigest()}"


def test_ollama_names_resolve_to_their_blob(tmp_path, monkeypatch):
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path))
    latest = ollama_store(tmp_path, "smol", "latest", FAKE_GGUF)
    tagged = ollama_store(tmp_path, "smol", "135m", FAKE_GGUF + b"x")
    mine = ollama_store(tmp_path, "me/smol", "v1", FAKE_GGUF + b"y")
    for ref, blob in (("ollama:smol", latest), ("ollama:smol:135m", tagged), ("ollama:me/smol:v1", mine)):
        source = resolve_source(ref)
        assert (source.kind, source.ref, gguf_file(source)) == ("store", ref, blob)
    assert resolve_source("ollama:smol:135m").name == "smol:135m"


@pytest.mark.parametrize(
    "ref, message",
    [
        ("ollama:absent:1b", "ollama pull absent:1b"),
        ("ollama:", "names no model"),
        ("ollama:a/b/c/d", "not a model name"),
        ("ollama:../x", "not a model name"),
        ("ollama:smol:../../x", "not a model name"),
        ("ollama:lora", "adapter layers"),
        ("ollama:broken", "not a GGUF file"),
        ("ollama:gone", "blob sha256:.* is missing"),
    ],
)
def test_ollama_refusals_name_the_fix(tmp_path, monkeypatch, ref, message):
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path))
    ollama_store(tmp_path, "lora", "latest", FAKE_GGUF, layers=("application/vnd.ollama.image.adapter",))
    ollama_store(tmp_path, "broken", "latest", b"PK\x03\x04 not a gguf")
    os.remove(ollama_store(tmp_path, "gone", "latest", FAKE_GGUF + b"gone"))
    with pytest.raises(ModelNotFoundError, match=message):
        resolve_source(ref)


def test_lmstudio_names_resolve_to_their_file(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    one = tmp_path / ".lmstudio" / "models" / "pub" / "one-GGUF"
    two = tmp_path / ".cache" / "lm-studio" / "models" / "pub" / "two-GGUF"  # an older install's folder
    for folder, files in ((one, ["one-Q8_0.gguf", "mmproj-one.gguf"]), (two, ["two-Q4.gguf", "two-Q8.gguf"])):
        folder.mkdir(parents=True)
        for f in files:
            (folder / f).write_bytes(FAKE_GGUF)
    assert gguf_file(resolve_source("lmstudio:pub/one-GGUF")) == one / "one-Q8_0.gguf"
    assert gguf_file(resolve_source("lmstudio:pub/two-GGUF/two-Q8.gguf")) == two / "two-Q8.gguf"
    with pytest.raises(ModelNotFoundError, match="holds 2 model files; name one: lmstudio:pub/two-GGUF/two-Q4.gguf"):
        resolve_source("lmstudio:pub/two-GGUF")
    with pytest.raises(ModelNotFoundError, match="not in LM Studio's models folder"):
        resolve_source("lmstudio:pub/none")


def test_a_bundled_gguf_runs_from_an_ollama_store(tmp_path, monkeypatch, real_dirs):
    """`ollama:NAME` loads the store's blob in process and answers as the bundled member does."""
    from ensemble_llm.members.fetch import fetch_bundled
    from ensemble_llm.members.registry import BUNDLED

    name = "smollm2-135m-instruct"
    src = fetch_bundled(BUNDLED[name], progress=False)
    root = tmp_path / "ollama"
    blob = ollama_store(root, "smollm2", "135m", b"GGUF")  # a placeholder blob, replaced by the real file
    os.remove(blob)
    digest = json.loads((root / "manifests/registry.ollama.ai/library/smollm2/135m").read_text())
    real = root / "blobs" / digest["layers"][0]["digest"].replace(":", "-")
    try:
        os.link(src, real)
    except OSError:
        shutil.copyfile(src, real)
    monkeypatch.setenv("OLLAMA_MODELS", str(root))
    prompt = "The capital of France is"
    with Ensemble(["ollama:smollm2:135m"]) as eng:
        got = eng.generate(prompt, max_new_tokens=8, temperature=0, raw=True)
        assert eng.members[0].name == "smollm2:135m"
    with Ensemble([name]) as eng:
        want = eng.generate(prompt, max_new_tokens=8, temperature=0, raw=True)
    assert got.text == want.text
