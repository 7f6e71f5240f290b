"""End-to-end on the real bundled models (marker `real`)."""

import os
import subprocess
import sys

import pytest
from helpers import HF_PAIR

from ensemble_llm import DEFAULT_MODELS, Ensemble

pytestmark = pytest.mark.real


@pytest.fixture(scope="module")
def pair(real_dirs):
    return Ensemble(list(DEFAULT_MODELS), method="single").load()


def test_default_pair_loads_on_cpu_fp32(pair):
    names = [m.name for m in pair.members]
    assert names == ["smollm2-135m-instruct", "gemma-3-270m"]
    for m in pair.members:
        assert str(m.device) == "cpu" and str(m.dtype) == "torch.float32"
    assert pair.members[0].has_chat_template and not pair.members[1].has_chat_template
    assert len(pair.members[0].vocab_bytes) >= 49152 and len(pair.members[1].vocab_bytes) >= 262144


def test_smollm2_answers_the_capital_of_france(pair):
    """On transformers SmolLM2 alone answers it; on llama.cpp (the default for its GGUF) its greedy
    answer starts "L'Étoile" (llama-cpp-python's own `Llama` writes the same: a near tie, 0.08 nat,
    turned by llama.cpp's int8 activations), and the default ensemble answers it."""
    res = Ensemble(HF_PAIR, method="single").generate("What is the capital of France?", max_new_tokens=16)
    assert "Paris" in res.text
    assert res.usage.completion_tokens > 0 and res.usage.prompt_tokens > 5
    assert "Paris" in Ensemble(list(DEFAULT_MODELS)).generate("What is the capital of France?", max_new_tokens=16).text


def test_gemma_completes_a_fact_through_the_plain_chat_fallback():
    eng = Ensemble(list(DEFAULT_MODELS), method="single", config={"member": 1})
    res = eng.generate("The capital of Germany is Berlin. The capital of France is", max_new_tokens=4, raw=True)
    assert res.text.startswith(" Paris")
    chat = eng.stream([{"role": "user", "content": "What is the capital of France?"}], max_new_tokens=48)
    text = "".join(chat)
    assert chat.result.usage.prompt_tokens == len(
        eng.members[1].prompt_ids(eng._chat_prompt(1, "What is the capital of France?"))
    )
    assert "Paris" in text  # the base model answers like an assistant behind its preamble
    assert "\nUser:" not in text  # the fallback transcript's next turn is a stop string


def test_cli_streams_an_answer(real_dirs):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    out = subprocess.run(
        [sys.executable, "-m", "ensemble_llm", "generate", "--max-new-tokens", "48"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout


def test_cli_reports_unknown_model_cleanly():
    out = subprocess.run(
        [sys.executable, "-m", "ensemble_llm", "generate", "hi", "--models", "nope-1b"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2 and "unknown model 'nope-1b'" in out.stderr and "gemma-3-270m" in out.stderr
