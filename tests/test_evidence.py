"""Per-request member weights (evidence.py): the answer spans a prompt shows, the prompt's
log-probs read from its own prefill (checked against a full forward), the hand-over of that
prefill to the method, and the posterior weights in the engine's results."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import DEMONYM, GEMMA, RUSSIAN, SMOL

from ensemble_llm import ConfigError, Ensemble
from ensemble_llm.bench import load_task, resolve_task
from ensemble_llm.evidence import (
    EXAM_BEHIND,
    FLOOR,
    MemberPrompts,
    answer_spans,
    chat_spans,
    context_end,
    exam_aside,
    posterior,
    query_copy,
    request_weights,
    shot_exam,
    solo_member,
    span_groups,
    span_positions,
)
from ensemble_llm.members import PromptScore
from ensemble_llm.members.backends.transformers import rowgroups
from ensemble_llm.members.context import current_request
from ensemble_llm.methods import get_method

FEW_SHOT = "Q: The capital of France is\nA: Paris\nQ: The capital of Japan is\nA: Tokyo\nQ: The capital of Peru is\nA:"


def test_answer_spans_are_the_shown_answers_with_their_newline():
    data = FEW_SHOT.encode()
    spans = answer_spans(FEW_SHOT)
    assert [data[a:b] for a, b in spans] == [b" Paris\n", b" Tokyo\n"]
    assert answer_spans("Input: ab\nOutput: ba\nInput: cd\nOutput:") == [
        (len("Input: ab\nOutput:"), len("Input: ab\nOutput: ba\n"))
    ]
    # no label line, an empty shown answer, a label nothing repeats: no evidence
    assert answer_spans("What is the capital of France?") == []
    assert answer_spans("Q: x\nA:\nQ: y\nA:") == []
    assert answer_spans("Tell me about cats.\nSure:") == []
    # multi-byte text: spans are in bytes
    s = "Wort: Straße\nPlural: Straßen\nWort: Maß\nPlural:"
    assert [s.encode()[a:b].decode() for a, b in answer_spans(s)] == [" Straßen\n"]


def test_answer_spans_read_any_line_format():
    def shown(text: str) -> list[str]:
        return [text.encode()[a:b].decode() for a, b in answer_spans(text)]

    # GPT-3's arrows: the label is inline, and the query's own words are not part of it
    assert shown("cat => cats\ndog => dogs\nbox => boxes\nfox =>") == [" cats\n", " dogs\n", " boxes\n"]
    assert shown("17 + 25 => 42\n3 + 5 => 8\n12 + 25 =>") == [" 42\n", " 8\n"]
    # the answer on the line after its label, shots apart by a blank line
    nextline = "Question: big\nAnswer:\nbigger\n\nQuestion: small\nAnswer:\nsmaller\n\nQuestion: wet\nAnswer:\n"
    assert shown(nextline) == ["bigger\n", "smaller\n"]
    assert shown("Q: a\nA: b\nQ: c\nA: ") == [" b\n"]  # a trailing space after the label
    # prose that ends in a word is no label, even where the word occurs earlier
    assert shown("The cat sat on the mat.\nThe cat") == []


def test_chat_spans_find_assistant_turns_in_order_after_their_questions():
    text = "<|user|>Hi<|assistant|>Hello!<|user|>Again<|assistant|>Hello!<|user|>x<|assistant|>"
    turns = [("user", "Hi"), ("assistant", "Hello!"), ("user", "Again"), ("assistant", "Hello!")]
    spans = chat_spans(text, turns + [("assistant", "not there"), ("assistant", " ")])
    assert [text.encode()[a:b] for a, b in spans] == [b"Hello!", b"Hello!"]
    assert spans[0][0] < spans[1][0]
    # a short answer is not taken from the preamble, the system text or its own question
    text = "A conversation.<|system|>Answer A or B.<|user|>Pick A or B: 4<|assistant|>B"
    text += "<|user|>2 + 2?<|assistant|>4<|user|>"
    turns = [
        ("system", "Answer A or B."),
        ("user", "Pick A or B: 4"),
        ("assistant", "B"),
        ("user", "2 + 2?"),
        ("assistant", "4"),
    ]
    spans = chat_spans(text, turns)
    assert [text.encode()[a:b] for a, b in spans] == [b"B", b"4"]
    assert spans[0][0] == text.index("<|assistant|>B") + len("<|assistant|>")
    assert spans[1][0] == text.rindex("4")


def test_span_positions_pick_tokens_ending_inside_a_span():
    ends = [3, 5, 9, 10, 14]  # tokens cover [0,3) [3,5) [5,9) [9,10) [10,14)
    assert span_positions(ends, [(5, 10)], offset=0) == [2, 3]
    assert span_positions(ends, [(5, 10)], offset=1) == [3, 4]  # a BOS before the text
    assert span_positions(ends, [(4, 9)], offset=0) == [1, 2]  # a token straddling the start counts
    assert span_positions(ends, [(0, 3)], offset=0) == []  # position 0 has no context to predict it


def test_shot_exam_is_the_mean_distance_from_writing_each_answer():
    ok, near, off = PromptScore(-0.2, 0.0), PromptScore(-0.7, -0.25), PromptScore(-3.1, -2.0)
    assert shot_exam([[ok, near], [off, off]]) == pytest.approx((-0.25 - 4.0) / 2)
    assert shot_exam([[ok], [ok]]) == 0.0 and shot_exam([]) == 0.0


def test_exam_aside_matches_the_rule_on_every_small_case():
    """Brute force over 2 and 3 members on a grid of exams: a member steps aside exactly when
    another member's exam is at least `behind` above its own; the best member never does."""
    import itertools

    grid = (0.0, -0.5, -2.0, -3.9, -4.0, -6.0, -12.0)
    for n, behind in itertools.product((2, 3), (1.0, 4.0)):
        for gaps in itertools.product(grid, repeat=n):
            want = [k for k, g in enumerate(gaps) if any(o - g >= behind for o in gaps)]
            assert exam_aside(gaps, behind) == want
            assert len(want) < n  # someone stays


def test_span_groups_are_answer_positions_span_by_span(tiny_members):
    m = tiny_members["smol"]
    ids = m.prompt_ids(FEW_SHOT)
    spans = answer_spans(FEW_SHOT)
    groups = span_groups(m, FEW_SHOT, ids, spans)
    assert len(groups) == len(spans) == 2 and all(groups)
    for (b0, b1), g in zip(spans, groups):  # each group decodes to its span's bytes (the newline included)
        assert m.decode([ids[p] for p in g]).strip() == FEW_SHOT.encode()[b0:b1].decode().strip()
    assert span_groups(m, FEW_SHOT, ids[:-1], spans) == []  # ids that are not the text's tokens


def test_posterior_is_prior_times_likelihood_with_a_floor():
    w = posterior([0.5, 0.5], [math.log(0.2), math.log(0.6)])
    assert w == pytest.approx([0.25, 0.75])
    w = posterior([0.8, 0.2], [0.0, 0.0])
    assert w == pytest.approx([0.8, 0.2])
    w = posterior([0.5, 0.5], [0.0, -1000.0])
    assert min(w) >= FLOOR * 0.99 and sum(w) == pytest.approx(1.0)


def test_score_prompt_matches_a_full_forward_and_hands_its_state_over(tiny_members):
    m = tiny_members["gemma"]
    ids = m.prompt_ids(FEW_SHOT)
    positions = [3, 7, len(ids) - 1]
    before = m.counters()
    got = m.score_prompt(ids, positions)
    with torch.inference_mode():
        full = torch.log_softmax(m.model(input_ids=torch.tensor([ids])).logits[0].float(), dim=-1)
    want = [full[p - 1, ids[p]].item() for p in positions]
    assert [s.logprob for s in got] == pytest.approx(want, abs=1e-4)
    gaps = [(full[p - 1, ids[p]] - full[p - 1].max()).item() for p in positions]
    assert [s.gap for s in got] == pytest.approx(gaps, abs=1e-4)  # 0 where the member's argmax is the token
    state = m.prefill(ids)  # the scored prompt's state, not a second forward
    assert m.counters()[0] - before[0] == 1 and m.counters()[2] - before[2] == 1
    fresh = m.new_state()
    m.extend(fresh, ids, last_only=True)
    assert torch.allclose(state.next_logprobs, fresh.next_logprobs, atol=1e-5)
    assert state.ids == ids
    # the hand-over is one-shot and only for the same ids
    m.score_prompt(ids, positions)
    b = m.counters()
    other = m.prefill(ids[:-1])
    assert other.ids == ids[:-1] and m.counters()[2] - b[2] == 1  # a prefill of its own
    assert m.prefill(ids) is not state and m.counters()[2] - b[2] == 2  # the scored state was dropped


@pytest.mark.parametrize("method", ["unite", "safe", "specfuse"])
def test_auto_weights_follow_the_prompt_and_cost_no_forward(tiny_dirs, method):
    eng = Ensemble([tiny_dirs["smol"], tiny_dirs["gemma"]], method=method, config={"evidence": 1}).load()
    prior, _ = eng.member_weights("raw")
    res = eng.generate(FEW_SHOT, raw=True, max_new_tokens=4, stop=["\n"])
    ev = list(res.stats["evidence"].values())
    w = list(res.stats["member_weights"].values())
    assert w == pytest.approx(posterior(prior, ev), abs=1e-3)
    assert res.stats["main_member"] == eng.members[max(range(2), key=lambda i: (w[i], -i))].name
    for fig in res.stats["members"].values():  # the scored prefill is the only prefill
        assert fig["prefills"] == 1
    # fixed weights: no evidence is read and the weights are the given ones
    fixed = Ensemble([tiny_dirs["smol"], tiny_dirs["gemma"]], method=method, config={"weights": [1, 3]})
    r2 = fixed.generate(FEW_SHOT, raw=True, max_new_tokens=4, stop=["\n"])
    assert "evidence" not in r2.stats and list(r2.stats["member_weights"].values()) == [0.25, 0.75]
    # a chat prompt without assistant turns shows no answer: the calibrated chat weights
    r3 = eng.generate("What is the capital of Peru?", max_new_tokens=4)
    assert "evidence" not in r3.stats and "exam" not in r3.stats  # zero-shot chat: nothing to examine
    assert list(r3.stats["member_weights"].values()) == pytest.approx(eng.member_weights("chat")[0], abs=1e-4)
    # the default (evidence 0): the calibrated prior, and no answer scored
    default = Ensemble([tiny_dirs["smol"], tiny_dirs["gemma"]], method=method).load()
    r4 = default.generate(FEW_SHOT, raw=True, max_new_tokens=4, stop=["\n"])
    assert "evidence" not in r4.stats and list(r4.stats["member_weights"].values()) == pytest.approx(prior, abs=1e-4)


@pytest.mark.parametrize("method", ["unite", "specfuse"])
def test_the_evidence_rate_moves_the_weights_that_far_and_zero_reads_nothing(tiny_dirs, method):
    """`evidence` scales how far the shown answers move the weights: at 0.5 the log-weights move
    half as far as at 1 (log w = log prior + 0.5 e); at 0 the weights are the calibrated prior and
    no answer is scored (no evidence in the stats)."""
    members = [tiny_dirs["smol"], tiny_dirs["gemma"]]
    half = Ensemble(members, method=method, config={"evidence": 0.5}).load()
    prior, _ = half.member_weights("raw")
    res = half.generate(FEW_SHOT, raw=True, max_new_tokens=4, stop=["\n"])
    ev = list(res.stats["evidence"].values())
    assert list(res.stats["member_weights"].values()) == pytest.approx(posterior(prior, ev, 2.0), abs=1e-3)
    assert posterior(prior, ev, 2.0) != pytest.approx(posterior(prior, ev), abs=1e-3)
    off = Ensemble(members, method=method, config={"evidence": 0}).load()
    r0 = off.generate(FEW_SHOT, raw=True, max_new_tokens=4, stop=["\n"])
    assert "evidence" not in r0.stats
    assert list(r0.stats["member_weights"].values()) == pytest.approx(prior, abs=1e-4)
    with pytest.raises(ConfigError, match="evidence must be a number in"):
        Ensemble(members, method=method, config={"evidence": 2})


def test_smc_product_reads_the_evidence_but_keeps_equal_exponents(tiny_dirs, monkeypatch):
    """smc with "auto" weights and the pair's raw prior: the evidence picks the main member (and
    solo), while the product runs with equal exponents, so its text is the uniform product's;
    the mixture keeps the request's weights."""
    from ensemble_llm.calibrate import Calibrator

    monkeypatch.setattr(Calibrator, "weights", lambda self, *a, **k: [0.65, 0.35])
    cfg = {"n_particles": 2, "max_bytes": 6, "evidence": 1}  # the byte budget ends both runs, whichever member is main
    eng = Ensemble([tiny_dirs["smol"], tiny_dirs["gemma"]], method="smc", config=cfg).load()
    prior, _ = eng.member_weights("raw")
    res = eng.generate(FEW_SHOT, raw=True, max_new_tokens=64)
    ev = list(res.stats["evidence"].values())
    post = posterior(prior, ev)
    assert list(res.stats["member_weights"].values()) == [0.5, 0.5]
    assert res.stats["main_member"] == eng.members[max(range(2), key=lambda i: (post[i], -i))].name
    equal = Ensemble([tiny_dirs["smol"], tiny_dirs["gemma"]], method="smc", config={**cfg, "weights": None})
    assert equal.generate(FEW_SHOT, raw=True, max_new_tokens=64).text == res.text
    mix = Ensemble([tiny_dirs["smol"], tiny_dirs["gemma"]], method="smc", config={**cfg, "f": "mixture"}).load()
    r2 = mix.generate(FEW_SHOT, raw=True, max_new_tokens=64)
    assert list(r2.stats["member_weights"].values()) == pytest.approx(
        posterior(prior, list(r2.stats["evidence"].values())), abs=1e-3
    )


@pytest.mark.parametrize("prior", [[0.95, 0.05], [0.85, 0.15]])
def test_smc_product_follows_a_member_the_prior_finds_dominant(tiny_dirs, monkeypatch, prior):
    """A calibrated prior of at least DOMINANT for one member: the product's exponents are the
    request's weights (weak members do not outvote it); below it, equal."""
    from ensemble_llm.calibrate import Calibrator
    from ensemble_llm.methods.smc import DOMINANT

    monkeypatch.setattr(Calibrator, "weights", lambda self, *a, **k: list(prior))
    eng = Ensemble(
        [tiny_dirs["smol"], tiny_dirs["gemma"]], method="smc", config={"n_particles": 2, "max_bytes": 6, "evidence": 1}
    )
    res = eng.generate(FEW_SHOT, raw=True, max_new_tokens=64)
    post = posterior(prior, list(res.stats["evidence"].values()))
    want = post if prior[0] >= DOMINANT else [0.5, 0.5]
    assert list(res.stats["member_weights"].values()) == pytest.approx(want, abs=1e-3)


def test_chat_history_answers_are_evidence(tiny_dirs):
    eng = Ensemble([tiny_dirs["smol"], tiny_dirs["gemma"]], method="unite", config={"evidence": 1}).load()
    msgs = [
        {"role": "user", "content": "Capital of France?"},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "Capital of Peru?"},
    ]
    res = eng.generate(msgs, max_new_tokens=4)
    assert set(res.stats["evidence"]) == {m.name for m in eng.members}
    assert all(n >= 1 for n in res.stats["evidence_positions"].values())


def test_concurrent_few_shot_requests_score_their_prompts_together(tiny_dirs, monkeypatch):
    """Requests with per-request weights at once: their prompt scorings share forwards (one per
    member for the four prompts here), and each gets its one-at-a-time evidence, weights and text;
    so again once their shots are stored (prefix.py), when no prompt forward runs from scratch."""
    from ensemble_llm.members.prefix import PrefixCache

    members = [tiny_dirs["smol"], tiny_dirs["gemma"]]
    prompts = [FEW_SHOT.replace("Peru", c) for c in ("Peru", "Chile", "Italy", "Kenya")]
    one = Ensemble(members, method="unite", config={"evidence": 1}, max_batch=1)
    many = Ensemble(members, method="unite", config={"evidence": 1}, max_batch=4).load()
    alone = [one.generate(p, raw=True, max_new_tokens=6, stop=["\n"]) for p in prompts]
    scored, forward = [], rowgroups._prefill_forward

    def spy(member, calls, scoring):  # how many scored prompts each batched prompt forward carried
        scored.append(sum(c.positions is not None for c in calls))
        return forward(member, calls, scoring)

    monkeypatch.setattr(rowgroups, "_prefill_forward", spy)
    # the members are `one`'s too, and its requests stored these prompts (prefix.py): kept aside, so that
    # every prompt here runs from scratch (a prompt stored by the first to finish would seed the others)
    stored = [m.prefixes for m in many.members]
    for m in many.members:
        m.prefixes = PrefixCache(0)
    try:
        before = [m.n_forward for m in many.members]
        together = many.generate_many(prompts, raw=True, max_new_tokens=6, stop=["\n"])
    finally:
        for m, cache in zip(many.members, stored):
            m.prefixes = cache
    assert max(scored) >= 2  # several requests' scorings in one forward
    ran = sum(m.n_forward for m in many.members) - sum(before)
    took_part = sum(st["forward_passes"] for r in together for st in r.stats["members"].values())
    assert ran < took_part
    scored.clear()
    hits = [m.prefixes.hits for m in many.members]
    again = many.generate_many(prompts, raw=True, max_new_tokens=6, stop=["\n"])  # shots stored (prefix.py)
    assert scored == [] and all(m.prefixes.hits - h >= len(prompts) for m, h in zip(many.members, hits))
    for a, b, c in zip(alone, together, again):
        for r in (b, c):
            assert r.text == a.text
            assert r.stats["evidence"] == pytest.approx(a.stats["evidence"], abs=2e-3)
            assert r.stats["member_weights"] == pytest.approx(a.stats["member_weights"], abs=1e-3)
            assert all(st["prefills"] == 1 for st in r.stats["members"].values())


# ---- solo: a member that holds the prior and the evidence runs alone -----------------------------------
@pytest.mark.parametrize("method", ["unite", "safe", "specfuse", "smc"])
def test_solo_member_needs_auto_weights_and_both_prior_and_evidence(method):
    cls = get_method(method)
    m = cls([], cls.make_config({"solo": 0.9}))
    assert solo_member(m, [0.95, 0.05], [0.97, 0.03], 0) == 0
    assert solo_member(m, [0.95, 0.05], [0.9, 0.1], 0) == 0  # at the threshold
    assert solo_member(m, [0.85, 0.15], [0.97, 0.03], 0) is None  # the prior alone is not enough
    assert solo_member(m, [0.95, 0.05], [0.85, 0.15], 0) is None  # nor the prior without the evidence
    assert solo_member(m, [0.95, 0.05], [0.97, 0.03], 1) is None  # only the main member (a given drafter wins)
    assert solo_member(m, [0.02, 0.01, 0.97], [0.0, 0.05, 0.95], 2) == 2
    off = cls([], cls.make_config({"solo": None}))
    assert solo_member(off, [0.999, 0.001], [0.999, 0.001], 0) is None
    # the shot exam: the one member it leaves runs alone, whatever the weights and the solo setting
    assert solo_member(m, [0.6, 0.4], [0.6, 0.4], 0, aside=[0]) == 1
    assert solo_member(off, [0.6, 0.4], [0.6, 0.4], 0, aside=[1]) == 0
    assert solo_member(m, [0.4, 0.3, 0.3], [0.4, 0.3, 0.3], 0, aside=[2]) is None  # two left: the ensemble
    fixed = cls([], cls.make_config({"solo": 0.9, "weights": [0.999, 0.001]}))
    assert solo_member(fixed, [0.999, 0.001], [0.999, 0.001], 0) is None  # given weights: always the ensemble
    assert cls.make_config(None).solo == 0.99


@pytest.mark.parametrize("bad", [0.5, 0.3, 1.5, True, "high", float("nan")])
@pytest.mark.parametrize("method", ["unite", "safe", "specfuse", "smc"])
def test_bad_solo_is_refused_naming_the_field(method, bad):
    with pytest.raises(ConfigError, match=r"\.solo must be None"):
        get_method(method).make_config({"solo": bad})


@pytest.fixture(scope="module")
def plural_prompt():
    shots, exs = load_task(*resolve_task("plural", 1))
    return shots + f"Q: {exs[0]['input']}\nA:"


@pytest.mark.parametrize("method", ["unite", "safe", "specfuse", "smc"])
def test_a_dominant_member_runs_alone_with_its_own_text_and_cost(real_dirs, plural_prompt, method, monkeypatch):
    """Plural shots favour SmolLM2 (raw prior 0.65, its evidence lifts it past 0.9): with solo at
    0.6 the request is SmolLM2's own decode (its text, no other member's forward after the scoring
    prefill, the other member's scored state dropped); at the default 0.99 it is the ensemble."""
    smol, gemma = real_dirs[SMOL], real_dirs[GEMMA]
    cfg = {"solo": 0.6, "evidence": 1, **({"n_particles": 2} if method == "smc" else {})}
    eng = Ensemble([smol, gemma], method=method, config=cfg).load()
    dropped, forget = [], type(eng.members[1]).forget_prompt

    def spy(self, ids):  # in the request's context: the scored state is there before, gone after
        ready = current_request().ready
        before = ready.get(id(self))
        forget(self, ids)
        dropped.append((self.name, before is not None and before.ids[: len(ids)] == ids, ready.get(id(self))))

    monkeypatch.setattr(type(eng.members[1]), "forget_prompt", spy)
    prior, _ = eng.member_weights("raw")
    assert prior[0] >= 0.6 > prior[1]
    alone = Ensemble([smol], method="single").generate(plural_prompt, raw=True, max_new_tokens=8, stop=["\n"])
    res = eng.generate(plural_prompt, raw=True, max_new_tokens=8, stop=["\n"])
    w = list(res.stats["member_weights"].values())
    assert w[0] >= 0.6 and res.stats["solo"] == eng.members[0].name == res.stats["main_member"]
    assert res.text == alone.text and res.usage.completion_tokens == alone.usage.completion_tokens
    figs = list(res.stats["members"].values())
    assert figs[1] == {**figs[1], "forward_passes": 1, "prefills": 1}  # its scoring prefill only
    assert figs[0]["prefills"] == 1  # the scored prompt's state was handed over
    assert dropped == [(eng.members[1].name, True, None)]  # its scored state is not left behind
    if method == "unite":  # the default solo weight is not reached on the pair: the ensemble runs
        ens = Ensemble([smol, gemma], method="unite", config={"evidence": 1}).load()
        r2 = ens.generate(plural_prompt, raw=True, max_new_tokens=8, stop=["\n"])
        assert "solo" not in r2.stats and list(r2.stats["members"].values())[1]["forward_passes"] > 1


def test_solo_scores_only_the_main_member_when_no_evidence_could_change_it(tiny_members):
    """A prior that already gives the main member the solo weight: its own evidence is scored,
    and if it keeps the solo weight even against others whose evidence were 0 (a log-prob's
    maximum), the others' prompts are not scored; the decision is the full posterior's."""
    members = [tiny_members["smol"], tiny_members["gemma"]]
    ids = [m.prompt_ids(FEW_SHOT) for m in members]
    unite = get_method("unite")

    def weights(prior, solo):
        before = [m.counters()[2] for m in members]
        notes = {}
        w, main, _ = request_weights(
            unite(members, unite.make_config({"solo": solo, "evidence": 1, "exam": False})),
            members,
            MemberPrompts(FEW_SHOT, True, [FEW_SHOT] * 2, ids),
            prior,
            0,
            notes,
        )
        for m, i in zip(members, ids):
            m.forget_prompt(i)
        return w, main, notes, [m.counters()[2] - b for m, b in zip(members, before)]

    e = list(weights([0.5, 0.5], None)[2]["evidence"].values())  # each member's own evidence
    for margin, alone in ((10.0, True), (0.0, False)):  # the other's prior: e^(e_main - margin)
        prior = [1.0, math.exp(e[0] - margin)]
        prior = [p / sum(prior) for p in prior]
        w, main, notes, scored = weights(prior, 0.99)
        full = posterior(prior, e)
        assert main == 0 and (w[0] >= 0.99) == (full[0] >= 0.99)  # the full posterior's decision
        if alone:  # settled by the bound: the other's prompt is not scored; its weight is its upper bound
            assert scored == [1, 0] and list(notes["evidence"]) == [members[0].name]
            assert w == pytest.approx(posterior(prior, [e[0], 0.0]), abs=1e-6)
        else:  # the bound could not settle it: everyone scored, the main member once
            assert scored == [1, 1] and w == pytest.approx(full, abs=1e-3)
    w, _, _, scored = weights(prior, None)  # solo off: everyone scored
    assert scored == [1, 1]


# ---- the shot exam: a member nowhere near writing the shown answers steps aside ----------------------


@pytest.mark.parametrize("method", ["unite", "safe", "specfuse", "smc"])
def test_a_member_far_behind_on_the_shot_exam_steps_aside(real_dirs, plural_prompt, method):
    """Country names in Russian: SmolLM2 (English) is tens of nats from writing each shown answer,
    Gemma-3 (multilingual) near it, so SmolLM2 steps aside and the request is Gemma's own decode
    (its text); with exam=False both run. On plural shots both members are near every answer:
    nobody steps aside."""
    smol, gemma = real_dirs[SMOL], real_dirs[GEMMA]
    extra = {"n_particles": 2} if method == "smc" else {}
    eng = Ensemble([smol, gemma], method=method, config=extra).load()
    names = [m.name for m in eng.members]
    res = eng.generate(RUSSIAN, raw=True, max_new_tokens=8, stop=["\n"])
    exam = res.stats["exam"]
    assert exam["examined"] == 3 and exam[names[1]] - exam[names[0]] >= EXAM_BEHIND
    assert res.stats["aside"] == [names[0]] and res.stats["solo"] == names[1]
    alone = Ensemble([gemma], method="single").generate(RUSSIAN, raw=True, max_new_tokens=8, stop=["\n"])
    assert res.text == alone.text
    plural = eng.generate(plural_prompt, raw=True, max_new_tokens=8, stop=["\n"])
    assert "aside" not in plural.stats and "solo" not in plural.stats and plural.stats["exam"]["examined"] == 2
    off = Ensemble([smol, gemma], method=method, config={**extra, "exam": False}).load()
    r2 = off.generate(RUSSIAN, raw=True, max_new_tokens=8, stop=["\n"])
    assert "exam" not in r2.stats and "solo" not in r2.stats
    with pytest.raises(ConfigError, match="exam must be True or False"):
        Ensemble([smol, gemma], method=method, config={"exam": "yes"})


def _reformat(qa: str, fmt: str) -> str:
    """A `Q:/A:` few-shot prompt written in another line format."""
    pairs = [(q[3:], a[3:]) for q, a in zip(qa.split("\n")[0::2], qa.split("\n")[1::2])]
    (query, _), shots = pairs[-1], pairs[:-1]
    if fmt == "arrow":
        return "".join(f"{q} => {a}\n" for q, a in shots) + f"{query} =>"
    return "".join(f"Question: {q}\nAnswer:\n{a}\n\n" for q, a in shots) + f"Question: {query}\nAnswer:\n"


@pytest.mark.parametrize("fmt", ["arrow", "nextline"])
def test_the_exam_reads_shots_in_any_line_format(real_dirs, fmt):
    """The Russian country names as `x => y` lines and with the answer on the next line: the exam
    finds the shown answers without a `Q:/A:` label, SmolLM2 steps aside and the text is Gemma's;
    the demonyms' copy test reads the question in either format."""
    smol, gemma = real_dirs[SMOL], real_dirs[GEMMA]
    eng = Ensemble([smol, gemma], method="specfuse").load()
    names = [m.name for m in eng.members]
    prompt = _reformat(RUSSIAN, fmt)
    res = eng.generate(prompt, raw=True, max_new_tokens=8, stop=["\n"])
    assert res.stats["exam"]["examined"] == 3 and res.stats["aside"] == [names[0]] and res.stats["solo"] == names[1]
    alone = Ensemble([gemma], method="single").generate(prompt, raw=True, max_new_tokens=8, stop=["\n"])
    assert res.text == alone.text
    assert query_copy(_reformat(DEMONYM, fmt)) == (" Lithuania\n" if fmt == "arrow" else "Lithuania\n")


@pytest.mark.parametrize("method", ["unite", "safe", "specfuse", "smc"])
def test_a_member_that_copies_the_question_steps_aside(real_dirs, method):
    """Demonyms: Gemma-3 is near every shown answer (the exam keeps it), but its greedy reply to
    the query is the country itself, which no shot shows, while SmolLM2 writes the demonym: Gemma
    steps aside and the text is SmolLM2's own. With exam=False both run."""
    smol, gemma = real_dirs[SMOL], real_dirs[GEMMA]
    extra = {"n_particles": 2} if method == "smc" else {}
    eng = Ensemble([smol, gemma], method=method, config=extra).load()
    names = [m.name for m in eng.members]
    res = eng.generate(DEMONYM, raw=True, max_new_tokens=8, stop=["\n"])
    assert res.stats["copy"] == [names[1]] == res.stats["aside"] and res.stats["solo"] == names[0]
    alone = Ensemble([smol], method="single").generate(DEMONYM, raw=True, max_new_tokens=8, stop=["\n"])
    copier = Ensemble([gemma], method="single").generate(DEMONYM, raw=True, max_new_tokens=8, stop=["\n"])
    assert res.text == alone.text == " Lithuanian" and copier.text == " Lithuania"
    assert list(res.stats["members"].values())[0]["prefills"] == 1  # the copy was cropped off its state
    off = Ensemble([smol, gemma], method=method, config={**extra, "exam": False}).load()
    assert "copy" not in off.generate(DEMONYM, raw=True, max_new_tokens=8, stop=["\n"]).stats


def _turns(shots: list[tuple[str, str]], query: str) -> list[dict]:
    """Shots as earlier chat turns, then the query as the last user message."""
    pairs = [[{"role": "user", "content": q}, {"role": "assistant", "content": a}] for q, a in shots]
    return [m for p in pairs for m in p] + [{"role": "user", "content": query}]


PLURAL_TURNS = _turns([("market", "markets"), ("quarrel", "quarrels"), ("dissenter", "dissenters")], "reward")


@pytest.mark.parametrize("method", ["safe", "unite"])
def test_a_chat_member_that_copies_the_question_steps_aside(real_dirs, method):
    """Shots as chat turns (the dev plurals): Gemma-3's whole reply to "reward" would be "reward"
    (in its plain transcript, the word and the newline that ends the turn), which no shown answer
    is; SmolLM2's is "rewards". Gemma steps aside and the text is SmolLM2's own."""
    smol, gemma = real_dirs[SMOL], real_dirs[GEMMA]
    eng = Ensemble([smol, gemma], method=method).load()
    names = [m.name for m in eng.members]
    res = eng.generate(PLURAL_TURNS, max_new_tokens=8)
    assert res.stats["copy"] == [names[1]] == res.stats["aside"] and res.stats["solo"] == names[0]
    alone = Ensemble([smol], method="single").generate(PLURAL_TURNS, max_new_tokens=8)
    copier = Ensemble([gemma], method="single").generate(PLURAL_TURNS, max_new_tokens=8)
    assert res.text == alone.text == "rewards" and copier.text == "reward"


def test_query_copy_reads_the_question_and_defers_to_shots_that_copy():
    from ensemble_llm.evidence import query_copy

    assert query_copy(DEMONYM) == " Lithuania\n"
    assert query_copy("Word: run\nPast:  ran\nWord: go\nPast:") == "  go\n"  # the answers' own spacing
    assert query_copy("run\nA: ran\nsee\nA: saw\ngo\nA:") == " go\n"  # questions without a label
    assert query_copy("Q: a: b\nA: x\nQ: c\nA:") == " c\n"  # the label is the first colon's
    assert query_copy("Q: sheep\nA: sheep\nQ: cat\nA: cats\nQ: deer\nA:") is None  # a shot copies
    assert query_copy("A: first\nQ: go\nA:") is None  # the first answer has no question before it
    assert query_copy("Q: go\nA:") is None  # no shown answer
    assert query_copy("Q: x\nA: y\nQ: \nA:") is None  # an empty question
    assert query_copy("Q: x\nA: y\nA: z\nQ: w\nA:") is None  # an answer line where a question goes
    assert query_copy("cat => cats\ndog => dogs\nfox =>") == " fox\n"  # any line format
    assert query_copy("Question: big\nAnswer:\nbigger\n\nQuestion: wet\nAnswer:\n") == "wet\n"


def test_copy_tokens_are_a_short_continuation_of_the_prompt(tiny_members):
    from ensemble_llm.evidence import COPY_TOKENS, MemberPrompts, copy_tokens

    members = [tiny_members["smol"], tiny_members["gemma"]]
    ids = [m.prompt_ids(DEMONYM) for m in members]
    tails = copy_tokens(members, MemberPrompts(DEMONYM, True, [DEMONYM] * 2, ids))
    assert [m.prompt_ids(DEMONYM + " Lithuania\n") for m in members] == [i + t for i, t in zip(ids, tails)]
    assert [m.decode(t) for m, t in zip(members, tails)] == [" Lithuania\n"] * 2
    chat = MemberPrompts(DEMONYM, False, [DEMONYM] * 2, ids)
    assert copy_tokens(members, chat) is None  # one user message: no shown answer
    long = DEMONYM.replace("Lithuania", " ".join(["Lithuania"] * COPY_TOKENS))
    long_ids = [m.prompt_ids(long) for m in members]
    assert copy_tokens(members, MemberPrompts(long, True, [long] * 2, long_ids)) is None  # could extend by as much


TURNS = _turns([("run", "ran"), ("see", "saw")], "forgive")


def test_chat_copy_is_the_last_user_turn_unless_a_shown_answer_copies_its_question():
    from ensemble_llm.evidence import chat_copy

    turns = [(m["role"], m["content"]) for m in TURNS]
    assert chat_copy(turns) == "forgive"
    assert chat_copy(turns[:1]) is None  # no shown answer
    assert chat_copy(turns[:4]) is None  # the assistant spoke last
    assert chat_copy(turns[:2] + [("user", "sheep"), ("assistant", " sheep "), ("user", "cat")]) is None
    assert chat_copy([("system", "Be brief."), *turns]) == "forgive"
    assert chat_copy(turns[:4] + [("user", "  ")]) is None  # an empty question


def test_chat_copy_tokens_end_with_each_members_end_of_turn(tiny_members):
    """In a chat, the copy is the question as the member's whole reply: with a template, the
    question and the template's end-of-turn marker; in the plain transcript, the question and the
    newline that ends the turn. Both continue the member's prompt tokens."""
    from ensemble_llm.chat import render_chat
    from ensemble_llm.evidence import MemberPrompts, copy_tokens

    members = [tiny_members["smol"], tiny_members["gemma"]]
    assert [m.has_chat_template for m in members] == [True, False]
    texts = [render_chat(m, TURNS) for m in members]
    ids = [m.prompt_ids(t) for m, t in zip(members, texts)]
    tails = copy_tokens(members, MemberPrompts(TURNS, False, texts, ids))
    full = render_chat(members[0], TURNS + [{"role": "assistant", "content": "forgive"}], add_generation_prompt=False)
    smol_ids = members[0].prompt_ids(full)
    assert smol_ids[: len(ids[0]) + len(tails[0])] == ids[0] + tails[0]
    assert members[0].decode(tails[0][:-1]) == "forgive" and tails[0][-1] in members[0].special_ids
    assert members[1].prompt_ids(texts[1] + "forgive\n") == ids[1] + tails[1]
    assert members[1].decode(tails[1]) == "forgive\n"


def test_greedy_after_reads_the_scored_state_and_leaves_it_for_the_prefill(tiny_members):
    """The member's own greedy tokens are a greedy continuation; a token off its row's best is
    not, and then no forward runs. The scored state is handed to the prefill unchanged."""
    m = tiny_members["gemma"]
    ids = m.prompt_ids(FEW_SHOT)
    fresh = m.new_state()
    rows = m.extend(fresh, ids, last_only=True)
    greedy = [int(rows[-1].argmax())]
    for _ in range(2):
        greedy.append(int(m.extend(fresh, greedy[-1:])[-1].argmax()))
    other = int(torch.topk(rows[-1], 2).indices[1])
    m.score_prompt(ids, [3])
    b = m.counters()
    assert m.greedy_after(ids, greedy) and m.counters()[0] - b[0] == 1  # one extend for the rest
    assert m.greedy_after(ids, greedy[:1]) and not m.greedy_after(ids, [other] + greedy[1:])
    assert m.counters()[0] - b[0] == 1 and m.counters()[2] == b[2]  # first token alone: no forward
    state = m.prefill(ids)  # the scored state, as it was
    assert state.ids == ids and m.counters()[2] == b[2]
    ref = m.new_state()
    m.extend(ref, ids, last_only=True)
    assert torch.allclose(state.next_logprobs, ref.next_logprobs, atol=1e-5)
    with pytest.raises(ValueError, match="at least one token"):
        m.greedy_after(ids, [])


def test_copy_aside_brute_force():
    from itertools import product

    from ensemble_llm.evidence import copy_aside

    for n in range(1, 5):
        for copies in product([False, True], repeat=n):
            for aside in ((), (0,), tuple(range(1, n))):
                got = copy_aside(copies, aside)
                left = [k for k in range(n) if k not in aside]
                if all(copies[k] for k in left) or not any(copies[k] for k in left):
                    assert got == []  # all copy, or none: the copy says nothing
                else:
                    assert got == [k for k in left if copies[k]] and set(left) - set(got)


def test_the_exam_reads_the_same_last_answers_for_every_member_within_the_row_bound():
    from ensemble_llm.evidence import EXAM_ANSWERS, MAX_POSITIONS, _examined

    short = [[[1]], [[2, 3]], [[4]], [[5, 6]]]
    assert _examined([[g[0] for g in short]] * 2) == [[[2, 3], [4], [5, 6]]] * 2  # not the first
    many = [[k] for k in range(EXAM_ANSWERS + 5)]
    assert _examined([many])[0] == many[-EXAM_ANSWERS:]
    long_turn = list(range(MAX_POSITIONS - 1))  # one member's last answer fills the bound alone
    a = [[0], [1, 2], long_turn]
    b = [[0], [1], [2]]
    assert _examined([a, b]) == [[long_turn], [[2]]]  # the same answers for both: the last one
    assert _examined([[[0], list(range(MAX_POSITIONS + 1))], b[:2]]) == [[], []]  # too long: none


@pytest.mark.parametrize(
    "context, answer",
    [
        ("Q: a\nA: x\n\nQ: b\nA: y\n\nQ: c\nA:", " Paris"),
        ("Q: what?\nA:", " 3:45"),
        ("france => Paris\nspain => Madrid\nitaly =>", " Rome, Italy"),
        ("Question: a\nAnswer:\nx, y\n\nQuestion: b\nAnswer:", "\ny, z"),
        ("Question: X\nAnswer:", "\nParis"),
        ("Q: 1. a\nA:", " 1. B, C"),
        ("Q: a\nA: 3:45\nQ: b\nA:", " 4:00"),
        ("Roof shingle removal:", " A man is on a roof. He starts"),
        ("", "The capital of France is Paris"),
        ("intro", "\nThe capital is Paris"),
    ],
)
def test_context_end_splits_an_echoed_choice_from_its_context(context, answer):
    """Where an echoed multiple-choice text's context ends: its shown answers' label in any line
    format, the first label on a zero-shot last line, the whitespace going with the answer."""
    assert context_end(context + answer) == len(context)
