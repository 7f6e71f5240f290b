"""Prompt prefix reuse (members/prefix.py): a prompt that begins like a stored one starts from its
KV and runs only its rest, and gets what its full forward gives, alone, scored and in a batch."""

from __future__ import annotations

import contextlib

import pytest
import torch
from helpers import GEMMA, SMOL, flat

from ensemble_llm.errors import ConfigError
from ensemble_llm.members.backends.transformers.rowgroups import RowGroup, run_prefills, run_step
from ensemble_llm.members.prefix import ENV, MIN_TOKENS, PrefixCache, configured_bytes
from ensemble_llm.members.steps import BatchingConfig, Extend, Prefill


@contextlib.contextmanager
def prefixes(member, max_bytes):
    """The member's prefix cache emptied and bounded at max_bytes inside the block (0: off)."""
    cache, member.prefixes = member.prefixes, PrefixCache(max_bytes)
    try:
        yield member.prefixes
    finally:
        member.prefixes = cache


@contextlib.contextmanager
def forward_lengths(member):
    """The token count of every forward the member's model runs inside the block (its decoder's:
    a batched step may run the decoder alone and the output layer on the columns it reads)."""
    member.head_splits()  # settled before the block: its check runs forwards of its own
    seen, model = [], member.model.get_decoder()
    hook = model.register_forward_pre_hook(
        lambda mod, args, kw: seen.append(kw["input_ids"].shape[1]), with_kwargs=True
    )
    try:
        yield seen
    finally:
        hook.remove()


def _ids(n, seed):
    return torch.randint(10, 1000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _reference(member, ids, positions=None):
    """The prompt's own full forward (reuse off): its state, and its scores with `positions`."""
    with prefixes(member, 0):
        state = member.new_state()
        got = member.run_prompt(state, ids, positions)
    return state, got


@pytest.mark.parametrize("key", ["smol", "gemma"])  # gemma: sliding-window layers (window 8)
def test_a_prompt_that_begins_like_a_stored_one_runs_only_its_rest(tiny_members, key):
    m = tiny_members[key]
    a = _ids(30, 1)
    b = a[:24] + _ids(6, 2)
    ref, _ = _reference(m, b)
    with prefixes(m, 2**30) as cache:
        m.prefill(a)
        with forward_lengths(m) as seen:
            st = m.prefill(b)
        assert seen == [6] and cache.hits == 1 and cache.reused == 24
        assert st.ids == b
        torch.testing.assert_close(st.next_logprobs, ref.next_logprobs, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(m.kv_tensor(st), m.kv_tensor(ref), atol=1e-5, rtol=1e-5)
        for k in range(12):  # past Gemma's window: the stored columns are attended like its own
            m.extend(st, [300 + k])
            m.extend(ref, [300 + k])
            torch.testing.assert_close(st.next_logprobs, ref.next_logprobs, atol=1e-4, rtol=1e-4)
        with forward_lengths(m) as seen:
            again = m.prefill(b)  # the same prompt again: its last token runs, for its next row
        assert seen == [1]
        torch.testing.assert_close(again.next_logprobs, m.prefill(b).next_logprobs, atol=1e-5, rtol=1e-5)


def test_a_short_common_beginning_or_an_empty_cache_runs_the_whole_prompt(tiny_members):
    m = tiny_members["smol"]
    a = _ids(30, 3)
    with prefixes(m, 2**30) as cache:
        with forward_lengths(m) as seen:
            m.prefill(a)
            m.prefill(a[: MIN_TOKENS - 1] + _ids(20, 4))  # shares fewer than MIN_TOKENS
        assert seen == [30, MIN_TOKENS - 1 + 20] and cache.hits == 0
    with prefixes(m, 0) as cache:  # off: nothing is kept
        m.prefill(a)
        with forward_lengths(m) as seen:
            m.prefill(a)
        assert seen == [30] and len(cache) == 0


@pytest.mark.parametrize("key", ["smol", "gemma"])
def test_scores_inside_the_common_beginning_are_read_and_the_rest_scored(tiny_members, key):
    """score_prompt (per-request weights) after a prompt with the same shots: the positions inside
    the common beginning come from the stored scores, the others from the rest's forward; a
    position the stored prompt did not score makes the reuse stop just before it."""
    m = tiny_members[key]
    a = _ids(40, 5)
    b = a[:32] + _ids(8, 6)
    pos_a = [3, 4, 10, 11, 12, 20, 31]
    pos_b = [3, 4, 10, 11, 12, 20, 31, 33, 36, 39]
    _, want = _reference(m, b, pos_b)
    with prefixes(m, 2**30) as cache:
        m.score_prompt(a, pos_a)
        m.forget_prompt(a)
        with forward_lengths(m) as seen:
            got = m.score_prompt(b, pos_b)
        assert seen == [8] and cache.reused == 32
        assert flat(got) == pytest.approx(flat(want), abs=1e-4)
        m.forget_prompt(b)
        c = a[:32] + _ids(8, 7)
        _, want_c = _reference(m, c, [3, 15, 35])
        with forward_lengths(m) as seen:
            got_c = m.score_prompt(c, [3, 15, 35])  # 15: scored by neither stored prompt
        assert seen == [40 - 14] and cache.reused == 32 + 14
        assert flat(got_c) == pytest.approx(flat(want_c), abs=1e-4)
        m.forget_prompt(c)


@pytest.mark.parametrize("key", ["smol", "gemma"])
def test_a_prompt_batch_with_stored_beginnings_matches_each_prompts_own_forward(tiny_members, key):
    """run_prefills (concurrent requests' prompts): two prompts that begin like a stored one run
    their rests as one step of a new group, beside a fresh prompt's left-padded forward and a
    scored one; each gets its own full forward's answer, and the groups step on like own caches."""
    m = tiny_members[key]
    a = _ids(30, 8)
    prompts = [a[:20] + _ids(5, 9), a[:26] + _ids(3, 10), _ids(17, 11), a[:28] + _ids(4, 12)]
    positions = [None, None, None, [2, 9, 21, 29, 31]]
    want = [_reference(m, p, q) for p, q in zip(prompts, positions)]
    with prefixes(m, 2**30) as cache:
        m.score_prompt(a, [2, 9, 21])
        m.forget_prompt(a)
        states = [m.new_state() for _ in prompts]
        calls = [Prefill(m, s, ids=p, positions=q) for s, p, q in zip(states, prompts, positions)]
        with forward_lengths(m) as seen:
            run_prefills(m, calls, BatchingConfig())
        assert cache.hits == 3 and sorted(seen) == [5, 17]  # the fresh prompt alone; the rests (5, 3, 4) in one step
        assert isinstance(states[0].group, RowGroup) and states[0].group is states[1].group is states[3].group
        for c, s, (ref, got) in zip(calls, states, want):
            assert s.ids == c.ids
            torch.testing.assert_close(s.next_logprobs, ref.next_logprobs, atol=1e-4, rtol=1e-4)
            if c.positions is not None:
                assert flat(c.result) == pytest.approx(flat(got), abs=1e-4)
        for k in range(10):  # past Gemma's window, all four in one group
            run_step(m, [Extend(m, s, tokens=[200 + k]) for s in states], BatchingConfig())
            for ref, _ in want:
                m.extend(ref, [200 + k])
            for s, (ref, _) in zip(states, want):
                torch.testing.assert_close(s.next_logprobs, ref.next_logprobs, atol=1e-4, rtol=1e-4)


def test_stored_kv_is_never_changed_by_the_requests_that_start_from_it(tiny_members):
    m = tiny_members["smol"]
    a = _ids(24, 13)
    with prefixes(m, 2**30) as cache:
        m.prefill(a)
        (entry,) = cache._entries.values()
        before = [(k.clone(), v.clone()) for k, v in entry.kv]
        st = m.prefill(a[:20] + _ids(6, 14))
        m.extend(st, [5, 6, 7])
        m.crop(st, 12)
        m.extend(st, [8])
        group_states = [m.prefill(a[:22] + _ids(3, 15 + i)) for i in range(2)]
        run_step(m, [Extend(m, s, tokens=[9]) for s in group_states], BatchingConfig())
        for (k, v), (k0, v0) in zip(entry.kv, before):
            assert torch.equal(k, k0) and torch.equal(v, v0)


def test_the_bound_keeps_the_latest_and_a_longer_prompt_replaces_its_beginning(tiny_members):
    m = tiny_members["smol"]
    one = m.kv_per_token * 20  # bytes of a 20-token prompt
    with prefixes(m, int(2.5 * one)) as cache:
        p1, p2, p3 = _ids(20, 16), _ids(20, 17), _ids(20, 18)
        for p in (p1, p2, p3):
            m.prefill(p)
        assert [len(e.ids) for e in cache._entries.values()] == [20, 20] and cache.bytes <= cache.max_bytes
        assert p1 not in [list(e.ids) for e in cache._entries.values()]  # the least recently used went
        m.score_prompt(p3, [5])  # p3 again, scored: replaces the stored p3, with its score
        m.forget_prompt(p3)
        longer = p2 + _ids(4, 19)
        m.prefill(longer)  # begins with p2: p2's entry goes
        keys = [list(e.ids) for e in cache._entries.values()]
        assert p2 not in keys and longer in keys and p3 in keys
    with prefixes(m, one // 2) as cache:  # a prompt larger than the whole bound is not kept
        m.prefill(p1)
        assert len(cache) == 0


def test_the_bound_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv(ENV, "1MiB")
    assert configured_bytes() == 2**20
    monkeypatch.setenv(ENV, "0")
    assert configured_bytes() == 0
    monkeypatch.setenv(ENV, "123")
    assert configured_bytes() == 123
    monkeypatch.setenv(ENV, "lots")
    with pytest.raises(ConfigError, match=ENV):
        configured_bytes()


@pytest.mark.parametrize("method", ["unite", "specfuse"])
def test_chat_requests_on_the_bundled_pair_get_their_texts_from_stored_beginnings(real_dirs, method):
    """The bundled pair, chat requests one by one and then four at once: the system prompt and
    Gemma-3's preamble are stored once and every later prompt starts from them; the texts are
    those of the full prompts' forwards (reuse off)."""
    from ensemble_llm import Ensemble

    eng = Ensemble([str(real_dirs[SMOL]), str(real_dirs[GEMMA])], method).load()
    prompts = ["What is the capital of France?", "Name a primary colour.", "What is 3 + 4?", "Say hello."]
    ask = dict(max_new_tokens=12, temperature=0)
    with contextlib.ExitStack() as off:
        for m in eng.members:
            off.enter_context(prefixes(m, 0))
        want = [eng.generate(p, **ask).text for p in prompts]
    with contextlib.ExitStack() as on:
        caches = [on.enter_context(prefixes(m, 2**30)) for m in eng.members]
        alone = [eng.generate(p, **ask).text for p in prompts]
        together = [r.text for r in eng.generate_many(prompts, **ask)]
    assert alone == want and together == want
    assert all(c.hits >= 2 * len(prompts) - 1 for c in caches)
    assert caches[1].reused >= 80 * (2 * len(prompts) - 1)  # Gemma-3's preamble: about 89 tokens each


def test_a_request_reports_its_reused_prompt_tokens_in_usage_and_stats(tiny_dirs):
    """usage.cached_tokens (OpenAI's prompt_tokens_details.cached_tokens): the main member's
    prompt tokens that came from a stored prompt; stats: every member's prompt_tokens_reused."""
    from ensemble_llm import Ensemble

    eng = Ensemble([tiny_dirs["smol"], tiny_dirs["gemma"]], "unite").load()
    with contextlib.ExitStack() as stack:
        for m in eng.members:
            stack.enter_context(prefixes(m, 2**30))
        first = eng.generate("Name a colour.", max_new_tokens=3)
        again = eng.generate("Name a colour.", max_new_tokens=3)
    main = again.stats["main_member"]
    assert first.usage.cached_tokens == 0 and first.usage.to_dict()["prompt_tokens_details"] == {"cached_tokens": 0}
    assert again.usage.cached_tokens == again.usage.prompt_tokens - 1
    assert again.stats["members"][main]["prompt_tokens_reused"] == again.usage.cached_tokens
    assert all(st["prompt_tokens_reused"] > 0 for st in again.stats["members"].values())
    assert all(st["prompt_tokens_reused"] == 0 for st in first.stats["members"].values())
