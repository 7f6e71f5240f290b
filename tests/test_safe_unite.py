"""`unite` and `safe` end to end: tiny models (fast) and the real bundled pair (marker `real`)."""

import pytest
import torch
from helpers import HF_PAIR

from ensemble_llm import DEFAULT_MODELS, ConfigError, Ensemble, SafeConfig
from ensemble_llm.methods import Request
from ensemble_llm.pipeline import member_prompts


@pytest.mark.parametrize("method", ["unite", "safe"])
def test_runs_on_tiny_pair_and_streams_what_it_returns(tiny_dirs, method):
    eng = Ensemble([tiny_dirs["smol"], tiny_dirs["gemma"]], method=method)
    res = eng.generate("Hello there", max_new_tokens=12)
    stream = eng.stream("Hello there", max_new_tokens=12)
    assert "".join(stream) == res.text == stream.result.text
    st = res.stats
    assert 0 < st["tokens_out"] <= 12
    assert st["members"][eng.members[1].name]["forward_passes"] >= 1
    a = eng.generate("Hi", max_new_tokens=8, temperature=0.9, seed=3).text
    assert a == eng.generate("Hi", max_new_tokens=8, temperature=0.9, seed=3).text


def test_config_validation(tiny_dirs):
    with pytest.raises(ConfigError, match="lookahead"):
        SafeConfig(lookahead=0)
    with pytest.raises(ConfigError, match="sharpen"):
        SafeConfig(sharpen="cubic")
    for method in ("safe", "unite"):
        with pytest.raises(ConfigError, match="onto_main must be True or False"):
            Ensemble([tiny_dirs["smol"], tiny_dirs["gemma"]], method=method, config={"onto_main": "yes"}).load()
    with pytest.raises(ConfigError, match="weights"):
        Ensemble([tiny_dirs["smol"], tiny_dirs["gemma"]], method="safe", config={"weights": [1, 2, 3]}).load()
    with pytest.raises(ConfigError, match="at least 2 members"):
        Ensemble([tiny_dirs["smol"]], method="safe").load()


def test_safe_stats_add_up_on_tiny_pair(tiny_dirs):
    eng = Ensemble([tiny_dirs["smol"], tiny_dirs["gemma"]], method="safe", config={"lookahead": 4, "adaptive": False})
    res = eng.generate("Tell me about the sea", max_new_tokens=20, trace=True)
    st = res.stats
    trace = st["trace"]
    assert st["skipped_oov"] == sum(t["reason"] == "oov" for t in trace)
    assert st["skipped_consensus"] == sum(t["reason"] == "consensus" for t in trace)
    assert st["tokens_ensembled"] == sum(t["reason"] == "ensemble" for t in trace)
    assert st["replacements"] == sum(t["reason"] == "ensemble" and t["choice"] != t["key"] for t in trace)
    # the drafter is the main member, whichever the weights make it
    names = sorted(st["members"], key=lambda n: n != st["main_member"])
    drafter, verifier = (st["members"][n]["forward_passes"] for n in names)
    assert verifier == st["cycles"] + 1  # prompt prefill + one pass per cycle
    # one drafter forward per drafted token (dropped ones included) + one per replacement + prefill
    assert st["tokens_out"] - st["replacements"] <= drafter <= 1 + 4 * st["cycles"] + st["replacements"]


# ---- the real bundled pair -------------------------------------------------------------------

PROMPTS = [
    "What is the capital of France?",
    "Name three colours.",
    "Sofía lives in Madrid. Where does she live?",
    "Write one sentence about 東京.",
]


@pytest.fixture(scope="module")
def safe_pair(real_dirs):
    return Ensemble(HF_PAIR, method="safe", config={"sharpen": None, "drafter": 0}).load()  # its caches are read


@pytest.mark.real
def test_consensus_skips_are_lossless_theorem_1(safe_pair):
    checked = 0
    for p, res in zip(PROMPTS, safe_pair.generate_many(PROMPTS, max_new_tokens=40, trace=True)):  # batched
        for t in res.stats["trace"]:
            if t["reason"] == "consensus":
                assert t["unite_pick"] == t["key"], (p, t)
                checked += 1
    assert checked >= 20


@pytest.mark.real
def test_rollback_leaves_every_cache_equal_to_a_fresh_prefill(safe_pair):
    eng = safe_pair  # drive the method's run() directly: its return value holds the final caches
    texts, stops = member_prompts(eng, eng._job("Sofía lives in Madrid. Where does she live?", None, {}), "auto")
    weights, main = eng.member_weights("chat")
    req = Request([m.prompt_ids(t) for m, t in zip(eng.members, texts)], 40, stops=stops, weights=weights, main=main)
    gen = eng._method.run(req)
    while True:
        try:
            next(gen)
        except StopIteration as end:
            last = end.value
            break
    assert req.stats.replacements >= 1  # the test must exercise a rollback
    drafter, dstate = safe_pair.members[0], last["drafter"]
    fresh = drafter.prefill(dstate.ids)
    for a, b in zip(dstate.cache.layers, fresh.cache.layers):
        assert torch.allclose(a.keys, b.keys, atol=1e-4) and torch.allclose(a.values, b.values, atol=1e-4)
    for view in last["views"]:
        view.sync(last["text"].decode("utf-8"))
        m = view.member
        fresh = m.prefill(view.state.ids)
        assert view.state.ids[view.prompt_len :] == m.encode(last["text"].decode("utf-8"))
        for a, b in zip(view.state.cache.layers, fresh.cache.layers):
            assert torch.allclose(a.keys, b.keys, atol=1e-4) and torch.allclose(a.values, b.values, atol=1e-4)


@pytest.mark.real
@pytest.mark.parametrize("method", ["safe", "unite"])
def test_real_pair_gives_well_formed_text(real_dirs, method):
    eng = Ensemble(list(DEFAULT_MODELS), method=method)
    res = eng.generate("What is the capital of France?", max_new_tokens=24)
    assert "Paris" in res.text and "\ufffd" not in res.text and "<|im_end|>" not in res.text
    assert res.stats["tokens_ensembled"] >= 1


@pytest.mark.real
@pytest.mark.parametrize("method", ["safe", "unite"])
def test_real_pair_ends_the_reply_where_the_transcript_member_ends_its_turn(real_dirs, method):
    """Gemma-3 has no chat template: in its plain transcript a reply ends with a newline and
    "User:". Its newline after a finished sentence is mostly that end; counted as text, it was
    written and the reply started over ("...on Earth.\n\nThe tallest mountain in the world is
    Mount Kilauea..."). Counted as the end it is, the reply ends there."""
    ask = [{"role": "user", "content": "What is the tallest mountain in the world?"}]
    res = Ensemble(list(DEFAULT_MODELS), method=method).generate(ask, max_new_tokens=48)
    assert res.finish_reason == "stop" and "Everest" in res.text and "\n" not in res.text


@pytest.mark.real
@pytest.mark.parametrize("method", ["unite", "safe"])
def test_real_pair_keeps_the_word_both_members_write(real_dirs, method):
    """plural, "tonne": SmolLM2 writes " ton" + "nes", Gemma-3 " tonnes"; both alone answer "tonnes".
    With UniTE's first-sub-token rule the stem " tonne" (a Gemma token SmolLM2 lacks) took SmolLM2's
    " ton" mass as well and won, and the answer ended there; onto the main member's tokens (the
    default) each member's mass counts once and the ensemble answers as both members do."""
    from ensemble_llm.bench import bundled_task, load_task

    shots, exs = load_task(bundled_task("plural"), 115)
    ex = next(x for x in exs if x["input"].strip() == "tonne")
    prompt = shots + "Q: tonne\nA:"
    ask = {"max_new_tokens": 8, "raw": True, "stop": ["\n"]}
    for i in (0, 1):  # (measured on transformers' numerics)
        assert Ensemble(HF_PAIR, "single", {"member": i}).generate(prompt, **ask).text == " tonnes"
    res = Ensemble(HF_PAIR, method).generate(prompt, **ask)
    assert res.text.strip() in ex["targets"] and res.stats["main_member"] == "smollm2-135m-instruct"
    assert Ensemble(HF_PAIR, method, {"onto_main": False}).generate(prompt, **ask).text == " tonne"
