"""Member API on tiny random-weight models with the real SmolLM2 and Gemma tokenizers."""

import pytest
import torch

from ensemble_llm.chat import chat_stops, render_chat
from ensemble_llm.members.vocab import tokenizer_kind

TEXTS = [
    "Hello world",
    "The capital of France is Paris.\n\nNext  line",
    "Sofía visited 東京 🙂 in 2024 — naïve café",
    "  leading spaces and\ttabs\n",
    "def f(x):\n    return x**2  # 平方",
]


@pytest.mark.parametrize("key", ["smol", "gemma"])
def test_token_bytes_rebuild_the_text_exactly(tiny_members, key):
    m = tiny_members[key]
    for text in TEXTS:
        ids, ends = m.encode_with_offsets(text)
        data = text.encode("utf-8")
        assert b"".join(m.vocab_bytes[i] for i in ids) == data
        assert ends == sorted(ends) and ends[-1] == len(data)
        # each end offset is where that token's bytes stop
        start = 0
        for i, e in zip(ids, ends):
            assert data[start:e] == m.vocab_bytes[i]
            start = e


def test_tokenizer_kinds_and_special_tokens(tiny_members):
    smol, gemma = tiny_members["smol"], tiny_members["gemma"]
    assert tokenizer_kind(smol.tokenizer) == "byte_level"
    assert tokenizer_kind(gemma.tokenizer) == "sentencepiece"
    # a CJK character that SmolLM2 splits across tokens: byte ends fall inside the character
    ids, ends = smol.encode_with_offsets("東")
    assert len(ids) > 1 and ends[-1] == 3
    assert smol.tokenizer.convert_tokens_to_ids("<|im_end|>") in smol.special_ids
    assert gemma.bos_id in gemma.special_ids
    # byte-fallback tokens of Gemma are single bytes
    fb = gemma.tokenizer.convert_tokens_to_ids("<0x0A>")
    assert gemma.vocab_bytes[fb] == b"\n"


def test_bos_and_chat_rendering(tiny_members):
    smol, gemma = tiny_members["smol"], tiny_members["gemma"]
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"}]
    s = render_chat(smol, msgs)
    assert s.startswith("<|im_start|>system\nBe brief.<|im_end|>") and s.endswith("<|im_start|>assistant\n")
    assert not smol.adds_bos and smol.prompt_ids(s)[0] == smol.tokenizer.convert_tokens_to_ids("<|im_start|>")
    g = render_chat(gemma, msgs)
    assert g == "Be brief.\nUser:\nHi?\nAssistant:\n"
    assert chat_stops(gemma) == ("\nUser:", "\nAssistant:") and chat_stops(smol) == ()
    ids = gemma.prompt_ids(g)
    assert ids[0] == gemma.bos_id and ids[1] != gemma.bos_id
    assert gemma.prompt_ids("<bos>" + g) == ids  # never a double BOS


@pytest.mark.parametrize("key", ["smol", "gemma"])
def test_incremental_extend_matches_full_forward(tiny_members, key):
    m = tiny_members[key]
    ids = m.prompt_ids("The quick brown fox jumps over the lazy dog, again and again and again.")
    assert len(ids) > 10  # longer than the tiny Gemma's sliding window (8)
    full = m.forward_batch([ids])[0]
    state = m.prefill(ids[:3])
    rows = [m.extend(state, ids[3:7]), m.extend(state, [ids[7]]), m.extend(state, ids[8:])]
    inc = torch.cat(rows)
    assert torch.allclose(inc, full[3:], atol=1e-4)
    assert torch.allclose(state.next_logprobs, full[-1], atol=1e-4)


@pytest.mark.parametrize("key", ["smol", "gemma"])
def test_crop_and_reextend_equals_fresh_prefill_even_past_sliding_window(tiny_members, key):
    m = tiny_members[key]
    ids = m.prompt_ids("One two three four five six seven eight nine ten eleven twelve thirteen fourteen.")
    other = m.encode(" Alpha beta gamma delta epsilon zeta")
    state = m.prefill(ids)
    m.extend(state, other)
    m.crop(state, 5)  # far behind the sliding window
    assert state.next_logprobs is None and state.ids == ids[:5]
    m.extend(state, ids[5:])
    fresh = m.prefill(ids)
    assert torch.allclose(state.next_logprobs, fresh.next_logprobs, atol=1e-4)
    m.crop(state, len(ids) - 2)
    assert torch.allclose(m.ensure_next(state), m.prefill(ids[:-2]).next_logprobs, atol=1e-4)
    # the cache itself equals a fresh prefill's cache
    fresh2 = m.prefill(ids[:-2])
    for a, b in zip(state.cache.layers, fresh2.cache.layers):
        assert torch.allclose(a.keys, b.keys, atol=1e-5) and torch.allclose(a.values, b.values, atol=1e-5)


@pytest.mark.parametrize("key", ["smol", "gemma"])
def test_forward_batch_matches_single_rows(tiny_members, key):
    m = tiny_members[key]
    seqs = [m.prompt_ids(t) for t in ("short", "a somewhat longer sequence here", "mid length one")]
    batch = m.forward_batch(seqs)
    for s, got in zip(seqs, batch):
        assert torch.allclose(got, m.forward_batch([s])[0], atol=1e-4)


@pytest.mark.parametrize("key", ["smol", "gemma"])
def test_score_inline_equals_separate_scoring(tiny_members, key):
    m = tiny_members[key]
    state = m.prefill(m.prompt_ids("Question: what is two plus two? Answer:"))
    cands = [m.encode(" four"), m.encode(" It is 4, of course."), m.encode(" 5")]
    n_before = len(state.ids)
    got = m.score_inline(state, cands)
    assert len(state.ids) == n_before and state.cache.get_seq_length() == n_before
    for c, g in zip(cands, got):
        s2 = m.prefill(state.ids)
        lp = torch.cat([s2.next_logprobs[None], m.extend(s2, c)[:-1]])
        want = lp.gather(1, torch.tensor(c)[:, None])[:, 0]
        assert torch.allclose(g, want, atol=1e-4)
    # the cache is intact afterwards
    nxt = m.encode(" ok")
    fresh = m.prefill(state.ids + nxt)
    m.extend(state, nxt)
    assert torch.allclose(state.next_logprobs, fresh.next_logprobs, atol=1e-4)


def test_forward_counters(tiny_members):
    m = tiny_members["smol"]
    n0 = m.n_forward
    st = m.prefill([1, 2, 3])
    m.extend(st, [4])
    assert m.n_forward == n0 + 2 and m.forward_time > 0


def test_members_loaded_at_once_hold_their_saved_weights(tiny_dirs):
    """Ensemble loads its members in threads (loader.load_members); transformers' loads must not
    overlap (its weight-initialisation switch is process-wide): each member's weights are the ones
    saved, as a member loaded alone has them."""
    from ensemble_llm.members.loader import clear_cache, load_member, load_members
    from ensemble_llm.members.options import MemberOptions

    folders = [tiny_dirs["smol"], tiny_dirs["gemma"], tiny_dirs["smol_short"]]
    opts = [MemberOptions(backend="transformers")] * 3
    alone = []
    for f, o in zip(folders, opts):
        clear_cache()
        alone.append(load_member(f, device="cpu", dtype="float32", progress=False, options=o))
    for _ in range(3):
        clear_cache()
        together = load_members(folders, ["cpu"] * 3, ["float32"] * 3, opts, False)
        for a, b in zip(alone, together):
            assert a is not b
            for (name, x), y in zip(a.model.state_dict().items(), b.model.state_dict().values()):
                assert torch.equal(x, y), name
    clear_cache()
