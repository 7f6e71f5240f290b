"""SpecFuse / SpecEM (method `specfuse`): in-line scoring, Hedge, selection, model exit, end to end."""

from __future__ import annotations

import math

import pytest
import torch

from ensemble_llm import ConfigError, Ensemble, SpecFuseConfig
from ensemble_llm.methods.specfuse import cut_draft, hedge_rewards, hedge_update, normalise


@pytest.mark.parametrize("key", ["smol", "gemma"])
def test_score_inline_raw_logits_equal_separate_forwards(tiny_members, key):
    """score="logit" mode: in-line raw logits equal those of separate full forwards, for candidates
    of different lengths (the log-prob mode is checked in test_members)."""
    m = tiny_members[key]
    state = m.prefill(m.prompt_ids("The weather today is"))
    cands = [m.encode(" sunny"), m.encode(" cold and very windy, sadly."), m.encode(" ok")]
    got = m.score_inline(state, cands, raw_logits=True)
    for c, g in zip(cands, got):
        ids = torch.tensor([state.ids + c])
        with torch.inference_mode():
            logits = m.model(input_ids=ids).logits[0].float()
        p = len(state.ids)
        want = logits[p - 1 : p - 1 + len(c)].gather(1, torch.tensor(c)[:, None])[:, 0]
        assert torch.allclose(g, want, atol=1e-3)


def test_inline_scores_across_tokenizers_match_separate_scoring(tiny_members):
    """The same candidate texts, re-tokenized by two members with different tokenizers, scored in
    one forward each, equal each member's separate scoring of each candidate."""
    texts = [" Paris.", " It is Paris, the city of light.", " Lyon"]
    for m in (tiny_members["smol"], tiny_members["gemma"]):
        state = m.prefill(m.prompt_ids("Capital of France?"))
        cands = [m.encode(t) for t in texts]
        assert len({len(c) for c in cands}) == 3
        got = m.score_inline(state, cands)
        for c, g in zip(cands, got):
            s2 = m.prefill(state.ids)
            lp = torch.cat([s2.next_logprobs[None], m.extend(s2, c)[:-1]])
            assert torch.allclose(g, lp.gather(1, torch.tensor(c)[:, None])[:, 0], atol=1e-4)


def test_cut_draft():
    assert cut_draft(b"The capital of Fra", False) == b"The capital of"
    assert cut_draft(b"The capital of Fra", True) == b"The capital of Fra"  # EOS: kept whole
    assert cut_draft(b"Hello, world. ", False) == b"Hello, world. "  # ends in a space: whole
    assert cut_draft(b"Antidisestablishment", False) == b"Antidisestablishment"  # nothing to cut at
    assert cut_draft("Tokyo \u6771".encode()[:-1], False) == b"Tokyo "  # incomplete UTF-8 dropped


def test_hedge_by_hand():
    # 3 members, each drafted one candidate (owner i = candidate i)
    s = torch.tensor([[0.5, 0.3, 0.2], [0.2, 0.5, 0.3], [0.6, 0.1, 0.3]], dtype=torch.float64)
    r = hedge_rewards(s, [0, 1, 2])
    # candidate 0: verifiers 1, 2; vs candidates 1, 2: v1: 0.2>=0.5 no, 0.2>=0.3 no; v2: 0.6>=0.1, 0.6>=0.3 -> 2/4
    # candidate 1: verifiers 0, 2: v0: 0.3>=0.5 no, 0.3>=0.2 yes; v2: 0.1>=0.6 no, 0.1>=0.3 no -> 1/4
    # candidate 2: verifiers 0, 1: v0: 0.2>=0.5 no, 0.2>=0.3 no; v1: 0.3>=0.2 yes, 0.3>=0.5 no -> 1/4
    assert r.tolist() == [0.5, 0.25, 0.25]
    w = hedge_update(torch.full((3,), 1 / 3, dtype=torch.float64), r, eta=math.sqrt(1 / 3))
    e = [math.exp(math.sqrt(1 / 3) * x) for x in (0.5, 0.25, 0.25)]
    assert torch.allclose(w, torch.tensor([x / sum(e) for x in e], dtype=torch.float64))
    # selection: argmax_c sum_v w_v S[v, c]
    total = (w[:, None] * s).sum(0)
    want = [sum(w[v] * s[v, c] for v in range(3)) for c in range(3)]
    assert torch.allclose(total, torch.tensor(want, dtype=torch.float64)) and int(total.argmax()) == 0


def test_normalise():
    lp = torch.tensor([[math.log(0.5), math.log(0.25)]], dtype=torch.float64)
    assert torch.allclose(normalise(lp, "logprob"), torch.tensor([[2 / 3, 1 / 3]], dtype=torch.float64))
    lg = torch.tensor([[3.0, -1.0, 1.0]], dtype=torch.float64)
    n = normalise(lg, "logit")
    assert torch.allclose(n.sum(1), torch.ones(1, dtype=torch.float64)) and n[0].argmax() == 0 and n[0, 1] < 1e-5


def test_config_errors():
    for kw, msg in (
        ({"segment_len": 0}, "segment_len"),
        ({"score": "prob"}, "score"),
        ({"hedge_lr": 0}, "hedge_lr"),
        ({"exit_threshold": 1.5}, "exit_threshold"),
        ({"weights": [-1, 2]}, "weights"),
    ):
        with pytest.raises(ConfigError, match=msg):
            SpecFuseConfig(**kw)


@pytest.fixture(scope="module")
def engine(tiny_dirs):
    return Ensemble([tiny_dirs["smol"], tiny_dirs["gemma"]], method="specfuse", config={"segment_len": 6})


def test_end_to_end_stats_consistent(engine):
    res = engine.generate("Tell me about the sea.", max_new_tokens=30)
    st = res.stats
    assert st["rounds"] == sum(st["wins"].values()) >= 1
    assert abs(sum(st["weights"].values()) - 1) < 1e-9 and st["tokens_out"] <= 30
    assert st["tokens_out"] == sum(st["segment_tokens"])
    main = next(m for m in engine.members if m.name == st["main_member"])  # the budget's unit
    assert len(main.encode(res.text)) <= 30
    # every member drafted and verified once per round, plus one prefill and one sync per round
    for m in engine.members:
        assert st["members"][m.name]["forward_passes"] >= 2 * st["rounds"]
    streamed = "".join(engine.stream("Tell me about the sea.", max_new_tokens=30))
    assert streamed == res.text  # greedy: same output, streamed segment by segment


def test_sampling_is_seeded(engine):
    a = engine.generate("Hello", max_new_tokens=20, temperature=0.8, seed=3).text
    b = engine.generate("Hello", max_new_tokens=20, temperature=0.8, seed=3).text
    assert a == b


def test_model_exit(tiny_dirs):
    eng = Ensemble(
        [tiny_dirs["smol"], tiny_dirs["gemma"]],
        method="specfuse",
        config=SpecFuseConfig(segment_len=4, hedge=False, weights=[0.3, 0.7], exit_threshold=0.4),
    )
    res = eng.generate("Tell me a story.", max_new_tokens=24)
    st = res.stats
    assert st["active"][eng.members[0].name] is False and st["active"][eng.members[1].name] is True
    assert st["drafts_saved"] == st["rounds"] - 1  # member 0 drafted in the first round only
    keep = Ensemble(
        [tiny_dirs["smol"], tiny_dirs["gemma"]],
        method="specfuse",
        config=SpecFuseConfig(segment_len=4, hedge=False, weights=[0.3, 0.7]),
    )
    assert keep.generate("Tell me a story.", max_new_tokens=24).stats["drafts_saved"] == 0


def test_needs_two_members(tiny_dirs):
    with pytest.raises(ConfigError, match="at least 2 members"):
        Ensemble([tiny_dirs["smol"]], method="specfuse").load()


@pytest.mark.real
def test_real_pair_well_formed():
    """specfuse is the default for raw prompts (the default's chat answer: test_auto). In chat,
    with the chat weights fitted on answering, it follows SmolLM2, whose llama.cpp reply to this
    question is L'Étoile (docs/methods/auto.md)."""
    eng = Ensemble(["smollm2-135m-instruct", "gemma-3-270m"], method="specfuse")
    prompt = "Q: What is the capital of Italy?\nA: Rome\nQ: What is the capital of France?\nA:"
    res = eng.generate(prompt, raw=True, max_new_tokens=16, stop=["\n"])
    assert "\ufffd" not in res.text and res.text.strip() and "<" not in res.text
    assert "Paris" in res.text
    assert res.stats["rounds"] == sum(res.stats["wins"].values())
    chat = eng.generate("What is the capital of France?", max_new_tokens=40)
    assert "\ufffd" not in chat.text and chat.text.strip() and "<" not in chat.text


@pytest.mark.parametrize("key", ["smol", "gemma"])
def test_kept_candidate_equals_a_plain_extension(tiny_members, key):
    """The winner's KV from the scoring forward is the KV a plain extension computes: keeping it
    leaves the cache and next distribution of a fresh prefill (tiny Gemma: sliding window 8)."""
    m = tiny_members[key]
    ctx = m.prompt_ids("The weather today is")
    cands = [m.encode(" sunny"), m.encode(" cold and very windy, sadly."), m.encode(" ok")]
    for index in range(3):
        state = m.prefill(ctx)
        m.score_inline(state, cands, keep=True)
        m.keep_candidate(state, index)
        fresh = m.prefill(ctx + cands[index])
        assert state.ids == fresh.ids
        for a, b in zip(state.cache.layers, fresh.cache.layers):
            assert torch.allclose(a.keys, b.keys, atol=1e-4) and torch.allclose(a.values, b.values, atol=1e-4)
        assert torch.allclose(state.next_logprobs, fresh.next_logprobs, atol=1e-4)
        m.extend(state, [5])  # the cache goes on as usual
        assert torch.allclose(state.next_logprobs, m.prefill(ctx + cands[index] + [5]).next_logprobs, atol=1e-4)
    state = m.prefill(ctx)
    m.score_inline(state, cands, keep=True)
    m.drop_candidates(state)
    assert state.ids == ctx and state.cache.get_seq_length() == len(ctx)


def test_keeping_scored_kv_changes_nothing_but_forward_passes(tiny_dirs, monkeypatch):
    """Fast path (keep the winner's scored KV) against the slow path (re-sync every member)."""
    from ensemble_llm.methods.specfuse import SpecFuse

    eng = Ensemble([tiny_dirs["smol"], tiny_dirs["gemma"]], method="specfuse", config={"segment_len": 4})
    fast = eng.generate("Tell me about the sea", max_new_tokens=24)
    assert fast.stats["kept_scored_kv"] >= 1

    def slow(view, decoded, old, ids, index):
        view.member.drop_candidates(view.state)
        view.sync(decoded, from_byte=old)
        return False

    monkeypatch.setattr(SpecFuse, "_advance", staticmethod(slow))
    ref = eng.generate("Tell me about the sea", max_new_tokens=24)
    assert ref.text == fast.text
    passes = lambda r: sum(f["forward_passes"] for f in r.stats["members"].values())  # noqa: E731
    assert passes(fast) == passes(ref) - fast.stats["kept_scored_kv"]
