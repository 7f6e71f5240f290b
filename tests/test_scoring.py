"""The ensemble as a scorer (scoring.py): byte steps against the definition on byte LMs whose
distributions are tables, against enumeration of every tokenization on tiny random-weight
members with the real tokenizers, and `Ensemble.score` end to end."""

from __future__ import annotations

import asyncio
import functools
import math

import numpy as np
import pytest
import torch
from test_smc import TableLM

from ensemble_llm import Ensemble, RequestError
from ensemble_llm.members.bytelm import EOS, ByteLM, byte_trie
from ensemble_llm.methods.smc import f_ensemble
from ensemble_llm.scoring import Scoring, byte_steps, token_spans

TAUS = {"product": 0.0, "mixture": 1.0, "min": -math.inf, "power2": 2.0}


def definition(lms, x: bytes, tau: float, w) -> tuple[list[float], np.ndarray]:
    """log q(x_i | x_<i) straight from the definition: P_k(x_<i b) for every slot, their power
    mean, normalised over the 257 slots; and each member's own conditional [K, len(x)]."""
    w = np.asarray(w, float) / np.sum(w)
    ens, own = [], []
    for i in range(len(x)):
        logq = np.stack([lm.logq(x[:i]) for lm in lms])  # [K, 257]
        prefix = np.array([sum(lm.logq(x[:j])[x[j]] for j in range(i)) for lm in lms])
        psi = f_ensemble(prefix[:, None] + logq, tau, w, axis=0)
        ens.append(float(psi[x[i]] - np.logaddexp.reduce(psi)))
        own.append(logq[:, x[i]])
    return ens, np.array(own).T


@pytest.mark.parametrize("tau", TAUS.values(), ids=TAUS.keys())
def test_byte_steps_follow_the_definition(tau):
    lms = [TableLM(s, L=6) for s in (1, 2, 3)]
    w = [0.2, 0.3, 0.5]
    texts = [b"abba", b"abab", b"b", b"abbaab"]  # shared prefixes: computed once, the same figures
    steps, argmax = byte_steps(lms, [b""] * 3, texts, tau, w)
    for x, s, top in zip(texts, steps, argmax):
        ens, own = definition(lms, x, tau, w)
        assert np.allclose(s.ensemble, ens, atol=1e-12)
        assert np.allclose(np.array(s.members), own, atol=1e-12)
        assert len(top) == len(x)
    alone, _ = byte_steps(lms, [b""] * 3, [b"abbaab"], tau, w)
    assert alone[0].ensemble == steps[3].ensemble


@pytest.mark.parametrize("tau", TAUS.values(), ids=TAUS.keys())
def test_the_end_of_text_follows_the_definition(tau):
    """`ends`: the end of text after a text (an EOS entry), the 257th slot of the same mean."""
    lms = [TableLM(s, L=6) for s in (1, 2, 3)]
    w = np.array([0.2, 0.3, 0.5])
    texts = [b"ab", b"abba", b"", b"b"]
    steps, _ = byte_steps(lms, [b""] * 3, texts, tau, w, ends=(True, True, True, False))
    for x, st in zip(texts[:3], steps):
        prefix = np.array([sum(lm.logq(x[:j])[x[j]] for j in range(len(x))) for lm in lms])
        logq = np.stack([lm.logq(x) for lm in lms])
        psi = f_ensemble(prefix[:, None] + logq, tau, w / w.sum(), axis=0)
        assert abs(st.end[0] - (psi[EOS] - np.logaddexp.reduce(psi))) < 1e-12
        assert np.allclose(st.end[1], logq[:, EOS], atol=1e-12)
    assert steps[3].end is None and steps[1].ensemble == byte_steps(lms, [b""] * 3, [b"abba"], tau, w)[0][0].ensemble


def test_one_member_scores_its_own_probability():
    """The ratios telescope: with one member the ensemble's figure is that member's P(x)."""
    lm = TableLM(7, L=6)
    for tau in TAUS.values():
        (s,), _ = byte_steps([lm], [b""], [b"abbab"], tau, [1.0])
        assert abs(sum(s.ensemble) - sum(s.members[0])) < 1e-12


def test_greedy_marks_the_argmax_bytes():
    lms = [TableLM(s, L=4) for s in (4, 5)]
    w = np.array([0.5, 0.5])
    for x in (b"ab", b"ba", b"aab"):
        (_,), (top,) = byte_steps(lms, [b""] * 2, [x], 1.0, w)
        for i in range(len(x)):
            prefix = np.array([sum(lm.logq(x[:j])[x[j]] for j in range(i)) for lm in lms])
            psi = f_ensemble(prefix[:, None] + np.stack([lm.logq(x[:i]) for lm in lms]), 1.0, w, axis=0)
            assert top[i] == (int(np.argmax(psi)) == x[i])


# ---- tiny members with the real tokenizers, against every tokenization ------------------------
def brute_next_bytes(m, prompt: list[int], x: bytes) -> np.ndarray:
    """log P(x b) for the 256 bytes and the end of text, summed over every tokenization of x
    (full forwards, no cache, no beam): each context spelling x[:j] exactly, then a token that
    spells x[j:] and goes on with b (specials left out, EOS kept, renormalised as the byte LM)."""
    trie = byte_trie(m)
    vb = m.vocab_bytes
    order = [int(t) for t in trie.order]
    out = np.zeros(257)

    def dist(ctx):
        lg = m.forward_batch([prompt + ctx])[0][-1].double()
        return lg - torch.logsumexp(torch.cat([lg[trie.order], lg[trie.eos]]), 0)

    @functools.cache
    def tokens(rest: bytes) -> tuple[list, list]:
        """(tokens spelling rest and going on, with their next byte), (tokens that begin rest)."""
        going = [(t, vb[t][len(rest)]) for t in order if len(vb[t]) > len(rest) and vb[t].startswith(rest)]
        return going, [t for t in order if vb[t] and len(vb[t]) <= len(rest) and rest.startswith(vb[t])]

    def rec(ctx, j, logp):
        lp = dist(ctx).numpy()
        going, starting = tokens(x[j:])
        for t, b in going:
            out[b] += math.exp(logp + lp[t])
        if j == len(x):
            out[EOS] += sum(math.exp(logp + lp[int(e)]) for e in trie.eos)
        for t in starting:
            rec(ctx + [t], j + len(vb[t]), logp + lp[t])

    rec([], 0, 0.0)
    with np.errstate(divide="ignore"):
        return np.log(out)


@pytest.mark.parametrize("tau", [0.0, 1.0], ids=["product", "mixture"])
def test_tiny_pair_against_every_tokenization(tiny_members, tau):
    members = [tiny_members["smol"], tiny_members["gemma"]]
    prompts = [m.prompt_ids("Hello") for m in members]
    x, w = b" the", np.array([0.4, 0.6])
    lms = [ByteLM(m, beam_width=1000) for m in members]
    (s,), _ = byte_steps(lms, [lm.start(p) for lm, p in zip(lms, prompts)], [x], tau, w)
    for i in range(len(x)):
        joint = np.stack([brute_next_bytes(m, p, x[:i]) for m, p in zip(members, prompts)])  # [K, 257]
        psi = f_ensemble(joint, tau, w, axis=0)
        assert abs(s.ensemble[i] - (psi[x[i]] - np.logaddexp.reduce(psi))) < 1e-6
        prefix = np.logaddexp.reduce(joint, axis=1)  # P_k(x[:i]) = sum over the next slot
        assert np.allclose([s.members[k][i] for k in range(2)], joint[:, x[i]] - prefix, atol=1e-6)
    (e,), _ = byte_steps(lms, [lm.start(p) for lm, p in zip(lms, prompts)], [x], tau, w, ends=(True,))
    joint = np.stack([brute_next_bytes(m, p, x) for m, p in zip(members, prompts)])  # the EOS after all of x
    psi = f_ensemble(joint, tau, w, axis=0)
    assert abs(e.end[0] - (psi[EOS] - np.logaddexp.reduce(psi))) < 1e-6


# ---- Ensemble.score end to end ----------------------------------------------------------------
@pytest.fixture(scope="module")
def pair(tiny_dirs):
    with Ensemble([tiny_dirs["smol"], tiny_dirs["gemma"]], method="unite") as eng:
        yield eng


def test_score_end_to_end(pair, tiny_dirs):
    prompt, conts = "The capital of France is", [" Paris", " Par", " Lyon"]
    got = pair.score(prompt, conts)
    assert [s.text for s in got] == conts
    names = [m.name for m in pair.members]
    for s in got:
        assert math.isclose(s.logprob, sum(t.logprob for t in s.tokens), abs_tol=1e-9)
        assert b"".join(t.bytes for t in s.tokens) == s.text.encode()
        assert sorted(s.members) == sorted(names)
        for name, lp in s.members.items():
            assert math.isclose(lp, sum(t.members[name] for t in s.tokens), abs_tol=1e-9)
        assert s.logprob < 0 and all(v < 0 for v in s.members.values())
    # each member's figure is what that member alone gives the same text


@pytest.mark.parametrize("key", ["smol", "gemma"])
def test_one_member_scores_its_own_tokens(tiny_dirs, key):
    """A one-member engine scores as the member alone does (token_scoring.py): each token's
    log-probability from a full forward of prompt and continuation, its top alternatives that
    row's best tokens, greedy exactly where every token is the row's argmax, the end of text its
    EOS ids' probability after the last token."""
    prompt, conts = "The capital of France is", [" Paris", " Par", " Lyon", ""]
    with Ensemble([tiny_dirs[key]], method="single") as one:
        m = one.members[0]
        got = one.score(prompt, conts, top=3)
        ends = asyncio.run(one.ascore(prompt, Scoring(tuple(conts), ends=(True,) * len(conts)))).scores
        fast = one.score(prompt, conts)  # no alternatives: every continuation in one forward
        ids = m.prompt_ids(prompt)
        for c, s, e, f in zip(conts, got, ends, fast):
            cont = m.encode(c)
            lp = torch.log_softmax(m.forward_batch([ids + cont])[0].double(), -1)[len(ids) - 1 :]
            want = [float(lp[j, t]) for j, t in enumerate(cont)]
            assert [t.logprob for t in s.tokens] == pytest.approx(want, abs=1e-5)
            assert [t.logprob for t in f.tokens] == pytest.approx(want, abs=1e-5)
            assert s.logprob == pytest.approx(sum(want), abs=1e-5) and s.members == {m.name: s.logprob}
            for j, t in enumerate(s.tokens):
                best = torch.topk(lp[j], 3).indices.tolist()
                assert [a for a, _ in t.top[:3]] == [m.vocab_bytes[b].decode(errors="replace") for b in best]
                assert [v for _, v in t.top[:3]] == pytest.approx([float(lp[j, b]) for b in best], abs=1e-5)
            assert s.greedy == all(int(torch.argmax(lp[j])) == t for j, t in enumerate(cont))
            eos = float(torch.logsumexp(lp[len(cont), sorted(m.eos_ids)], 0))
            assert e.end.logprob == pytest.approx(eos, abs=1e-5)


def test_bad_continuations_leave_the_engine_usable(pair):
    for bad in ("Paris", [], [1, 2], None):
        with pytest.raises(RequestError, match="continuation"):
            pair.score("The capital of France is", bad)
    assert pair.score("Hi", [" there"])[0].logprob < 0


def test_token_spans_cover_the_text(tiny_members):
    m = tiny_members["smol"]
    text = " naïve café"
    spans = token_spans(m, text)
    assert spans[0][1] == 0 and spans[-1][2] == len(text.encode())
    assert all(a[2] == b[1] for a, b in zip(spans, spans[1:]))


def test_alternatives_are_scored_as_their_own_texts(pair):
    prompt, text = "The capital of France is", " Paris is big"
    (s,) = pair.score(prompt, [text], top=2)
    data, at = text.encode(), 0
    for t in s.tokens:
        here = (t.token, t.logprob)
        assert here in t.top and len(t.top) in (2, 3)
        assert [lp for _, lp in t.top[:2]] == sorted((lp for _, lp in t.top[:2]), reverse=True)
        for tok, lp in t.top:
            if (tok, lp) == here:
                continue
            before, after = pair.score(prompt, [data[:at].decode(), data[:at].decode() + tok])
            assert abs(after.logprob - before.logprob - lp) < 1e-5
        at += len(t.bytes)


def test_given_token_ids_split_the_report(pair):
    from ensemble_llm.scoring import Scoring

    main = pair.members[pair.member_weights("raw")[1]]
    text = " Paris"
    odd = [t for piece in (" Pa", "ris") for t in main.encode(piece)]
    assert odd != main.encode(text)
    res = asyncio.run(pair.ascore("The capital of France is", Scoring((text,), token_ids=(tuple(odd),))))
    (s,) = res.scores
    assert [t.bytes for t in s.tokens] == [main.vocab_bytes[i] for i in odd]
    (plain,) = pair.score("The capital of France is", [text])
    assert abs(s.logprob - plain.logprob) < 1e-9  # the same bytes: the split only reports
    with pytest.raises(RequestError, match="do not spell"):
        asyncio.run(pair.ascore("Hi", Scoring((text,), token_ids=(tuple(odd[:-1]),))))
    with pytest.raises(RequestError, match="top must be"):
        pair.score("Hi", [text], top=99)


def test_deferred_fresh_hypotheses_keep_the_figures(tiny_members):
    """keep_fresh="lazy" (what scoring uses) defers the forward of a fresh-token hypothesis below
    the prune floor until a continuation's byte needs it: the figures stay those of keeping it
    eagerly (the difference, 0.007 nats at most on these texts, is far inside the beam's own
    error), where dropping it (keep_fresh=False) gives some text probability 0."""
    from ensemble_llm.scoring import SCORE_BEAM, SCORE_PRUNE

    members = [tiny_members["smol"], tiny_members["gemma"]]
    prompts = [m.prompt_ids("The capital of France is") for m in members]
    texts = [b" Paris, a city.", b" Lyon and Marseille", b" 1234 km", " caf\u00e9s".encode()]
    got = {}
    for keep in (True, "lazy", False):
        lms = [ByteLM(m, SCORE_BEAM, SCORE_PRUNE, keep_fresh=keep) for m in members]
        steps, _ = byte_steps(lms, [lm.start(p) for lm, p in zip(lms, prompts)], texts, 0.0, [0.5, 0.5])
        got[keep] = np.array([[sum(s.ensemble), *map(sum, s.members)] for s in steps])
    assert np.isfinite(got["lazy"]).all()
    assert np.abs(got["lazy"] - got[True]).max() < 0.02
    assert not np.isfinite(got[False]).all()
