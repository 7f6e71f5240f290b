"""`auto`, the default for 2+ members: a raw prompt runs (and scores) exactly as specfuse with the
raw config, a chat request exactly as safe with the chat config; each on its own engine here, the
reference."""

from __future__ import annotations

import pytest

from ensemble_llm import Ensemble
from ensemble_llm.errors import ConfigError

RAW_W, CHAT_W = [0.6, 0.4], [0.3, 0.7]  # given weights: no calibration, and the two kinds differ
RAW = "Q: What is the capital of Italy?\nA: Rome\nQ: What is the capital of Spain?\nA:"
CHAT = [{"role": "user", "content": "Name a large river."}]


@pytest.fixture(scope="module")
def engines(tiny_dirs):
    pair = [tiny_dirs["smol"], tiny_dirs["gemma"]]
    auto = Ensemble(pair, config={"raw": {"weights": RAW_W}, "chat": {"weights": CHAT_W}})
    spec = Ensemble(pair, "specfuse", {"weights": RAW_W})
    safe = Ensemble(pair, "safe", {"weights": CHAT_W})
    yield auto, spec, safe
    for e in (auto, spec, safe):
        e.close()


def test_auto_is_the_default_for_a_pair(engines):
    assert engines[0].method_name == "auto"


def test_a_raw_prompt_runs_as_specfuse_and_a_chat_as_safe(engines):
    auto, spec, safe = engines
    raw = auto.generate(RAW, raw=True, max_new_tokens=12)
    chat = auto.generate(CHAT, max_new_tokens=12)
    assert raw.stats["method"] == "specfuse" and chat.stats["method"] == "safe"
    assert raw.text == spec.generate(RAW, raw=True, max_new_tokens=12).text
    assert chat.text == safe.generate(CHAT, max_new_tokens=12).text
    assert raw.stats["member_weights"] == pytest.approx(dict(zip(raw.stats["member_weights"], RAW_W)))
    assert chat.stats["member_weights"] == pytest.approx(dict(zip(chat.stats["member_weights"], CHAT_W)))


def test_scores_follow_the_method_of_the_prompts_kind(engines):
    auto, spec, safe = engines
    texts = [" Madrid", " Rome"]
    raw = [s.logprob for s in auto.score(RAW, texts)]
    assert raw == pytest.approx([s.logprob for s in spec.score(RAW, texts)], abs=1e-6)
    chat = [s.logprob for s in auto.score(CHAT, texts, raw=False)]
    assert chat == pytest.approx([s.logprob for s in safe.score(CHAT, texts, raw=False)], abs=1e-6)
    # specfuse combines the members as a product, safe as a mixture: the two kinds differ
    assert chat != pytest.approx([s.logprob for s in spec.score(CHAT, texts, raw=False)], abs=1e-6)


def test_a_bad_sub_config_is_named(tiny_dirs):
    with pytest.raises(ConfigError, match=r"AutoConfig\.chat: SafeConfig has no field\(s\) \['segment_len'\]"):
        Ensemble([tiny_dirs["smol"], tiny_dirs["gemma"]], config={"chat": {"segment_len": 4}})
    with pytest.raises(ConfigError, match=r"AutoConfig has no field\(s\) \['weights'\].*valid: \['chat', 'raw'\]"):
        Ensemble([tiny_dirs["smol"], tiny_dirs["gemma"]], config={"weights": [0.5, 0.5]})


@pytest.mark.real
def test_the_default_answers_the_readme_question():
    """The README's question on the bundled pair: chat runs with safe, SmolLM2 drafting."""
    with Ensemble(["smollm2-135m-instruct", "gemma-3-270m"]) as eng:
        res = eng.generate("What is the capital of France?", max_new_tokens=40)
    assert res.stats["method"] == "safe" and "Paris" in res.text
