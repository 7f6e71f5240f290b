"""Shared fixtures: tiny random-weight models built with the REAL bundled tokenizers (fast), and
the real bundled models (tests marked `real`)."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import pytest
import torch

SMOL = "smollm2-135m-instruct"
GEMMA = "gemma-3-270m"


# On a GPU machine without the bundled weights (ENSEMBLE_LLM_TEST_TOKENIZERS: a folder holding
# <name>/ with the tokenizer files only), the tiny-model tests still run; deselect `real` there.
# ENSEMBLE_LLM_TEST_FP32=1 keeps "auto" dtype at float32 on CUDA so exactness tests keep 1e-5.
if os.environ.get("ENSEMBLE_LLM_TEST_FP32"):
    from ensemble_llm.members import loader as _loader

    _resolve = _loader.resolve_dtype
    _loader.resolve_dtype = lambda dtype, device: torch.float32 if dtype in (None, "auto") else _resolve(dtype, device)
    import ensemble_llm.engine as _engine

    _engine.resolve_dtype = _loader.resolve_dtype


@pytest.fixture(scope="session")
def real_dirs():
    """Converted folders of the bundled pair (fetched and converted once per machine)."""
    from pathlib import Path

    from ensemble_llm.members.loader import local_dir, resolve_source

    if os.environ.get("ENSEMBLE_LLM_TEST_TOKENIZERS"):
        return {name: Path(os.environ["ENSEMBLE_LLM_TEST_TOKENIZERS"]) / name for name in (SMOL, GEMMA)}
    return {name: local_dir(resolve_source(name), progress=False) for name in (SMOL, GEMMA)}


@pytest.fixture(scope="session")
def tokenizers(real_dirs):
    from transformers import AutoTokenizer

    return {name: AutoTokenizer.from_pretrained(path) for name, path in real_dirs.items()}


def _tiny_llama(vocab: int, ctx: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=ctx,
                      bos_token_id=1, eos_token_id=2, pad_token_id=2, tie_word_embeddings=True)
    return LlamaForCausalLM(cfg)


def _tiny_gemma(vocab: int, ctx: int):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    cfg = Gemma3TextConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=2, num_key_value_heads=1, head_dim=16, sliding_window=8,
                           layer_types=["sliding_attention", "full_attention"], max_position_embeddings=ctx,
                           bos_token_id=2, eos_token_id=1, pad_token_id=0)
    return Gemma3ForCausalLM(cfg)


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory, tokenizers):
    """Folders with tiny random-weight models and the real tokenizers: {'smol', 'gemma', 'smol_short'}."""
    torch.manual_seed(0)
    out = {}
    for key, build, name, ctx in (("smol", _tiny_llama, SMOL, 2048), ("gemma", _tiny_gemma, GEMMA, 2048),
                                  ("smol_short", _tiny_llama, SMOL, 64)):
        tok = tokenizers[name]
        model = build(len(tok), ctx)
        path = tmp_path_factory.mktemp(f"tiny_{key}")
        model.save_pretrained(path)
        tok.save_pretrained(path)
        out[key] = str(path)
    return out


@pytest.fixture(scope="session")
def tiny_members(tiny_dirs):
    from ensemble_llm.members import load_member

    return {k: load_member(v) for k, v in tiny_dirs.items()}


@pytest.fixture
def loop_ticks():
    """`async with loop_ticks(interval) as ticks:` counts event-loop turns (ticks[0]) while the
    body awaits: proof that the awaited work does not block the loop."""
    import asyncio
    import contextlib

    @contextlib.asynccontextmanager
    async def counting(interval: float = 0.005):
        ticks = [0]

        async def tick():
            while True:
                await asyncio.sleep(interval)
                ticks[0] += 1

        task = asyncio.create_task(tick())
        try:
            yield ticks
        finally:
            task.cancel()

    return counting


def start_server(models: list[str], method: str, api_key: str | None = None, max_queue: int = 64,
                 timeout: float = 240.0, extra: list[str] = ()):
    """`ensemble-llm serve` in a real process on a free 127.0.0.1 port; returns (process, base URL)
    once /health answers. The caller terminates the process."""
    import socket
    import subprocess
    import sys
    import time

    import httpx

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [sys.executable, "-m", "ensemble_llm", "serve", "--models", ",".join(models), "--method", method,
           "--port", str(port), "--max-queue", str(max_queue)] + (["--api-key", api_key] if api_key else []) \
        + list(extra)
    proc = subprocess.Popen(cmd, env={**os.environ, "HF_HUB_OFFLINE": "1"}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("the server exited:\n" + proc.stdout.read())
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            time.sleep(0.3)
    proc.kill()
    raise RuntimeError(f"the server did not come up in {timeout:.0f} s")
