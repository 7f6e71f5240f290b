"""Method `smc`: byte-level LMs from token LMs (exact against brute force), power-mean f-ensembles,
SMC weights and convergence to the exact f-ensemble, and end-to-end runs."""

from __future__ import annotations

import hashlib
import itertools
import math

import numpy as np
import pytest
import torch

from ensemble_llm import ConfigError, Ensemble, RequestError, RequestTimeout, SmcConfig
from ensemble_llm.members.bytelm import EOS, Beam, ByteLM, Hyp, byte_trie
from ensemble_llm.members.rows import Ready
from ensemble_llm.methods.smc import beam_search, f_ensemble, smc_sample


# ---- batched forwards over a context tree ------------------------------------------------------
@pytest.mark.parametrize("key", ["smol", "gemma"])
def test_forward_rows_equal_full_forwards(tiny_members, key):
    """Rows of different lengths over one prompt cache give the log-probs of plain forwards (the
    tiny Gemma's sliding window is 8, shorter than the prompt: left padding keeps it exact)."""
    m = tiny_members[key]
    prompt = list(range(5, 15))
    pkv = m.kv_tensor(m.prefill(prompt))
    _, (kv20,) = m.forward_rows(pkv, [[]], [20])
    logits, kvs = m.forward_rows(pkv, [[kv20], [], [kv20]], [21, 40, 22])
    _, (kv_deep,) = m.forward_rows(pkv, [[kv20, kvs[0]]], [23])
    ref = m.forward_batch([prompt + [20, 21], prompt + [40], prompt + [20, 22]])
    for r in range(3):
        assert torch.allclose(torch.log_softmax(logits[r], -1), ref[r][-1], atol=1e-4)
    deep, _ = m.forward_rows(pkv, [[kv20, kvs[0], kv_deep]], [24])
    full = m.forward_batch([prompt + [20, 21, 23, 24]])[0][-1]
    assert torch.allclose(torch.log_softmax(deep[0], -1), full, atol=1e-4)


# ---- byte-level LM -----------------------------------------------------------------------------
def brute_prefix_logprob(m, prompt: list[int], x: bytes) -> float:
    """log P(the continuation starts with x), summed over every tokenization: a context spelling
    x[:j] exactly, then any token starting with x[j:] (specials removed, EOS kept, renormalised)."""
    trie = byte_trie(m)

    def dist(ctx):
        lg = m.forward_batch([prompt + ctx])[0][-1].double()
        return lg - torch.logsumexp(torch.cat([lg[trie.order], lg[trie.eos]]), 0)

    terms = []

    def rec(ctx, j, logp):
        lp = dist(ctx)
        node = trie.node(x[j:])
        if node is not None:
            terms.append(logp + torch.logsumexp(lp[trie.order[node.lo : node.hi]], 0).item())
        for n in range(1, len(x) - j):
            part = trie.node(x[j : j + n])
            if part is None:
                break
            for pos in range(part.lo, part.end):
                rec(ctx + [trie.ids[pos]], j + n, logp + lp[trie.ids[pos]].item())

    rec([], 0, 0.0)
    assert len(terms) >= 2  # several tokenizations really are summed
    return torch.logsumexp(torch.tensor(terms, dtype=torch.float64), 0).item()


@pytest.mark.parametrize("key", ["smol", pytest.param("gemma", marks=pytest.mark.slow)])
@pytest.mark.parametrize("x", [b" the cat", "é1".encode(), b"ab\nc"])
def test_byte_prefix_probability_equals_brute_force(tiny_members, key, x):
    m = tiny_members[key]
    prompt = m.prompt_ids("Hello")
    lm = ByteLM(m, beam_width=1000)
    beam, total = lm.start(prompt), 0.0
    for b in x:
        q = lm.next_logprobs([beam])[0]
        assert abs(np.logaddexp.reduce(q)) < 1e-9  # a distribution over 257 slots
        total += q[b]
        beam = lm.advance(beam, b)
    assert abs(total - brute_prefix_logprob(m, prompt, x)) < 1e-5


def test_trie_keeps_specials_atomic_and_maps_both_vocabularies(tiny_members):
    for key in ("smol", "gemma"):
        m = tiny_members[key]
        trie = byte_trie(m)
        assert set(trie.ids).isdisjoint(m.special_ids | m.eos_ids)  # never spelled byte by byte
        # text can always be written: printable ASCII, newline, tab and every UTF-8 byte (SmolLM2's
        # byte-level vocabulary lacks a few bytes: some control codes, 0xC0-0xC1 and 0xF1-0xFF,
        # which text rarely or never uses)
        assert all(
            trie.node(bytes([b])) is not None for b in [9, 10, *range(32, 127), *range(0x80, 0xC0), *range(0xC2, 0xF1)]
        )
        space_the = m.encode(" the")
        assert len(space_the) == 1 and trie.keys[trie.ids.index(space_the[0])] == b" the"  # Ġ / ▁ -> space


def test_narrow_beam_never_rules_out_a_byte(tiny_members):
    m = tiny_members["gemma"]
    lm = ByteLM(m, beam_width=1)
    beam = lm.start(m.prompt_ids("Hi"))
    for b in b"zqxjvkw qq\xe6\x9d":
        q = lm.next_logprobs([beam])[0]
        assert np.isfinite(q[:256]).all()  # a fresh-token hypothesis is always kept
        beam = lm.advance(beam, b)
        assert 1 <= len(beam.hyps) <= 2


def test_beam_heals_a_dead_hypothesis(tiny_members):
    m = tiny_members["gemma"]
    lm = ByteLM(m, beam_width=5)
    root = lm.start(m.prompt_ids("Hi")).hyps[0].ctx
    node = lm.trie.node(b"\xe6\x9d")
    assert node is not None and node.end == node.lo and lm.trie.node(b"\xe6\x9dz") is None  # mid-character
    beam = Beam([Hyp(root, b"\xe6\x9d", 0.0, math.log(root.mass(node.lo, node.hi)))])
    healed = lm.advance(beam, ord("z"))
    assert lm.heals == 1 and len(healed.hyps) == 1
    h = healed.hyps[0]
    assert h.partial == b"z" and h.ctx.depth == 2  # 0xE6 and 0x9D committed as byte tokens
    assert [m.vocab_bytes[c.token] for c in (h.ctx.parent, h.ctx)] == [b"\xe6", b"\x9d"]
    assert math.isfinite(h.logw) and h.logw < beam.hyps[0].logw


# ---- f-ensembles -------------------------------------------------------------------------------
def test_power_means_against_their_definitions():
    rng = np.random.default_rng(0)
    p = rng.uniform(0.01, 1, size=(3, 7))
    a = np.array([0.2, 0.3, 0.5])
    lp = np.log(p)
    for tau in (-2.0, -1.0, -0.5, 0.5, 1.0, 1.5, 3.0):
        assert np.allclose(f_ensemble(lp, tau, a), np.log((a[:, None] * p**tau).sum(0) ** (1 / tau)))
    assert np.allclose(f_ensemble(lp, 0.0, a), (a[:, None] * lp).sum(0))
    assert np.allclose(f_ensemble(lp, math.inf, a), lp.max(0)) and np.allclose(f_ensemble(lp, -math.inf, a), lp.min(0))
    assert np.allclose(f_ensemble(lp, 1e-4, a), f_ensemble(lp, 0.0, a), atol=1e-3)  # tau -> 0 is the product
    assert np.allclose(f_ensemble(lp, -60.0, a), lp.min(0), atol=0.05)  # tau -> -inf is the min
    # a zero probability: product, min and harmonic give 0, the mixture does not
    with np.errstate(divide="ignore"):
        z = np.log(np.array([[0.0], [0.5]]))
        assert f_ensemble(z, 0.0, [0.5, 0.5])[0] == -math.inf and f_ensemble(z, -1.0, [0.5, 0.5])[0] == -math.inf
        assert f_ensemble(z, -math.inf, [0.5, 0.5])[0] == -math.inf
        assert np.isclose(f_ensemble(z, 1.0, [0.5, 0.5])[0], math.log(0.25))


def test_config_errors():
    for kw, msg in (
        ({"f": "avg"}, "SmcConfig.f"),
        ({"f": "power"}, "tau"),
        ({"tau": 0.5}, "f='power'"),
        ({"n_particles": 0}, "n_particles"),
        ({"ess_threshold": 2}, "ess_threshold"),
        ({"beam_width": 0}, "beam_width"),
        ({"weights": [1, -1]}, "weights"),
        ({"max_bytes": 0}, "max_bytes"),
        ({"ess_threshold": "high"}, "must be a number"),
        ({"weights": [1, float("inf")]}, "finite"),
    ):
        with pytest.raises(ConfigError, match=msg):
            SmcConfig(**kw)
    assert SmcConfig(f="power", tau=-2).power == -2 and SmcConfig(f="min").power == -math.inf


# ---- SMC on byte LMs whose full distribution can be enumerated ---------------------------------
class TableLM:
    """A byte LM over {a, b} + EOS with random conditionals; EOS is certain at length L."""

    def __init__(self, seed: int, L: int) -> None:
        self.seed, self.L = seed, L

    def logq(self, x: bytes) -> np.ndarray:
        out = np.full(257, -math.inf)
        if len(x) >= self.L:
            out[EOS] = 0.0
            return out
        h = hashlib.sha256(bytes([self.seed]) + x).digest()
        w = np.array([1 + h[0], 1 + h[1], 1 + h[2]], dtype=float) ** 2
        out[[ord("a"), ord("b"), EOS]] = np.log(w / w.sum())
        return out

    def next_logprobs(self, states, need=None):  # exact tables: nothing deferred, `need` changes nothing
        return np.stack([self.logq(s) for s in states])

    def next_logprobs_async(self, states, need=None):  # the byte-LM interface's form for answers from an actor
        return Ready(self.next_logprobs(states, need))

    def advance(self, state, b):
        return state + bytes([b])

    def compact(self, states):  # the byte-LM interface: nothing cached to free
        pass


def exact_target(lms, tau, a):
    strings = [b"".join(t) for n in range(lms[0].L + 1) for t in itertools.product([b"a", b"b"], repeat=n)]
    logp = []
    for lm in lms:
        row = []
        for x in strings:
            lp = sum(lm.logq(x[:i])[x[i]] for i in range(len(x))) + lm.logq(x)[EOS]
            row.append(lp)
        logp.append(row)
    psi = f_ensemble(np.array(logp), tau, a)
    p = np.exp(psi - np.logaddexp.reduce(psi))
    return dict(zip(strings, p)), float(np.logaddexp.reduce(psi))


@pytest.mark.parametrize("tau", [0.0, 1.0, -math.inf], ids=["product", "mixture", "min"])
def test_smc_converges_to_the_exact_f_ensemble(tau):
    lms = [TableLM(s, L=3) for s in (1, 2, 3)]  # K = 3
    a = [0.2, 0.3, 0.5] if tau == 0.0 else [1, 1, 1]
    exact, log_z = exact_target(lms, tau, np.array(a) / sum(a))
    gen = torch.Generator().manual_seed(0)
    run = None
    for run in smc_sample(  # noqa: B007 (the last run is read after the loop)
        lms, [b""] * 3, tau=tau, weights=a, n_particles=4000, ess_threshold=0.5, generator=gen, finished=lambda p: None
    ):
        pass
    est = run.posterior()
    tv = 0.5 * sum(abs(est.get(x, 0.0) - p) for x, p in exact.items())
    assert tv < 0.05, tv  # 15 strings, 4000 particles: sampling error ~0.02
    assert abs(run.log_z - log_z) < 0.05  # the normalising constant is estimated too
    assert all(p.done == "stop" for p in run.particles)


@pytest.mark.parametrize("tau", [0.0, 1.0, -math.inf, 2.0], ids=["product", "mixture", "min", "power2"])
def test_beam_search_finds_the_exact_mode_of_the_f_ensemble(tau):
    for seeds in ((1, 2, 3), (4, 5, 6), (7, 8, 9)):
        lms = [TableLM(s, L=4) for s in seeds]
        a = np.array([0.2, 0.3, 0.5])
        strings = [b"".join(t) for n in range(5) for t in itertools.product([b"a", b"b"], repeat=n)]
        logp = [[sum(lm.logq(x[:i])[x[i]] for i in range(len(x))) + lm.logq(x)[EOS] for x in strings] for lm in lms]
        psi = f_ensemble(np.array(logp), tau, a)
        run = None
        for run in beam_search(lms, [b""] * 3, tau=tau, weights=a, width=16, finished=lambda p: None):  # noqa: B007 (the last run is read after the loop)
            pass
        best = run.best()
        assert best.text == strings[int(np.argmax(psi))]
        assert abs(best.logw - float(psi.max())) < 1e-9


def _weights_trace(lms, starts, tau, steps=12):
    gen = torch.Generator().manual_seed(1)
    trace = []
    for run in smc_sample(
        lms,
        starts,
        tau=tau,
        weights=[1, 1],
        n_particles=4,
        ess_threshold=0.0,
        generator=gen,
        finished=lambda p: "length" if len(p.text) >= steps else None,
    ):
        trace.append([p.logw for p in run.particles])
    return np.array(trace)


def test_incremental_weights_mixture_one_product_at_most_one(tiny_members):
    members = [tiny_members["smol"], tiny_members["gemma"]]
    for tau in (1.0, 0.0):
        lms = [ByteLM(m, beam_width=5) for m in members]
        starts = [lm.start(m.prompt_ids("Once upon a time")) for lm, m in zip(lms, members)]
        tr = _weights_trace(lms, starts, tau)
        inc = np.diff(np.vstack([np.zeros(tr.shape[1]), tr]), axis=0)
        if tau == 1.0:
            assert np.abs(inc).max() < 1e-9  # sum_b psi(xb) = psi(x): every weight is exactly 1
        else:
            assert inc.max() <= 1e-12 and inc.min() < -1e-3  # Hoelder: <= 1, and really below 1


# ---- end to end --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine(tiny_dirs):
    return Ensemble(
        [tiny_dirs["smol"], tiny_dirs["gemma"]],
        method="smc",
        config={"n_particles": 4, "return_particles": True, "greedy": "sample"},
    )


@pytest.mark.slow
def test_end_to_end_stats_stream_and_seed(engine):
    res = engine.generate("Tell me about the sea.", max_new_tokens=8)
    st = res.stats
    assert len(st["particles"]) == 4 and abs(sum(p["weight"] for p in st["particles"]) - 1) < 1e-9
    assert any(p["text"] == res.text for p in st["particles"])
    assert st["smc_steps"] == len(st["ess"]) and math.isfinite(st["log_z"]) and st["log_z"] <= 1e-9
    # the budget counts the main member's tokens along the beam; re-encoding the random bytes
    # canonically (tokens_out) can take a token or two more
    assert st["tokens_out"] <= 8 + 2 and st["bytes_out"] == len(res.text.encode("utf-8", "replace"))
    for m in engine.members:  # one prefill, then at most one batched forward per byte step
        assert 1 <= st["members"][m.name]["forward_passes"] <= st["smc_steps"] + 1
    # temperature 0: deterministic; the stream is the same text, growing as particles agree
    assert "".join(engine.stream("Tell me about the sea.", max_new_tokens=8)) == res.text
    a = engine.generate("Hi", max_new_tokens=6, temperature=0.9, seed=5).text
    assert a == engine.generate("Hi", max_new_tokens=6, temperature=0.9, seed=5).text


def test_stop_strings_end_particles(engine):
    res = engine.generate("Tell me about the sea.", max_new_tokens=12, stop=["e", "a", "o", " "])
    assert not any(s in res.text for s in "eao ")
    assert all(not any(s in p["text"] for s in "eao ") for p in res.stats["particles"])


def test_timeout_stops_smc_between_byte_steps(engine):
    # particles sampling at T=1 rarely agree, but the engine still checks its timeout every byte
    with pytest.raises(RequestTimeout):
        engine.generate("Tell me a long story.", max_new_tokens=200, temperature=1.0, seed=1, timeout=0.5)
    assert engine.generate("Hi", max_new_tokens=3).finish_reason in ("stop", "length")


def test_bad_requests_leave_engine_usable(engine, tiny_dirs):
    with pytest.raises(RequestError, match="top_p"):
        engine.generate("Hi", max_new_tokens=4, top_p=0.5)
    with pytest.raises(ConfigError, match="weights"):
        Ensemble([tiny_dirs["smol"], tiny_dirs["gemma"]], method="smc", config={"weights": [1.0]}).load()
    assert engine.generate("Hi", max_new_tokens=4).finish_reason in ("stop", "length")


@pytest.mark.real
def test_real_pair_well_formed():
    eng = Ensemble(["smollm2-135m-instruct", "gemma-3-270m"], method="smc", config={"n_particles": 4})
    shots = "Q: The capital of Germany is\nA: Berlin\nQ: The capital of Italy is\nA: Rome\n"
    res = eng.generate(shots + "Q: The capital of France is\nA:", raw=True, max_new_tokens=8, stop=["\n"])
    assert res.text.strip() == "Paris"
    chat = eng.generate("Say hello in one short sentence.", max_new_tokens=16)
    for text in (res.text, chat.text):
        assert "\ufffd" not in text and text.strip()
        assert not any(s in text for s in ("<|im_end|>", "<|im_start|>", "<eos>", "<end_of_turn>", "<bos>"))
