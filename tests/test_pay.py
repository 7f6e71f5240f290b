"""What makes the methods pay (issue 17): stop strings end drafts, per-member preambles, weights
that follow competence ("auto"), SAFE's adaptive lookahead, smc's mode search at temperature 0."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from ensemble_llm import DEFAULT_MODELS, ConfigError, Ensemble, SafeConfig
from ensemble_llm.bench import contains_answer, load_task, repeats, resolve_task
from ensemble_llm.calibrate import ANSWER_EPS, answer_weights, as_question, em_weights, greedy_reply
from ensemble_llm.chat import BASE_PREAMBLE, check_preamble, with_preamble
from ensemble_llm.methods.smc import SmcConfig
from ensemble_llm.methods.unite import UniteConfig
from ensemble_llm.pipeline import member_prompts

SHOTS = (
    "Q: The capital of Germany is\nA: Berlin\nQ: The capital of Italy is\nA: Rome\n"
    "Q: The author of Hamlet is\nA: William Shakespeare\n"
)


# ---- weights="auto": EM mixture weights ----------------------------------------------------------
def _loglik(ll: np.ndarray, w: np.ndarray) -> float:
    return float(np.logaddexp.reduce(ll + np.log(np.maximum(w, 1e-300)), axis=1).sum())


@pytest.mark.parametrize("k", [2, 3])
def test_em_weights_maximise_the_mixture_likelihood_brute_force(k):
    rng = np.random.default_rng(k)
    ll = rng.normal(-3, 1.5, size=(30, k))
    w = em_weights(ll)
    assert abs(w.sum() - 1) < 1e-9 and (w >= 0).all()
    grid = np.linspace(0, 1, 101)
    best = -math.inf
    for cell in itertools.product(grid, repeat=k - 1):
        if sum(cell) <= 1:
            best = max(best, _loglik(ll, np.array([*cell, 1 - sum(cell)])))
    assert _loglik(ll, w) >= best - 1e-6  # at least as good as the best grid point


def test_em_gives_a_dominant_member_almost_all_weight():
    ll = np.array([[-1.0, -5.0]] * 20)
    w = em_weights(ll)
    assert w[0] > 0.99


def test_answer_weights_maximise_the_answering_likelihood_brute_force():
    rng = np.random.default_rng(7)
    right = (rng.random((40, 2)) < [0.6, 0.45]).astype(float)
    w = answer_weights(right)
    p = ANSWER_EPS + (1 - 2 * ANSWER_EPS) * right
    grid = np.linspace(0, 1, 1001)
    objective = [float(np.log(p @ np.array([g, 1 - g])).sum()) for g in grid]
    assert abs(w[0] - grid[int(np.argmax(objective))]) <= 1e-3
    # questions both members answer, or both miss, say nothing: only the ones they split count
    split = np.array([[1, 0]] * 6 + [[0, 1]] * 2 + [[1, 1]] * 20 + [[0, 0]] * 12, dtype=float)
    assert answer_weights(split)[0] == pytest.approx(answer_weights(split[:8])[0], abs=1e-6)
    assert answer_weights(np.array([[1, 0]] * 10, dtype=float))[0] > 0.99


@pytest.mark.real
def test_greedy_reply_is_the_single_members_text():
    """The chat calibration's greedy reply (the member's state API outside a request) is the text
    the engine writes with that member alone, end to end on the bundled pair."""
    from ensemble_llm.chat import chat_stops

    pair = Ensemble(list(DEFAULT_MODELS), progress=False).load()
    for i, name in enumerate(DEFAULT_MODELS):
        alone = Ensemble([name], progress=False)
        for question in ("What is the capital of Japan?", "What is the chemical symbol for gold?"):
            member = pair.members[i]
            reply = greedy_reply(member, member.prompt_ids(pair._chat_prompt(i, question)), chat_stops(member), 24)
            text = alone.generate([{"role": "user", "content": question}], max_new_tokens=24).text
            assert reply.strip() == text.strip(), (name, question)
        alone.close()
    pair.close()


def test_as_question():
    assert as_question("The capital of Japan is") == "What is the capital of Japan?"


@pytest.mark.slow
def test_auto_weights_cached_and_main_member_rules(tiny_dirs, tmp_path):
    pair = [tiny_dirs["smol"], tiny_dirs["gemma"]]
    eng = Ensemble(pair, method="unite", cache_dir=tmp_path)
    w, main = eng.member_weights("raw")
    assert len(w) == 2 and abs(sum(w) - 1) < 1e-9 and main == int(np.argmax(w))
    assert (tmp_path / "calibration").is_dir()
    # a second engine (same members) reads the cache: no forward pass at all
    again = Ensemble(pair, method="unite", cache_dir=tmp_path)
    before = [m.n_forward for m in again.members]
    assert again.member_weights("raw") == (w, main)
    assert [m.n_forward for m in again.members] == before
    # explicit weights: normalised, the largest is the main member; uniform: the larger model
    assert Ensemble(pair, "unite", {"weights": [1, 3]}).member_weights("chat") == ([0.25, 0.75], 1)
    uni = Ensemble(pair, "unite", {"weights": None})
    w, main = uni.member_weights("chat")
    assert w == [0.5, 0.5] and main == max(range(2), key=lambda i: uni.members[i].n_params)
    # an explicit main member wins
    assert Ensemble(pair, "safe", {"drafter": 1, "weights": [3, 1]}).member_weights("raw")[1] == 1


@pytest.mark.parametrize("bad", [[float("nan"), 1.0], [float("inf"), 1.0], [-1, 2], "uniform", [True, 1]])
def test_bad_weights_are_refused(bad):
    with pytest.raises(ConfigError, match="weights"):
        UniteConfig(weights=bad)


def test_unbounded_top_k_and_single_member_smc_are_refused(tiny_dirs):
    with pytest.raises(ConfigError, match="top_k"):
        UniteConfig(top_k=10**9)
    with pytest.raises(ConfigError, match="K >= 2"):
        Ensemble([tiny_dirs["smol"]], method="smc")  # at construction, nothing loaded (reliability D13)
    for method in ("safe", "unite", "specfuse"):
        with pytest.raises(ConfigError, match="at least 2 members"):
            Ensemble([tiny_dirs["smol"]], method=method)
    with pytest.raises(ConfigError, match="weights"):
        Ensemble([tiny_dirs["smol"], tiny_dirs["gemma"]], method="safe", config={"weights": [1, 2, 3]})


# ---- preambles ------------------------------------------------------------------------------------
def test_preamble_rules():
    assert with_preamble([], [{"role": "user", "content": "hi"}]) == [{"role": "user", "content": "hi"}]
    merged = with_preamble(
        list(BASE_PREAMBLE), [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "hi"}]
    )
    assert merged[0]["role"] == "system" and merged[0]["content"].endswith("\nBe terse.")
    assert merged[1:-1] == list(BASE_PREAMBLE[1:]) and merged[-1] == {"role": "user", "content": "hi"}
    with pytest.raises(ConfigError, match="preamble message 1"):
        check_preamble([{"role": "user", "content": "a"}, {"role": "tool", "content": "b"}], "m")
    with pytest.raises(ConfigError, match="system message must come first"):
        check_preamble([{"role": "user", "content": "a"}, {"role": "system", "content": "b"}], "m")


def test_member_dict_gives_that_member_its_preamble(tiny_dirs):
    own = [{"role": "user", "content": "Ping?"}, {"role": "assistant", "content": "Pong."}]
    eng = Ensemble([{"model": tiny_dirs["smol"], "preamble": own}, tiny_dirs["gemma"]], method="unite")
    texts, _ = member_prompts(eng, eng._job("What is 2+2?", None, {}), "auto")
    assert "Ping?" in texts[0] and "Pong." in texts[0] and "Ping?" not in texts[1]
    assert BASE_PREAMBLE[2]["content"] in texts[1]  # Gemma's tokenizer has no template: the built-in one
    assert texts[1].rstrip().endswith("What is 2+2?\nAssistant:")
    off = Ensemble([tiny_dirs["smol"], {"model": tiny_dirs["gemma"], "preamble": []}], method="unite")
    texts, _ = member_prompts(off, off._job("What is 2+2?", None, {}), "auto")
    assert BASE_PREAMBLE[2]["content"] not in texts[1]
    raw, _ = member_prompts(eng, eng._job("Q: x\nA:", None, {"raw": True}), "auto")
    assert raw == ["Q: x\nA:", "Q: x\nA:"]  # raw prompts are used as they are
    with pytest.raises(ConfigError, match="needs a 'model'"):
        Ensemble([{"preamble": own}])
    with pytest.raises(ConfigError, match="preamble"):
        Ensemble([{"model": tiny_dirs["smol"], "preamble": "be nice"}])


# ---- SAFE: adaptive lookahead, and a drafter-only weighting is the drafter itself ----------------
def test_safe_with_all_weight_on_the_drafter_is_the_drafter_and_lookahead_grows(tiny_dirs):
    pair = [tiny_dirs["smol"], tiny_dirs["gemma"]]
    alone = Ensemble(pair, "single", {"member": 0}).generate("Tell me about the sea", max_new_tokens=30)
    eng = Ensemble(pair, "safe", {"drafter": 0, "weights": [1.0, 0.0], "lookahead": 3})
    res = eng.generate("Tell me about the sea", max_new_tokens=30)
    assert res.text == alone.text  # every ensemble point picks the drafter's own argmax
    st = res.stats
    assert st["replacements"] == 0
    # no replacement: the lookahead goes 3, 5, 7, ... so 30 tokens need at most 5 cycles (fixed: 10)
    assert st["cycles"] <= 5
    fixed = Ensemble(pair, "safe", {"drafter": 0, "weights": [1.0, 0.0], "lookahead": 3, "adaptive": False})
    assert fixed.generate("Tell me about the sea", max_new_tokens=30).stats["cycles"] >= st["cycles"]
    with pytest.raises(ConfigError, match="adaptive"):
        SafeConfig(adaptive="yes")


# ---- smc at temperature 0: beam search for the mode of pi_f -----------------------------------------
def test_smc_temperature_zero_searches_deterministically(tiny_dirs):
    eng = Ensemble([tiny_dirs["smol"], tiny_dirs["gemma"]], method="smc", config={"n_particles": 3})
    res = eng.generate("Tell me about the sea.", max_new_tokens=6)
    assert res.stats["search"] == "beam" and res.stats["beam_steps"] >= 1
    assert "".join(eng.stream("Tell me about the sea.", max_new_tokens=6)) == res.text
    for m in eng.members:  # one prefill, then at most one batched forward per byte step
        assert res.stats["members"][m.name]["forward_passes"] <= res.stats["beam_steps"] + 1
    sample = Ensemble(
        [tiny_dirs["smol"], tiny_dirs["gemma"]], method="smc", config={"n_particles": 3, "greedy": "sample"}
    ).generate("Hi", max_new_tokens=4)
    assert sample.stats["search"] == "smc"
    with pytest.raises(ConfigError, match="greedy"):
        SmcConfig(greedy="argmax")


# ---- bench scoring helpers ----------------------------------------------------------------------------
def test_chat_scoring_helpers():
    assert repeats("I'm happy to help you with that. Paris. I'm happy to help you with that.")
    assert repeats("one two three four five six and one two three four five six")
    assert not repeats("The capital of France is Paris. It is a large city.")
    assert contains_answer("It is PARIS.", ["Paris"]) and not contains_answer("Lyon", ["Paris"])
    path, n = resolve_task("chat_facts", 10)
    shots, exs = load_task(path, n)
    assert shots == "" and len(exs) == 10 and all(e["targets"] for e in exs)
    assert len(load_task(path, 1000)[1]) >= 40


# ---- the real bundled models ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def pair_engines(real_dirs):
    return {
        m: Ensemble(list(DEFAULT_MODELS), method=m, config={"n_particles": 4} if m == "smc" else None).load()
        for m in ("unite", "safe", "specfuse", "smc")
    }


@pytest.mark.real
@pytest.mark.parametrize("method", ["unite", "safe", "specfuse", "smc"])
def test_one_word_answer_costs_no_draft_past_the_stop(pair_engines, method):
    """A one-word few-shot answer: the stop "\\n" ends drafting, scoring and verifying at once."""
    eng = pair_engines[method]
    res = eng.generate(SHOTS + "Q: The capital of France is\nA:", raw=True, max_new_tokens=16, stop=["\n"])
    assert res.text.strip() == "Paris" and res.finish_reason == "stop"
    fwd = {name: f["forward_passes"] for name, f in res.stats["members"].items()}
    main = eng.members[eng.member_weights("raw")[1]]
    answer = len(main.encode(" Paris\n"))  # the tokens up to and including the stop
    if method == "safe":
        assert res.stats["cycles"] == 1
        assert fwd[main.name] <= 1 + answer  # prefill + one per drafted token before the stop
        assert all(v <= 2 for k, v in fwd.items() if k != main.name)  # prefill + one verify pass
    elif method == "specfuse":
        assert res.stats["rounds"] == 1
        assert all(v <= 2 + answer for v in fwd.values())  # prefill + drafts + one scoring pass
    elif method == "unite":
        assert all(v <= 1 + answer for v in fwd.values())


@pytest.mark.real
def test_base_model_answers_like_an_assistant_with_its_preamble(real_dirs):
    gemma = Ensemble(["gemma-3-270m"])
    assert "Paris" in gemma.generate("What is the capital of France?", max_new_tokens=24).text
    bare = Ensemble([{"model": "gemma-3-270m", "preamble": []}])
    assert bare.member_preamble(0) == []


def test_bench_chat_task_with_and_without_preambles(tiny_dirs):
    from ensemble_llm.bench import parse_methods, run_bench

    models = [tiny_dirs["smol"], tiny_dirs["gemma"]]
    for pre in (True, False):
        res = run_bench(
            models,
            parse_methods(["single:member=1"], 2),
            [resolve_task("chat_facts:2", 0)],
            speed_prompts=0,
            progress=False,
            preambles=pre,
        )
        row = res["methods"]["single-1"]
        assert res["preambles"] is pre and row["correct"]["chat_facts"] in (0, 1, 2)
        assert row["repeating"]["chat_facts"] in (0, 1, 2)
