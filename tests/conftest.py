"""Shared fixtures: tiny random-weight models built with the REAL bundled tokenizers (fast), and
the real bundled models (tests marked `real`)."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import pytest
import torch
from helpers import GEMMA, SMOL, tiny_gemma, tiny_llama  # noqa: E402,F401 (fixtures and tests use them)

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
def tokenizer_dirs():
    """Folders with the bundled pair's tokenizers: the converted models when they are there, else
    the tokenizers alone (extracted from the GGUFs, the weights never converted), so the fast tier
    converts no model."""
    from pathlib import Path

    from ensemble_llm.members.loader import tokenizer_dir

    if os.environ.get("ENSEMBLE_LLM_TEST_TOKENIZERS"):
        return {name: Path(os.environ["ENSEMBLE_LLM_TEST_TOKENIZERS"]) / name for name in (SMOL, GEMMA)}
    return {name: tokenizer_dir(name, progress=False) for name in (SMOL, GEMMA)}


@pytest.fixture(scope="session")
def tokenizers(tokenizer_dirs):
    from transformers import AutoTokenizer

    return {name: AutoTokenizer.from_pretrained(path) for name, path in tokenizer_dirs.items()}


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory, tokenizers):
    """Folders with tiny random-weight models and the real tokenizers: {'smol', 'gemma', 'smol_short'}."""
    torch.manual_seed(0)
    out = {}
    for key, build, name, ctx in (
        ("smol", tiny_llama, SMOL, 2048),
        ("gemma", tiny_gemma, GEMMA, 2048),
        ("smol_short", tiny_llama, SMOL, 64),
    ):
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


# Test tiers: a test that loads the real pair (any fixture built on `real_dirs`) is `real`, one in a
# module that starts `ensemble-llm serve` processes is `server`; `-m "not real and not ray and not
# server"` is the fast tier (README, Tests).
SERVER_MODULES = {"test_serve.py"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "real_dirs" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.real)
        if item.path.name in SERVER_MODULES:
            item.add_marker(pytest.mark.server)


@pytest.fixture(scope="session")
def four_layer_dirs(tmp_path_factory, tokenizers):
    """Tiny random-weight 4-layer models with the real tokenizers (room to split between layers)."""
    from helpers import GEMMA

    torch.manual_seed(1)
    out = {}
    for kind, name in (("smol", SMOL), ("gemma", GEMMA)):
        tok = tokenizers[name]
        path = tmp_path_factory.mktemp(f"split_{kind}")
        build = tiny_llama(len(tok), layers=4, init=0.3) if kind == "smol" else tiny_gemma(len(tok), layers=4)
        build.save_pretrained(path)  # init 0.3: varied greedy text (at 0.02 it repeats one token)
        tok.save_pretrained(path)
        out[kind] = str(path)
    return out
