"""No code from data (issue 47): the model cache holds no file whose loading runs code (the
tokenizer cache is tokenizers' own tokenizer.json, checked against the sha256 its manifest
records), a pickle planted there is never read, writes go through uniquely named temporary files
under a lock, and a conversion counts only when its marker records the pinned sha256."""

from __future__ import annotations

import ast
import json
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ensemble_llm.members import BUNDLED
from ensemble_llm.members.convert import (
    MARKER,
    TOKEN_BYTES,
    TOKENIZER_CACHE,
    _temp_dir,
    cached_token_bytes,
    is_converted,
    load_cached_tokenizer,
)
from ensemble_llm.members.vocab import token_bytes

PACKAGE = Path(__file__).resolve().parents[1] / "ensemble_llm"
# modules whose loading of data can run code; and calls that do
UNSAFE_MODULES = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "joblib", "marshal", "shelve"}
UNSAFE_CALLS = {("torch", "load"), ("np", "load"), ("numpy", "load")}
TEXTS = [
    "Hello, world!",
    "  two  spaces",
    "naïve café — 東京 🙂",
    "<bos>x<eos>",
    "\n\tTab\n",
    '{"a": [1, 2]}',
    "x" * 200,
]


def test_no_module_of_the_package_can_load_code_from_data():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name.split(".")[0] for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module.split(".")[0]]
            found += [f"{path.name}: import {n}" for n in names if n in UNSAFE_MODULES]
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                base = node.func.value
                if isinstance(base, ast.Name) and (base.id, node.func.attr) in UNSAFE_CALLS:
                    found.append(f"{path.name}:{node.lineno}: {base.id}.{node.func.attr}")
    assert not found, found


def _tokenizer_folder(src: Path, dest: Path) -> Path:
    dest.mkdir()
    for f in src.iterdir():
        if f.suffix in (".json", ".jinja", ".model", ".txt"):
            shutil.copy(f, dest / f.name)
    return dest


class _Planted:
    """Unpickling this creates the file `path`: the proof that a pickle was read."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (Path.touch, (self.path,))


def test_a_planted_pickle_is_never_read(tokenizer_dirs, tmp_path):
    folder = _tokenizer_folder(Path(tokenizer_dirs["smollm2-135m-instruct"]), tmp_path / "smol")
    ran = tmp_path / "the pickle ran"
    for where in (folder / "tokenizer.ensemble_llm.pkl", folder / TOKENIZER_CACHE / "tokenizer.pkl"):
        where.parent.mkdir(exist_ok=True)
        where.write_bytes(pickle.dumps((None, _Planted(ran))))
    for _ in range(2):  # building the cache, then reading it
        tok = load_cached_tokenizer(folder)
        assert tok("hi", add_special_tokens=False).input_ids and not ran.exists()
    assert "tokenizer.json" in {p.name for p in (folder / TOKENIZER_CACHE).iterdir()}


@pytest.mark.parametrize(
    "name",
    ["smollm2-135m-instruct", pytest.param("gemma-3-270m", marks=pytest.mark.slow)],  # 262k tokens: ~15 s
)
def test_the_cached_tokenizer_is_the_built_one(tokenizer_dirs, tmp_path, name):
    """Built by AutoTokenizer the first time (Gemma's own class), read from tokenizer.json after:
    the same ids, offsets, decoding, special tokens, token bytes and chat template."""
    folder = _tokenizer_folder(Path(tokenizer_dirs[name]), tmp_path / "tok")
    built, cached = load_cached_tokenizer(folder), load_cached_tokenizer(folder)
    assert type(cached).__name__ in ("TokenizersBackend", "PreTrainedTokenizerFast")
    for text in TEXTS:
        a = built(text, add_special_tokens=False, return_offsets_mapping=True)
        b = cached(text, add_special_tokens=False, return_offsets_mapping=True)
        assert (a.input_ids, a.offset_mapping) == (b.input_ids, b.offset_mapping)
        assert built(text).input_ids == cached(text).input_ids
        assert built.decode(a.input_ids) == cached.decode(a.input_ids)
    assert (built.bos_token, built.eos_token_id, built.all_special_ids, len(built)) == (
        cached.bos_token,
        cached.eos_token_id,
        cached.all_special_ids,
        len(cached),
    )
    assert built.chat_template == cached.chat_template and built.padding_side == cached.padding_side
    assert token_bytes(built) == token_bytes(cached) == cached_token_bytes(folder)  # saved with the cache
    assert built.added_tokens_decoder == cached.added_tokens_decoder  # read from the config's list
    config = json.loads((folder / TOKENIZER_CACHE / "tokenizer_config.json").read_text())
    assert len(config["added_tokens_decoder"]) == len(built.added_tokens_decoder)


def test_token_bytes_that_differ_from_the_manifest_are_not_used(tokenizer_dirs, tmp_path):
    """The saved token bytes are read only when they are what the manifest records; a member then
    builds them from its tokenizer (the same bytes)."""
    from ensemble_llm.members.view import TokenizerView

    folder = _tokenizer_folder(Path(tokenizer_dirs["smollm2-135m-instruct"]), tmp_path / "smol")
    tokenizer = load_cached_tokenizer(folder)
    want = token_bytes(tokenizer)
    saved = folder / TOKENIZER_CACHE / TOKEN_BYTES
    raw = saved.read_bytes()
    saved.write_bytes(raw[:-2] + raw[-1:] + raw[-2:-1])  # the same layout, two bytes swapped: only the sha256 tells
    assert cached_token_bytes(folder) is None
    view = TokenizerView()
    view._init_tokens("smol", tokenizer, len(tokenizer) + 3, set(), str(folder))
    view.tokenizer_folder = str(folder)
    assert view.vocab_bytes == want[0] + [b""] * 3 and view.special_ids == want[1]
    saved.unlink()
    assert cached_token_bytes(folder) is None


def test_a_tampered_cache_file_is_rebuilt(tokenizer_dirs, tmp_path):
    folder = _tokenizer_folder(Path(tokenizer_dirs["smollm2-135m-instruct"]), tmp_path / "smol")
    want = load_cached_tokenizer(folder)("Hello there", add_special_tokens=False).input_ids
    cached = folder / TOKENIZER_CACHE / "tokenizer.json"
    data = json.loads(cached.read_text())
    data["model"]["vocab"] = {"Hello": 0}  # a different tokenizer, still valid JSON: only its sha256 tells
    cached.write_text(json.dumps(data))
    assert load_cached_tokenizer(folder)("Hello there", add_special_tokens=False).input_ids == want
    manifest = json.loads((folder / TOKENIZER_CACHE / "ensemble_llm_tokenizer.json").read_text())
    assert manifest["sha256"]["tokenizer.json"] != json.dumps(data)  # rewritten from the source
    assert not list(folder.glob("*.partial")) and not list(folder.glob(".*.partial"))


@pytest.mark.slow  # two fresh interpreters importing transformers
def test_processes_building_one_cache_at_once_agree(tokenizer_dirs, tmp_path):
    """Two processes build the same cache together: each writes its own temporary folder, the lock
    lets one rename it into place, and both end with the same working tokenizer."""
    folder = _tokenizer_folder(Path(tokenizer_dirs["smollm2-135m-instruct"]), tmp_path / "smol")
    code = (
        "import sys; from ensemble_llm.members.convert import load_cached_tokenizer as f; "
        "print(f(sys.argv[1])('Hello there', add_special_tokens=False).input_ids)"
    )
    procs = [
        subprocess.Popen([sys.executable, "-c", code, str(folder)], stdout=subprocess.PIPE, text=True) for _ in "ab"
    ]
    outs = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert all(p.returncode == 0 for p in procs) and outs[0] == outs[1] and outs[0].startswith("[")
    assert not [p.name for p in folder.iterdir() if p.name.endswith(".partial")]


def test_temporary_names_are_unique(tmp_path):
    out = tmp_path / "converted" / "m"
    out.parent.mkdir()
    a, b = _temp_dir(out), _temp_dir(out)
    assert a != b and a.parent == b.parent == out.parent and a.name.startswith(".m.")


def test_a_conversion_counts_only_with_the_pinned_sha256(tmp_path):
    model = BUNDLED["smollm2-135m-instruct"]
    out = tmp_path / model.name
    out.mkdir()
    (out / "config.json").write_text("{}")
    assert not is_converted(out)  # no marker
    (out / MARKER).write_text("not json")
    assert not is_converted(out)
    (out / MARKER).write_text(json.dumps({"bundled": model.name, "sha256": "0" * 64}))
    assert not is_converted(out)  # another file's conversion: done again
    (out / MARKER).write_text(json.dumps({"bundled": model.name, "sha256": model.sha256}))
    assert is_converted(out)
    (out / MARKER).write_text(json.dumps({"gguf": "/models/mine.gguf"}))  # a local file: keyed by its folder name
    assert is_converted(out)
