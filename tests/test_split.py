"""Members larger than one device: per-member device_map / max_memory / offload_folder through
accelerate. On this CPU, max_memory forces a member to keep part of its layers on disk; its greedy
text, scores and tree-attention rows must equal the unsplit member's."""

from __future__ import annotations

import pytest
import torch
from helpers import SMOL, greedy

from ensemble_llm.errors import ConfigError
from ensemble_llm.members import clear_cache, load_member
from ensemble_llm.members.options import NO_OPTIONS, member_options
from ensemble_llm.requests import member_spec

PROMPT = "The quick brown fox jumps over the lazy dog. Then the fox"


def split_options(folder: str, tmp_path, layers_on_cpu: float = 1.5):
    """max_memory that holds the embeddings and about `layers_on_cpu` layers on the CPU, the rest on disk."""
    from pathlib import Path

    from ensemble_llm.members.plan import safetensors_header

    header = safetensors_header(next(Path(folder).glob("*.safetensors")))
    sizes = {k: torch.Size(v["shape"]).numel() * 4 for k, v in header.items() if k != "__metadata__"}
    embed = sum(n for k, n in sizes.items() if "embed_tokens" in k)
    layer = sum(n for k, n in sizes.items() if ".layers.0." in k)
    cpu = int(embed + layers_on_cpu * layer)
    return member_options({"max_memory": {"cpu": cpu}, "offload_folder": str(tmp_path / "offload")}, "test")


@pytest.mark.parametrize("kind", ["smol", pytest.param("gemma", marks=pytest.mark.slow)])
def test_split_member_equals_unsplit_member(four_layer_dirs, tmp_path, kind):
    folder = four_layer_dirs[kind]
    whole = load_member(folder, device="cpu")
    options = split_options(folder, tmp_path)
    split = load_member(folder, device="cpu", options=options)
    assert split is not whole
    placed = set(split.device_map.values())
    assert {"cpu", "disk"} <= placed, split.device_map  # a real split: some layers wait on disk
    assert split.device == torch.device("cpu")
    ids, text = greedy(whole, PROMPT)
    assert len(set(ids)) > 5  # a text that can tell two models apart
    assert greedy(split, PROMPT) == (ids, text)
    # the methods' other entry points: in-line candidate scoring and tree-attention rows (SMC)
    ids = whole.prompt_ids(PROMPT)
    cands = [whole.encode(" ran away"), whole.encode(" sat"), whole.encode(" slept all day")]
    a, b = whole.prefill(ids), split.prefill(ids)
    for x, y in zip(whole.score_inline(a, cands), split.score_inline(b, cands)):
        assert torch.allclose(x, y, atol=1e-5)
    kv_a, kv_b = whole.kv_tensor(a), split.kv_tensor(b)
    assert torch.allclose(kv_a, kv_b, atol=1e-5)
    la, _ = whole.forward_rows(kv_a, [[], []], cands[0][:1] + cands[1][:1])
    lb, _ = split.forward_rows(kv_b, [[], []], cands[0][:1] + cands[1][:1])
    assert torch.allclose(la, lb, atol=1e-4)


def test_options_are_part_of_the_cache_key(four_layer_dirs, tmp_path):
    folder = four_layer_dirs["smol"]
    options = split_options(folder, tmp_path)
    assert load_member(folder, device="cpu", options=options) is load_member(folder, device="cpu", options=options)
    assert load_member(folder, device="cpu", options=NO_OPTIONS) is load_member(folder, device="cpu")
    assert load_member(folder, device="cpu") is not load_member(folder, device="cpu", options=options)


def test_real_smollm2_split_over_cpu_and_disk_gives_the_same_text(real_dirs, tmp_path):
    folder = str(real_dirs[SMOL])
    whole = load_member(folder, device="cpu")
    options = split_options(folder, tmp_path, layers_on_cpu=24)
    split = load_member(folder, device="cpu", options=options)
    assert {"cpu", "disk"} <= set(split.device_map.values()), split.device_map
    prompt = "<|im_start|>user\nName three colours.<|im_end|>\n<|im_start|>assistant\n"
    ids_w, text_w = greedy(whole, prompt, 20)
    ids_s, text_s = greedy(split, prompt, 20)
    assert ids_s == ids_w and text_s == text_w and text_w.strip()
    clear_cache()


def test_member_options_are_checked():
    spec = member_spec({"model": "x/y", "max_memory": {"cpu": "1GiB"}, "offload_folder": "/tmp/o"}, 0)
    model, preamble = spec  # still unpacks as (model, preamble)
    assert model == "x/y" and preamble is None
    assert spec.options.device_map == "auto" and spec.options.max_memory == (("cpu", 2**30),)
    assert member_spec("x/y", 1).options == NO_OPTIONS
    bad = [
        ({"model": "x/y", "devices": "auto"}, "may have"),
        ({"model": "x/y", "device_map": "everywhere"}, "not an accelerate strategy"),
        ({"model": "x/y", "device_map": 3}, "strategy name"),
        ({"model": "x/y", "max_memory": "10GiB"}, "non-empty dict"),
        ({"model": "x/y", "max_memory": {"cpu": "lots"}}, "is not a size"),
        ({"model": "x/y", "max_memory": {"cpu": -1}}, "negative"),
        ({"model": "x/y", "max_memory": {"tpu": "1GB"}}, "not a device"),
        ({"model": "x/y", "max_memory": {"disk": "1GB"}}, "no offload_folder"),
        ({"model": "x/y", "revision": ""}, "revision"),
        ({"model": "x/y", "offload_folder": 3}, "offload_folder"),
    ]
    if not torch.cuda.is_available():
        bad.append(({"model": "x/y", "max_memory": {0: "1GB", "cpu": "1GB"}}, "names GPU 0, which does not exist"))
    for raw, words in bad:
        with pytest.raises(ConfigError, match=words):
            member_spec(raw, 0)


def test_revision_of_a_local_model_is_refused(four_layer_dirs):
    with pytest.raises(ConfigError, match="applies to hub ids only"):
        load_member(four_layer_dirs["smol"], device="cpu", options=member_options({"revision": "main"}, "m"))


def test_ensemble_single_with_a_split_member_gives_the_unsplit_text(four_layer_dirs, tmp_path):
    from ensemble_llm import Ensemble

    folder = four_layer_dirs["smol"]
    opts = split_options(folder, tmp_path)
    member = {"model": folder, "max_memory": opts.max_memory_dict(), "offload_folder": opts.offload_folder}
    whole = Ensemble([folder], method="single", device="cpu")
    split = Ensemble([member], method="single", device="cpu")
    a = whole.generate(PROMPT, max_new_tokens=20, temperature=0.0, raw=True).text
    b = split.generate(PROMPT, max_new_tokens=20, temperature=0.0, raw=True).text
    assert a == b and len(set(a.split())) > 3
    assert {"cpu", "disk"} <= set(split.members[0].device_map.values())
