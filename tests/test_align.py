"""Alignment by token string, the UniTE union, sharpening, OOV-like boundaries, canonical sync."""

import math

import pytest
import torch

from ensemble_llm.methods.align import (
    EOS,
    CanonicalView,
    UnionDist,
    sharpen,
    union_distribution,
    valid_utf8_prefix,
    vocab_index,
)


def test_keys_normalise_spellings_across_tokenizers(tiny_members):
    smol, gemma = tiny_members["smol"], tiny_members["gemma"]
    s, g = vocab_index(smol), vocab_index(gemma)
    assert s.key_of(smol.tokenizer.convert_tokens_to_ids("ĠParis")) == b" Paris"
    assert g.key_of(gemma.tokenizer.convert_tokens_to_ids("▁Paris")) == b" Paris"
    assert s.key_of(smol.tokenizer.convert_tokens_to_ids("Ċ")) == b"\n"
    assert g.key_of(gemma.tokenizer.convert_tokens_to_ids("<0x0A>")) in (b"\n",)
    assert s.key_of(sorted(smol.eos_ids)[0]) is EOS and g.key_of(sorted(gemma.eos_ids)[0]) is EOS


def _row(member, probs: dict[str, float]) -> torch.Tensor:
    """A log-prob row with the given probabilities on the given token strings, ~0 elsewhere."""
    row = torch.full((member.vocab_size,), -60.0)
    for piece, p in probs.items():
        row[member.tokenizer.convert_tokens_to_ids(piece)] = math.log(p)
    return row


def test_union_distribution_against_hand_computed_numbers(tiny_members):
    smol, gemma = tiny_members["smol"], tiny_members["gemma"]
    rs = _row(smol, {"ĠParis": 0.6, "ĠPar": 0.3})
    rg = _row(gemma, {"▁Paris": 0.5, "▁London": 0.4})
    d = union_distribution([smol, gemma], [rs, rg], [1.0, 1.0], k=2)
    assert d.keys == [b" Paris", b" Par", b" London"]
    # smol: softmax over {.6, .3, ~0} ; gemma: {.5, ~0 (its own " Par" token), .4}
    want_s = torch.tensor([0.6, 0.3, 0.0]) / 0.9
    want_g = torch.tensor([0.5, 0.0, 0.4]) / 0.9
    assert torch.allclose(d.per_member[0], want_s, atol=1e-6)
    assert torch.allclose(d.per_member[1], want_g, atol=1e-6)
    assert torch.allclose(d.probs, (want_s + want_g) / 2, atol=1e-6)
    w = union_distribution([smol, gemma], [rs, rg], [3.0, 1.0], k=2)
    assert torch.allclose(w.probs, 0.75 * want_s + 0.25 * want_g, atol=1e-6)


def test_missing_string_gets_first_subtoken_probability(tiny_members):
    smol, gemma = tiny_members["smol"], tiny_members["gemma"]
    # " unbelievably" is one Gemma token; SmolLM2 has no such token and spells it "Ġunbelie"+"v"+"ably"
    rg = _row(gemma, {"▁unbelievably": 0.9})
    rs = _row(smol, {"Ġunbelie": 0.2, "Ġthe": 0.7})
    d = union_distribution([smol, gemma], [rs, rg], [1.0, 1.0], k=1)
    assert d.keys == [b" the", b" unbelievably"]
    assert torch.allclose(d.per_member[0], torch.tensor([0.7, 0.2]) / 0.9, atol=1e-6)


def test_onto_main_counts_each_members_mass_once_on_the_main_members_tokens(tiny_members):
    smol, gemma = tiny_members["smol"], tiny_members["gemma"]
    # SmolLM2 writes " tonnes" as " ton" + "nes" and has no " tonne"; Gemma has " tonne" and " tonnes"
    assert vocab_index(smol).first_subtoken(b" tonne") == smol.tokenizer.convert_tokens_to_ids("Ġton")
    assert b" tonne" not in vocab_index(smol).by_bytes and b" tonne" in vocab_index(gemma).by_bytes
    rs = _row(smol, {"Ġton": 0.5, "Ġtonnes": 0.1})
    rg = _row(gemma, {"▁tonnes": 0.45, "▁tonne": 0.4})
    # UniTE's rule: " tonne" takes SmolLM2's " ton" logit too, so SmolLM2's 0.5 counts twice and the
    # stem wins, though neither member's own choice is " tonne"
    u = union_distribution([smol, gemma], [rs, rg], [1.0, 1.0], k=2)
    assert u.keys == [b" ton", b" tonnes", b" tonne"]
    want_s, want_g = torch.tensor([0.5, 0.1, 0.5]) / 1.1, torch.tensor([0.0, 0.45, 0.4]) / 0.85
    assert torch.allclose(u.probs, (want_s + want_g) / 2, atol=1e-6)
    assert u.keys[int(u.probs.argmax())] == b" tonne"
    # onto the main member's tokens: SmolLM2's mass on its own tokens only, Gemma's " tonne" moved to " ton"
    d = union_distribution([smol, gemma], [rs, rg], [1.0, 1.0], k=2, onto_main=True)
    assert d.keys == [b" ton", b" tonnes"]
    want_s, want_g = torch.tensor([0.5, 0.1]) / 0.6, torch.tensor([0.4, 0.45]) / 0.85
    assert torch.allclose(d.per_member, torch.stack([want_s, want_g]), atol=1e-6)
    assert torch.allclose(d.probs, (want_s + want_g) / 2, atol=1e-6) and d.keys[int(d.probs.argmax())] == b" ton"
    w = union_distribution([smol, gemma], [rs, rg], [1.0, 9.0], k=2, onto_main=True)
    assert torch.allclose(w.probs, 0.1 * want_s + 0.9 * want_g, atol=1e-6)
    # with Gemma as the main member the keys are Gemma's tokens; EOS stays EOS
    eos_s = smol.tokenizer.convert_ids_to_tokens(sorted(smol.eos_ids)[0])
    g = union_distribution([gemma, smol], [rg, _row(smol, {"Ġton": 0.5, eos_s: 0.3})], [1.0, 1.0], k=2, onto_main=True)
    gi = vocab_index(gemma)
    assert set(g.keys) == {b" tonnes", b" tonne", EOS, gi.key_of(gi.first_subtoken(b" ton"))}
    assert torch.allclose(g.per_member.sum(1), torch.ones(2), atol=1e-6)


def test_onto_main_every_top1_agreeing_is_not_the_argmax_but_a_weighted_mean_above_half_is(tiny_members):
    """Why safe's consensus skip asks for the weighted mean with onto_main: every member's own top-1
    is " the", yet Gemma's " unbelievably" and " unbelievable" both start with SmolLM2's " unbelie"
    and add up there. With UniTE's rule every member's top-1 is the argmax (Theorem 1)."""
    smol, gemma = tiny_members["smol"], tiny_members["gemma"]
    si = vocab_index(smol)
    for word in (b" unbelievably", b" unbelievable"):
        assert word not in si.by_bytes and si.first_subtoken(word) == smol.tokenizer.convert_tokens_to_ids("Ġunbelie")
    rs = _row(smol, {"Ġthe": 0.45, "Ġunbelie": 0.40})
    rg = _row(gemma, {"▁the": 0.34, "▁unbelievably": 0.33, "▁unbelievable": 0.33})
    u = union_distribution([smol, gemma], [rs, rg], [1.0, 1.0], k=3)
    assert u.keys[int(u.probs.argmax())] == b" the"
    d = union_distribution([smol, gemma], [rs, rg], [1.0, 1.0], k=3, onto_main=True)
    assert d.keys[int(d.probs.argmax())] == b" unbelie"
    assert torch.allclose(d.probs[d.index(b" unbelie")], torch.tensor((0.40 / 0.85 + 0.66) / 2), atol=1e-4)
    # a weighted mean of the members' own probabilities above 1/2 is always the argmax: the token's
    # mass for each member is at least its own probability of it
    rs2 = _row(smol, {"Ġthe": 0.70, "Ġunbelie": 0.25})
    rg2 = _row(gemma, {"▁the": 0.34, "▁unbelievably": 0.33, "▁unbelievable": 0.33})
    d2 = union_distribution([smol, gemma], [rs2, rg2], [1.0, 1.0], k=3, onto_main=True)
    assert (0.70 + 0.34) / 2 > 0.5 and d2.keys[int(d2.probs.argmax())] == b" the"


def test_onto_main_moves_a_key_only_onto_a_token_that_starts_it(tiny_members, monkeypatch):
    """A main member whose tokenizer adds a leading space (Llama-2 / Mistral SentencePiece) spells
    "ingly" as " ing" + "ly": its first token is not a prefix of the key, so the key's mass goes to
    the longest prefix it has as a token instead (never to text that was not written)."""
    from ensemble_llm.methods.align import main_prefix

    smol = tiny_members["smol"]
    si = vocab_index(smol)
    assert main_prefix(si, b" tonne") == b" ton" and main_prefix(si, b" the") == b" the"
    spaced = si.by_bytes[b" ing"]
    monkeypatch.setattr(si, "first_subtoken", lambda key: spaced)
    got = main_prefix(si, b"ingly")
    assert b"ingly".startswith(got) and got in si.by_bytes and got != b" ing"
    assert got == max((b"ingly"[:n] for n in range(1, 6) if b"ingly"[:n] in si.by_bytes), key=len)
    monkeypatch.undo()
    # a byte-level first token that stops inside a character is carried to the character's end
    key = "こんにちは".encode()
    first = si.key_of(si.first_subtoken(key))
    assert len(first) < 3 and main_prefix(si, key) == "こ".encode()  # SmolLM2's first token is half of "こ"
    assert main_prefix(si, "こ".encode()[:2]) == "こ".encode()[:2]  # a fragment key stays itself


def test_safe_consensus_skip_with_onto_main_needs_the_weighted_mean(tiny_members):
    """The counterexample above through safe's own consensus test: with UniTE's union every
    member's top-1 agreeing is a lossless skip; with onto_main it is not, and the position is
    ensembled; a weighted mean above 1/2 skips under both."""
    from types import SimpleNamespace

    from ensemble_llm.methods.safe import SafeConfig, _SafeRun

    smol, gemma = tiny_members["smol"], tiny_members["gemma"]
    the_s, the_g = smol.tokenizer.convert_tokens_to_ids("Ġthe"), gemma.tokenizer.convert_tokens_to_ids("▁the")
    view = SimpleNamespace(member=gemma, next_tok={0: the_g})
    rg = _row(gemma, {"▁the": 0.34, "▁unbelievably": 0.33, "▁unbelievable": 0.33})
    for onto_main, low, high in ((False, True, True), (True, False, True)):
        run = SimpleNamespace(views=[view], weights=[1.0, 1.0], wsum=2.0, cfg=SafeConfig(onto_main=onto_main))
        rs = _row(smol, {"Ġthe": 0.45, "Ġunbelie": 0.40})  # both top-1s " the", weighted mean 0.395
        assert _SafeRun.consensus(run, the_s, rs, b" the", 0, [rg]) is low
        rs = _row(smol, {"Ġthe": 0.70, "Ġunbelie": 0.25})  # weighted mean 0.52
        assert _SafeRun.consensus(run, the_s, rs, b" the", 0, [rg]) is high


def test_heuristic_sharpening_hand_computed():
    keys = [b"So", b"Sofia", b"Sof", b" ", EOS]
    p = torch.tensor([0.3, 0.2, 0.1, 0.15, 0.25])
    d = UnionDist(keys, p, torch.stack([p, p]))
    out = sharpen(d, [b"So", b"Sof", b" "], "heuristic", 0.1, [1, 1])
    # So (0.3 > 0.1) gains Sofia and Sof: 0.6; Sof (0.1, not > 0.1) unchanged; " " never gains; no renorm
    assert torch.allclose(out, torch.tensor([0.6, 0.2, 0.1, 0.15, 0.25]))
    out2 = sharpen(d, [b"Sof"], "heuristic", 0.05, [1, 1])
    assert torch.allclose(out2, torch.tensor([0.3, 0.2, 0.1 + 0.2, 0.15, 0.25]))
    assert torch.equal(sharpen(d, [b"So"], None, 0.1, [1, 1]), p)


def test_geometric_sharpening_hand_computed():
    per = torch.tensor([[0.5, 0.5], [0.9, 0.1]])
    d = UnionDist([b"a", b"b"], per.mean(0), per)
    out = sharpen(d, [b"a"], "geometric", 0.1, [1, 1])
    a, b = math.sqrt(0.45), math.sqrt(0.05)
    assert torch.allclose(out, torch.tensor([a / (a + b), b / (a + b)]), atol=1e-6)


def test_valid_utf8_prefix():
    data = "aé東".encode()
    assert valid_utf8_prefix(data) == len(data)
    assert valid_utf8_prefix(data[:-1]) == 3
    assert valid_utf8_prefix(b"") == 0


def _oov_flags(drafter, draft_ids, view):
    """SAFE's check: drafter token j is OOV-like when its byte end is not a verifier boundary."""
    text = b"".join(drafter.vocab_bytes[i] for i in draft_ids)
    view.sync(text.decode("utf-8"))
    ends, pos = [], 0
    for i in draft_ids:
        pos += len(drafter.vocab_bytes[i])
        ends.append(pos)
    return [e not in view.rows for e in ends]


@pytest.mark.parametrize(
    "text, want",
    [
        ("Incorrect answers", [True, False, False]),  # In|correct vs Incorrect
        ("Sofía went home", [True, False, False, False, False]),  # S|of|ía vs Sof|ía
        ("東京タワー", [True, True, True, False, True, False, True, True, False]),  # byte pieces vs whole chars
        ("I love 🙂 emoji", [False, False, False, True, False]),  # em|oji vs emoji
        ("Hello world!", [False, False, False]),
    ],
)
def test_oov_like_detection_smollm2_drafter_gemma_verifier(tiny_members, text, want):
    smol, gemma = tiny_members["smol"], tiny_members["gemma"]
    view = CanonicalView.start(gemma, gemma.prompt_ids("Q:"))
    assert _oov_flags(smol, smol.encode(text), view) == want


def test_right_context_changes_boundaries(tiny_members):
    smol, gemma = tiny_members["smol"], tiny_members["gemma"]
    tok = smol.tokenizer.convert_tokens_to_ids
    draft = [tok("Hello"), tok("Ġworld"), tok("wide")]  # a drafter may emit "world" then "wide"
    view = CanonicalView.start(gemma, gemma.prompt_ids("Q:"))
    # alone, " world" ends on a Gemma boundary; followed by "wide", Gemma reads "▁worldwide"
    assert _oov_flags(smol, draft[:2], view) == [False, False]
    assert _oov_flags(smol, draft, view) == [False, True, False]


@pytest.mark.parametrize("key", ["smol", "gemma"])
def test_canonical_sync_equals_fresh_prefill(tiny_members, key):
    m = tiny_members[key]
    prompt = m.prompt_ids("Question: say hello")
    view = CanonicalView.start(m, prompt)
    for text in ["Hel", "Hello", "Hello wor", "Hello worldwide", "Hello world, Sofía"]:
        view.sync(text, from_byte=0)
        ids, ends = m.encode_with_offsets(text)
        assert view.state.ids == prompt + ids
        fresh = m.forward_batch([prompt + ids])[0]
        assert torch.allclose(view.rows[0], fresh[len(prompt) - 1], atol=1e-4)
        for i, e in enumerate(ends):
            assert torch.allclose(view.rows[e], fresh[len(prompt) + i], atol=1e-4)
        assert view.next_tok[0] == ids[0]


def test_duplicate_spellings_resolve_to_the_canonical_token(tiny_members):
    gemma = tiny_members["gemma"]
    idx = vocab_index(gemma)
    fallback = gemma.tokenizer.convert_tokens_to_ids("<0x2E>")
    assert gemma.vocab_bytes[fallback] == b"."
    assert idx.by_bytes[b"."] == gemma.encode(".")[0] != fallback


class _Ends:
    """A turn end whose probability is given (the maths of `end_turns` alone)."""

    def __init__(self, q: float) -> None:
        self.q = q

    def probability(self) -> float:
        return self.q


def test_end_turns_moves_the_part_of_a_members_newline_that_starts_a_turn_to_eos():
    from ensemble_llm.methods.align import NEWLINE, end_turns

    keys = [b" a", NEWLINE, EOS]
    per_member = torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.6, 0.3], [0.2, 0.4, 0.4]])
    out = end_turns(keys, per_member, [None, _Ends(0.25), _Ends(1.0)])
    assert torch.equal(out[0], per_member[0])  # no turn end: as it was
    assert torch.allclose(out[1], torch.tensor([0.1, 0.45, 0.45]))  # 0.6 * 0.25 moved
    assert torch.allclose(out[2], torch.tensor([0.2, 0.0, 0.8]))
    assert torch.allclose(out.sum(1), per_member.sum(1)) and torch.equal(per_member[1, 1], torch.tensor(0.6))


def test_turn_end_probability_against_a_fresh_scoring_of_the_transcript(tiny_members):
    """p("User:" | text up to byte b, newline) from the view's state, at two bytes in either order
    (the second probe extends what the first cropped), equals the member's own scoring of the
    whole sequence from scratch; a later sync gives the rows a fresh view gives."""
    from ensemble_llm.chat import PLAIN_STOPS, render_chat
    from ensemble_llm.methods.align import NEWLINE, TurnEnd

    m = tiny_members["gemma"]
    assert not m.has_chat_template
    ids = m.prompt_ids(render_chat(m, [{"role": "user", "content": "Where is Lima?"}]))
    text = "Lima is in Peru. It is the capital. Yes"
    view = CanonicalView.start(m, ids)
    view.sync(text)
    end = TurnEnd.of(view, PLAIN_STOPS[0])
    nl = vocab_index(m).by_bytes[NEWLINE]
    assert end is not None and end.newline == nl and m.decode(end.header) == "User:"
    for at in (len("Lima is in Peru. It is the capital."), len("Lima is in Peru."), len(text)):
        assert at in view.rows
        end.at = at
        got = end.probability()
        ref = math.exp(m.target_logprob(ids + m.encode(text[:at]) + [nl], end.header))
        assert got == pytest.approx(ref, rel=1e-4)
    longer = text + " indeed."
    view.sync(longer, from_byte=len(text))
    fresh = CanonicalView.start(m, ids)
    fresh.sync(longer, from_byte=len(text))
    assert len(text) in view.rows and set(view.rows) <= set(fresh.rows)
    for b in view.rows:
        assert torch.allclose(view.rows[b], fresh.rows[b], atol=1e-4)


def test_turn_end_needs_the_members_own_newline_first(tiny_members):
    from ensemble_llm.methods.align import TurnEnd

    view = CanonicalView.start(tiny_members["gemma"], [2, 10])
    assert TurnEnd.of(view, "User:") is None  # no newline first: nothing to read it from
