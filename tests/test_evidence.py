"""Per-request member weights (evidence.py): the answer spans a prompt shows, the prompt's
log-probs read from its own prefill (checked against a full forward), the hand-over of that
prefill to the method, and the posterior weights in the engine's results."""

from __future__ import annotations

import math

import pytest
import torch

from ensemble_llm import Ensemble
from ensemble_llm.evidence import FLOOR, answer_spans, chat_spans, posterior, span_positions
from ensemble_llm.members import batching

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


def test_chat_spans_find_assistant_turns_in_order():
    text = "<|user|>Hi<|assistant|>Hello!<|user|>Again<|assistant|>Hello!<|user|>x<|assistant|>"
    spans = chat_spans(text, ["Hello!", "Hello!", "not there", " "])
    assert [text.encode()[a:b] for a, b in spans] == [b"Hello!", b"Hello!"]
    assert spans[0][0] < spans[1][0]


def test_span_positions_pick_tokens_ending_inside_a_span():
    ends = [3, 5, 9, 10, 14]  # tokens cover [0,3) [3,5) [5,9) [9,10) [10,14)
    assert span_positions(ends, [(5, 10)], offset=0) == [2, 3]
    assert span_positions(ends, [(5, 10)], offset=1) == [3, 4]  # a BOS before the text
    assert span_positions(ends, [(4, 9)], offset=0) == [1, 2]  # a token straddling the start counts
    assert span_positions(ends, [(0, 3)], offset=0) == []  # position 0 has no context to predict it


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
    assert got == pytest.approx(want, abs=1e-4)
    state = m.prefill(ids)  # the scored prompt's state, not a second forward
    assert m.counters()[0] - before[0] == 1 and m.counters()[2] - before[2] == 1
    fresh = m.new_state()
    m.extend(fresh, ids, last_only=True)
    assert torch.allclose(state.next_logprobs, fresh.next_logprobs, atol=1e-5)
    assert state.ids == ids
    # the hand-over is one-shot and only for the same ids
    m.score_prompt(ids, positions)
    other = m.prefill(ids[:-1])
    assert other.ids == ids[:-1] and m.prefill(ids) is not state


@pytest.mark.parametrize("method", ["unite", "safe", "specfuse"])
def test_auto_weights_follow_the_prompt_and_cost_no_forward(tiny_dirs, method):
    eng = Ensemble([tiny_dirs["smol"], tiny_dirs["gemma"]], method=method).load()
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
    assert "evidence" not in r3.stats
    assert list(r3.stats["member_weights"].values()) == pytest.approx(eng.member_weights("chat")[0], abs=1e-4)


def test_chat_history_answers_are_evidence(tiny_dirs):
    eng = Ensemble([tiny_dirs["smol"], tiny_dirs["gemma"]], method="unite").load()
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
    member for the four prompts here), and each gets its one-at-a-time evidence, weights and text."""
    members = [tiny_dirs["smol"], tiny_dirs["gemma"]]
    prompts = [FEW_SHOT.replace("Peru", c) for c in ("Peru", "Chile", "Italy", "Kenya")]
    one = Ensemble(members, method="unite", max_batch=1)
    many = Ensemble(members, method="unite", max_batch=4).load()
    alone = [one.generate(p, raw=True, max_new_tokens=6, stop=["\n"]) for p in prompts]
    scored, forward = [], batching._prefill_forward

    def spy(member, calls, scoring):  # how many scored prompts each batched prompt forward carried
        scored.append(sum(c.positions is not None for c in calls))
        return forward(member, calls, scoring)

    monkeypatch.setattr(batching, "_prefill_forward", spy)
    before = [m.n_forward for m in many.members]
    together = many.generate_many(prompts, raw=True, max_new_tokens=6, stop=["\n"])
    assert max(scored) >= 2  # several requests' scorings in one forward
    for a, b in zip(alone, together):
        assert b.text == a.text
        assert b.stats["evidence"] == pytest.approx(a.stats["evidence"], abs=2e-3)
        assert b.stats["member_weights"] == pytest.approx(a.stats["member_weights"], abs=1e-3)
        assert all(st["prefills"] == 1 for st in b.stats["members"].values())
    ran = sum(m.n_forward for m in many.members) - sum(before)
    took_part = sum(st["forward_passes"] for r in together for st in r.stats["members"].values())
    assert ran < took_part
