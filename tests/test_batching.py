"""Continuous batching across concurrent requests (members/scheduler.py, the transformers executor
in members/backends/transformers/rowgroups.py): a batched step computes what each row's own forward computes, and
concurrent requests get the texts they get alone."""

from __future__ import annotations

import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from helpers import TINY_METHODS, flat, tiny_pair_for

from ensemble_llm import Ensemble
from ensemble_llm.errors import ConfigError, RequestCancelled
from ensemble_llm.members.backends.transformers import rowgroups
from ensemble_llm.members.backends.transformers.rowgroups import RowGroup, run_prefills
from ensemble_llm.members.backends.transformers.rowgroups import run_step as _run_step
from ensemble_llm.members.context import RequestContext, request_scope
from ensemble_llm.members.scheduler import StepScheduler
from ensemble_llm.members.steps import BatchingConfig, Extend, Prefill, Score

CONFIG = BatchingConfig()


def run_step(member, calls, config=None):
    _run_step(member, calls, config or CONFIG)


def _ext(m, state, token, last_only=False):
    return Extend(m, state, tokens=[token] if isinstance(token, int) else list(token), last_only=last_only)


PROMPTS = ["The capital of France is", "Write a haiku about rain.", "2+2=", "List three colors:", "Once upon a"]


def _state(member, n, seed):
    g = torch.Generator().manual_seed(seed)
    return member.prefill(torch.randint(10, 1000, (n,), generator=g).tolist())


def _copy(member, state):
    return member.prefill(list(state.ids))


def _grouped(member, lengths):
    """States of these prompt lengths stepped once into one group, and their copies stepped alone."""
    states = [_state(member, n, i) for i, n in enumerate(lengths)]
    alone = [_copy(member, s) for s in states]
    run_step(member, [_ext(member, s, 5 + i) for i, s in enumerate(states)])
    for i, a in enumerate(alone):
        member.extend(a, [5 + i])
    return states, alone, states[0].group


@pytest.mark.parametrize("key", ["smol", "gemma"])  # gemma: sliding-window layers (window 8)
def test_prompts_prefilled_together_match_their_own_prefills_and_step_on(tiny_members, key):
    """Prompts of 5, 19 and 12 tokens in one left-padded forward: each state gets its own prefill's
    log-probs and KV, as the rows of a group that the next steps use without a copy."""
    m = tiny_members[key]
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(10, 1000, (n,), generator=g).tolist() for n in (5, 19, 12)]
    states = [m.new_state() for _ in prompts]
    run_prefills(m, [Prefill(m, s, ids=p) for s, p in zip(states, prompts)], CONFIG)
    alone = [m.prefill(p) for p in prompts]
    group = states[0].group
    assert isinstance(group, RowGroup) and all(s.group is group for s in states)
    for s, a in zip(states, alone):
        assert s.ids == a.ids
        torch.testing.assert_close(s.next_logprobs, a.next_logprobs, atol=1e-5, rtol=1e-5)
    for k in range(12):  # past the window
        run_step(m, [_ext(m, s, 100 + k + i) for i, s in enumerate(states)])
        for i, a in enumerate(alone):
            m.extend(a, [100 + k + i])
    assert all(s.group is group for s in states)
    for s, a in zip(states, alone):
        torch.testing.assert_close(s.next_logprobs, a.next_logprobs, atol=1e-5, rtol=1e-5)
        assert torch.allclose(m.kv_tensor(s), m.kv_tensor(a), atol=1e-5)


@pytest.mark.parametrize("key", ["smol", "gemma"])
def test_prompts_scored_together_match_their_own_scoring_and_step_on(tiny_members, key):
    """score_prompt (per-request weights) in a prompt batch beside a plain prompt: each scored
    row gets its own scoring forward's log-probs at its own positions, every state its own
    prefill's next row, and the group steps on like their own caches."""
    m = tiny_members[key]
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(10, 1000, (n,), generator=g).tolist() for n in (7, 19, 12)]
    positions = [[1, 4, 6], [2, 9, 17, 18], None]  # the last: a plain prompt beside them
    assert m.head_splits()
    alone, want = [m.new_state() for _ in prompts], []
    for a, p, q in zip(alone, prompts, positions):
        if q is None:
            m.run_extend(a, p, last_only=True)
        want.append(m.run_prompt(a, p, q) if q is not None else None)
    states = [m.new_state() for _ in prompts]
    calls = [Prefill(m, s, ids=p, positions=q) for s, p, q in zip(states, prompts, positions)]
    run_prefills(m, calls, CONFIG)
    for c, w in zip(calls, want):
        if w is not None:
            assert flat(c.result) == pytest.approx(flat(w), abs=1e-4)
    for k in range(10):  # past Gemma's window
        for s, a in zip(states, alone):
            torch.testing.assert_close(s.next_logprobs, a.next_logprobs, atol=1e-4, rtol=1e-4)
        run_step(m, [_ext(m, s, 200 + k) for s in states])
        for a in alone:
            m.extend(a, [200 + k])
    assert all(s.group is states[0].group for s in states)


@pytest.mark.parametrize("key", ["smol", "gemma"])
def test_steps_of_several_tokens_per_row_match_each_rows_own_extends(tiny_members, key, split):
    """Extends of 3, 1 and 0 tokens in one step (safe's verifications beside one-token steps): each
    row gets its own extend's log-probs for every new token (or the last with last_only)."""
    m = tiny_members[key]
    states, alone, group = _grouped(m, (6, 11, 9))
    plan = [[(0, [7, 8, 9], False), (1, [10], False)], [(1, [11, 12], True), (2, [13, 14, 15, 16], False)]]
    plan += [[(0, [17 + k], False), (1, [18, 19, 20][: 1 + k % 3], k % 2 == 0), (2, [21], False)] for k in range(8)]
    for calls in plan:
        batch = [_ext(m, states[i], toks, last_only=last) for i, toks, last in calls]
        run_step(m, batch)
        for c, (i, toks, last) in zip(batch, calls):
            want = m.extend(alone[i], toks, last_only=last)
            assert states[i].ids == alone[i].ids and c.result.shape == want.shape
            torch.testing.assert_close(c.result, want, atol=1e-5, rtol=1e-5)
    assert all(s.group is group for s in states)  # no copy: the same group all along
    for s, a in zip(states, alone):
        assert torch.allclose(m.kv_tensor(s), m.kv_tensor(a), atol=1e-5)


@pytest.fixture(params=["as set", "always"])
def split(request, monkeypatch):
    """RowGroup.step as it runs ("as set": split_columns 16) and with every step split ("always": the
    one-token calls in a forward apart from longer ones, each forward over its own rows only)."""
    if request.param == "always":
        monkeypatch.setattr(sys.modules[__name__], "CONFIG", BatchingConfig(split_columns=0))
    return request.param


@pytest.mark.parametrize("key", ["smol", "gemma"])  # gemma: sliding-window layers (window 8)
def test_inline_scoring_in_a_step_matches_each_rows_own_scoring(tiny_members, key, split, monkeypatch):
    """specfuse's score_inline joined to a step beside a plain extend: each row's candidates get the
    logits of that row's own scoring forward; keeping one candidate (or none) leaves the row as its
    own cache would be, and the steps after it match too, in the same group. The output layer runs
    only on the 13 columns the calls read (5 + 7 candidates' tokens, the extend's 1), not on the
    3 rows x 7 columns of the step; split, the extend's row runs one column and the scoring rows 7."""
    m = tiny_members[key]
    states, alone, group = _grouped(m, (7, 12, 10))
    cands = {0: [[21, 22, 23], [24, 25]], 2: [[26], [27, 28, 29, 30], [31, 32]]}
    calls = [Score(m, states[i], cands=c) for i, c in cands.items()] + [_ext(m, states[1], 40)]
    heads, head, shapes, forward = [], m.head, [], m.forward
    assert m.head_splits()  # (checked once per member, with a head of its own)
    monkeypatch.setattr(m, "head", lambda h: heads.append(tuple(h.shape[:-1])) or head(h))
    monkeypatch.setattr(m, "forward", lambda *a, **kw: shapes.append(kw["input_ids"].shape) or forward(*a, **kw))
    run_step(m, calls)
    monkeypatch.delattr(m, "head")
    monkeypatch.delattr(m, "forward")
    if split == "always":
        assert list(map(tuple, shapes)) == [(1, 1), (2, 7)] and heads == [(12,)]  # the extend: its logits as they are
    else:
        assert list(map(tuple, shapes)) == [(3, 7)] and heads == [(13,)]
    m.extend(alone[1], [40])
    wants = {}
    for c, (i, cs) in zip(calls, cands.items()):
        want = wants[i] = m.run_score(alone[i], cs)
        torch.testing.assert_close(c.result.float(), want.float(), atol=1e-4, rtol=1e-4)
        got, ref = m.scored(states[i], cs, c.result, False, True), m.scored(alone[i], cs, want, False, True)
        logp = torch.log_softmax(want.float(), dim=-1)  # each candidate's token log-probs, row by row
        for cand, g, r, s in zip(cs, got, ref, [sum(len(x) for x in cs[:k]) for k in range(len(cs))]):
            rows = torch.cat([alone[i].next_logprobs[None], logp[s : s + len(cand) - 1]])
            torch.testing.assert_close(r, rows.gather(1, torch.tensor(cand)[:, None])[:, 0], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(g, r, atol=1e-4, rtol=1e-4)
        assert states[i].scored[3].shape == (len(cs), want.shape[-1])  # a row per candidate is kept, not the logits
    m.keep_candidate(states[0], 1)  # the second candidate becomes the continuation
    m.keep_candidate(alone[0], 1)
    m.drop_candidates(states[2])
    m.drop_candidates(alone[2])
    assert states[0].ids == alone[0].ids and states[2].ids == alone[2].ids
    torch.testing.assert_close(states[0].next_logprobs, alone[0].next_logprobs, atol=1e-4, rtol=1e-4)
    after = torch.log_softmax(wants[0][3 + 2 - 1].float(), dim=-1)  # the kept candidate's last row
    torch.testing.assert_close(alone[0].next_logprobs, after, atol=1e-5, rtol=1e-5)
    for k in range(10):  # past gemma's window, all three in the group
        run_step(m, [_ext(m, s, 60 + k + i) for i, s in enumerate(states)])
        for i, a in enumerate(alone):
            m.extend(a, [60 + k + i])
    assert all(s.group is group for s in states)
    for s, a in zip(states, alone):
        assert s.ids == a.ids
        torch.testing.assert_close(s.next_logprobs, a.next_logprobs, atol=1e-4, rtol=1e-4)
        assert torch.allclose(m.kv_tensor(s), m.kv_tensor(a), atol=1e-4)


@pytest.mark.parametrize("key", ["smol", "gemma"])  # gemma: sliding-window layers (window 8)
def test_steps_in_a_group_match_each_rows_own_forwards(tiny_members, key, split):
    m = tiny_members[key]
    states = [_state(m, n, i) for i, n in enumerate((5, 13, 9))]
    alone = [_copy(m, s) for s in states]

    def step(pairs):  # [(index, token)] batched, and the same one by one on the copies
        run_step(m, [_ext(m, states[i], t) for i, t in pairs])
        for i, t in pairs:
            m.extend(alone[i], [t])
            assert states[i].ids == alone[i].ids
            torch.testing.assert_close(states[i].next_logprobs, alone[i].next_logprobs, atol=1e-5, rtol=1e-5)

    step([(0, 11), (1, 12), (2, 13)])
    group = states[0].group
    assert isinstance(group, RowGroup) and all(s.group is group for s in states)
    for k in range(10):  # past the window; row 2 sits some steps out (hole columns)
        step([(0, 20 + k), (1, 30 + k)] + ([(2, 40 + k)] if k % 3 else []))
    assert states[0].group is group
    m.crop(states[1], len(states[1].ids) - 4)  # a rollback inside the group: holes, no copy
    m.crop(alone[1], len(alone[1].ids) - 4)
    assert states[1].group is group
    m.ensure_next(states[1])  # no other request runs here: it leaves the group and recomputes alone
    m.ensure_next(alone[1])
    torch.testing.assert_close(states[1].next_logprobs, alone[1].next_logprobs, atol=1e-5, rtol=1e-5)
    assert states[1].group is None
    step([(0, 50), (2, 51)])
    m.extend(states[2], [1, 2, 3])  # a multi-token extend takes the row out, its cache intact
    m.extend(alone[2], [1, 2, 3])
    torch.testing.assert_close(states[2].next_logprobs, alone[2].next_logprobs, atol=1e-5, rtol=1e-5)
    assert torch.allclose(m.kv_tensor(states[0]), m.kv_tensor(alone[0]), atol=1e-5)


@pytest.mark.parametrize("key", ["smol", "gemma"])
def test_trees_of_several_requests_in_one_forward_match_each_tree_alone(tiny_members, key):
    """smc's forward_rows: two requests' context trees in one forward give each tree's own rows."""
    m = tiny_members[key]
    trees = []
    for i, n in enumerate((6, 11)):
        prefix = m.kv_tensor(_state(m, n, i))
        _, kids = m.forward_rows(prefix, [[], []], [5 + i, 6 + i])  # two children of the prefix
        trees.append((prefix, [[kids[0]], [kids[0]], [kids[1]]], [7, 8, 9 + i]))
    together = m.rows_many(trees)
    for tree, (logits, slices) in zip(trees, together):
        alone_logits, alone_slices = m.forward_rows(*tree)
        torch.testing.assert_close(logits, alone_logits, atol=1e-4, rtol=1e-4)
        for a, b in zip(slices, alone_slices):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_a_worn_group_is_rebuilt_from_its_live_rows(tiny_members):
    m = tiny_members["smol"]
    states = [_state(m, n, i) for i, n in enumerate((4, 6))]
    run_step(m, [_ext(m, s, 5) for s in states])
    first = states[0].group
    for k in range(90):  # both rows rolled back after every step: the holes widen the group
        run_step(m, [_ext(m, s, 7 + k) for s in states])
        assert states[0].group is not None
        m.crop(states[0], 5)
        m.crop(states[1], 7)
    assert states[0].group is not first  # rebuilt once wider than twice its longest row + slack
    run_step(m, [_ext(m, s, 3) for s in states])
    for s in states:
        alone = m.prefill(list(s.ids))
        torch.testing.assert_close(s.next_logprobs, alone.next_logprobs, atol=1e-5, rtol=1e-5)


def test_a_finished_requests_row_is_freed_at_the_next_step(tiny_members):
    """A dead row (its request finished) leaves the group's tensors before the next step, the other
    rows moving up without leaving the group: what the KV budget's bound counts on."""
    m = tiny_members["smol"]
    states = [_state(m, n, i) for i, n in enumerate((4, 9, 6))]
    run_step(m, [_ext(m, s, 5) for s in states])
    group = states[0].group
    del states[1]  # its request finished: nothing refers to the state any more
    run_step(m, [_ext(m, s, 8) for s in states])
    assert all(s.group is group for s in states) and [s.row for s in states] == [0, 1]
    assert all(layer.keys.shape[0] == 2 for layer in group.cache.layers) and group.valid.shape[0] == 2
    for s in states:
        alone = m.prefill(list(s.ids))
        torch.testing.assert_close(s.next_logprobs, alone.next_logprobs, atol=1e-5, rtol=1e-5)
        assert torch.allclose(m.kv_tensor(s), m.kv_tensor(alone), atol=1e-5)


def test_a_request_cancelled_while_passed_over_leaves_at_once(tiny_members, monkeypatch):
    """A call waiting for its turn (another member's larger group keeps stepping) checks its
    request's guard while it waits: cancelled, it leaves the queue at once, its state untouched."""
    smol, gemma = tiny_members["smol"], tiny_members["gemma"]
    sched = StepScheduler(BatchingConfig(max_defer=10**6))
    busy_states = [_state(smol, 5, 0), _state(smol, 7, 1)]
    g = _state(gemma, 6, 2)
    before = list(g.ids)
    stop, cancel, out = threading.Event(), threading.Event(), {}

    def busy(s):
        ctx = RequestContext(scheduler=sched)
        with sched.request(ctx), request_scope(ctx):
            for _ in range(300):
                if stop.is_set():
                    return
                smol.extend(s, [11])

    def guard():
        if cancel.is_set():
            raise RequestCancelled("stopped")

    def lone():
        ctx = RequestContext(check=guard, scheduler=sched)
        with sched.request(ctx), request_scope(ctx):  # as the worker runs a request
            try:
                gemma.extend(g, [12])
                out["r"] = "ran"
            except RequestCancelled:
                out["r"] = "cancelled"

    workers = [threading.Thread(target=busy, args=(s,)) for s in busy_states]
    for t in workers:
        t.start()
    time.sleep(0.2)
    waiting = threading.Thread(target=lone)
    waiting.start()
    t0 = time.monotonic()
    while not any(c.state is g for c in sched._pending) and time.monotonic() - t0 < 10:
        time.sleep(0.002)
    cancel.set()
    waiting.join(timeout=10)
    left_first = not waiting.is_alive() and all(t.is_alive() for t in workers)  # not after the others
    stop.set()
    for t in workers:
        t.join(timeout=30)
    assert out.get("r") == "cancelled" and g.ids == before and left_first


METHODS = TINY_METHODS


@pytest.fixture(scope="module", params=METHODS, ids=[m for m, _ in METHODS])
def engines(request, tiny_dirs):
    method, config = request.param
    members = tiny_pair_for(method, tiny_dirs)
    one = Ensemble(members, method=method, config=config, max_batch=1).load()
    many = Ensemble(members, method=method, config=config, max_batch=4).load()
    return one, many


def test_concurrent_requests_get_their_sequential_texts(engines):
    """Five requests of different lengths on four slots: they leave the running batch at
    different steps, the fifth joins mid-way, and each gets the text it gets alone (greedy)."""
    one, many = engines
    jobs = [(p, 16 + 6 * i) for i, p in enumerate(PROMPTS)]
    alone = [one.generate(p, max_new_tokens=n, raw=True) for p, n in jobs]
    before = [m.n_forward for m in many.members]

    def run(i):
        return many.generate(jobs[i][0], max_new_tokens=jobs[i][1], raw=True)

    with ThreadPoolExecutor(len(jobs)) as pool:
        together = list(pool.map(run, range(len(jobs))))
    assert [r.text for r in together] == [r.text for r in alone]
    # each request's stats count the forwards it took part in, as when it ran alone
    for a, b in zip(alone, together):
        for name, st in a.stats["members"].items():
            assert b.stats["members"][name]["forward_passes"] == st["forward_passes"]
    m = many.members[0]  # tiny llama: 2 layers x 2 KV heads x head dim 8, keys and values, float32
    assert together[0].stats["members"][m.name]["kv_bytes_per_token"] == 2 * 2 * 2 * 8 * 4
    ran = sum(m.n_forward for m in many.members) - sum(before)
    took_part = sum(st["forward_passes"] for r in together for st in r.stats["members"].values())
    assert ran < took_part  # some forwards served several requests at once
    assert many.scheduler.idle


def test_cancelling_one_request_leaves_the_others_texts(tiny_dirs):
    members = [tiny_dirs["smol"], tiny_dirs["gemma"]]
    one = Ensemble(members, method="unite", config={"weights": None}, max_batch=1)
    many = Ensemble(members, method="unite", config={"weights": None}, max_batch=4)
    alone = [one.generate(p, max_new_tokens=24, raw=True).text for p in PROMPTS[:3]]
    streams = [many.stream(p, max_new_tokens=24, raw=True) for p in PROMPTS[:3]]
    it = iter(streams[1])
    next(it)  # it has started; the caller goes away
    it.close()
    texts = [None, None, None]

    def drain(i):
        texts[i] = "".join(streams[i])

    threads = [threading.Thread(target=drain, args=(i,)) for i in (0, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert texts[0] == alone[0] and texts[2] == alone[2]
    assert many.scheduler.idle
    assert many.generate(PROMPTS[1], max_new_tokens=24, raw=True).text == alone[1]  # the engine is usable


def test_a_requests_parts_join_the_steps_but_a_lone_request_does_not_batch():
    """specfuse's parallel drafts run in threads of their request (a part's context): the steps
    wait for them as for requests, but one request and its parts alone go straight to the member."""
    sched, seen = StepScheduler(), {}

    def part(key, ctx):
        with sched.request(ctx), request_scope(ctx):
            seen[key] = (sched.batching(ctx), sched._active)

    def parts(ctx):
        threads = [threading.Thread(target=part, args=(k, ctx.for_part())) for k in ("a", "b")]
        with sched.own_forward(ctx):  # the request waits for its parts
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        return {k: v[0] for k, v in seen.items()}

    entered, leave = threading.Event(), threading.Event()

    def other():
        ctx = RequestContext(scheduler=sched)
        with sched.request(ctx):
            entered.set()
            leave.wait(10)

    main = RequestContext(scheduler=sched)
    with sched.request(main):
        lone = parts(main)
        t = threading.Thread(target=other)
        t.start()
        entered.wait(10)
        together = parts(main)
        leave.set()
        t.join()
    assert lone == {"a": False, "b": False} and together == {"a": True, "b": True}
    assert seen["a"][1] >= 3 and sched.idle and sched._requests == 0


def test_two_engines_in_one_process_step_apart(tiny_dirs):
    """Each engine owns its scheduler: two engines over the same loaded members, each with
    requests running at once, never put each other's calls in a step, and each gets its texts."""
    members = [tiny_dirs["smol"], tiny_dirs["gemma"]]
    a = Ensemble(members, method="unite", config={"weights": None}, max_batch=4).load()
    b = Ensemble(members, method="unite", config={"weights": None}, max_batch=4).load()
    assert a.scheduler is not b.scheduler and all(x is y for x, y in zip(a.members, b.members))
    alone = [a.generate(p, max_new_tokens=10, raw=True).text for p in PROMPTS[:4]]
    seen: list[set] = []
    run = rowgroups.RowGroupExecutor.run

    def spy(self, calls, config):  # which engine's requests each step holds
        seen.append({id(c.tally) for c in calls})
        return run(self, calls, config)

    rowgroups.RowGroupExecutor.run = spy
    try:
        with ThreadPoolExecutor(4) as pool:
            futs = [
                pool.submit((a if i % 2 else b).generate, p, max_new_tokens=10, raw=True)
                for i, p in enumerate(PROMPTS[:4])
            ]
            texts = [f.result().text for f in futs]
    finally:
        rowgroups.RowGroupExecutor.run = run
    assert texts == alone and a.scheduler.steps > 0 and b.scheduler.steps > 0
    assert all(len(step) <= 2 for step in seen)  # two requests per engine: a step holds one engine's


def test_max_batch_is_checked():
    with pytest.raises(ConfigError, match="max_batch"):
        Ensemble(["smollm2-135m-instruct"], max_batch=0)
    with pytest.raises(ConfigError, match="max_batch"):
        Ensemble(["smollm2-135m-instruct"], max_batch="many")
    assert Ensemble(["smollm2-135m-instruct"], device="cpu").max_batch == 8


def _forwards(engine):
    return sum(m.n_forward for m in engine.members)


def test_generate_many_and_the_framework_batch_paths_decode_together(tiny_dirs):
    """`generate_many`, LangChain's `batch`/`abatch` and LlamaIndex's `acomplete` under
    `asyncio.gather` run their requests at once: the texts of one at a time, fewer forwards."""
    import asyncio

    from langchain_ensemble_llm import EnsembleLLM as ChatEnsemble
    from llama_index.llms.ensemble_llm import EnsembleLLM as IndexEnsemble

    members, cfg = [tiny_dirs["smol"], tiny_dirs["gemma"]], {"weights": None}
    one = Ensemble(members, method="unite", config=cfg, max_batch=1)
    many = Ensemble(members, method="unite", config=cfg, max_batch=4)
    alone = [one.generate(p, max_new_tokens=12) for p in PROMPTS[:4]]
    n0 = _forwards(many)
    results = many.generate_many(PROMPTS[:4], max_new_tokens=12)
    assert [r.text for r in results] == [r.text for r in alone]
    took_part = sum(st["forward_passes"] for r in results for st in r.stats["members"].values())
    assert _forwards(many) - n0 < took_part

    chat, chat_one = ChatEnsemble(engine=many, max_tokens=12), ChatEnsemble(engine=one, max_tokens=12)
    expect = [chat_one.invoke(p).content for p in PROMPTS[:4]]
    n0 = _forwards(many)
    assert [m.content for m in chat.batch(PROMPTS[:4])] == expect
    assert [m.content for m in asyncio.run(chat.abatch(PROMPTS[:4]))] == expect
    assert _forwards(many) - n0 < 2 * took_part

    index, index_one = IndexEnsemble(engine=many, max_new_tokens=12), IndexEnsemble(engine=one, max_new_tokens=12)
    expect = [index_one.complete(p).text for p in PROMPTS[:4]]

    async def gather():
        return await asyncio.gather(*(index.acomplete(p) for p in PROMPTS[:4]))

    n0 = _forwards(many)
    assert [r.text for r in asyncio.run(gather())] == expect
    assert _forwards(many) - n0 < took_part


def test_cache_of_holds_the_tensors_it_is_given():
    """A group's rebuild, a release and a gather wrap the KV they copied, without a second copy."""
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(2, 3, 6, 4, generator=g), torch.randn(2, 3, 6, 4, generator=g)) for _ in range(3)]
    cache = rowgroups.cache_of(data)
    assert cache.get_seq_length() == 6 and len(cache.layers) == 3
    for layer, (k, v) in zip(cache.layers, data):
        assert layer.keys is k and layer.values is v
    new = torch.randn(2, 3, 1, 4, generator=g)
    keys, _ = cache.layers[0].update(new, new)  # and grows as a DynamicCache does
    assert torch.equal(keys, torch.cat([data[0][0], new], dim=2))


def test_a_call_that_fails_inside_a_batched_step_fails_only_its_own_request(tiny_dirs):
    """Four requests at once, one of whose calls makes every step it is in raise: that step's
    calls rerun one by one, so the three others get the texts they get alone and the fourth its
    error; then the engine answers again."""
    from ensemble_llm.errors import GenerationError

    members = [tiny_dirs["smol"], tiny_dirs["gemma"]]
    eng = Ensemble(members, method="unite", config={"weights": None}, max_batch=4).load()
    alone = [eng.generate(p, max_new_tokens=12, raw=True).text for p in PROMPTS[:4]]
    bad = {tuple(m.prompt_ids(PROMPTS[2])) for m in eng.members}
    poisoned: set[int] = set()
    run, failed = rowgroups.RowGroupExecutor.run, []

    def flaky(self, calls, config):
        for c in calls:
            if isinstance(c, Prefill) and tuple(c.ids) in bad:
                poisoned.add(id(c.tally))
        if any(id(c.tally) in poisoned for c in calls):
            failed.append(len(calls))
            raise RuntimeError("a call that breaks its step")
        return run(self, calls, config)

    rowgroups.RowGroupExecutor.run = flaky
    try:
        for _ in range(3):  # until the bad call shared a step: on a loaded machine the four may not overlap
            failed.clear()
            with ThreadPoolExecutor(4) as pool:
                futs = [pool.submit(eng.generate, p, max_new_tokens=12, raw=True) for p in PROMPTS[:4]]
                outcomes = []
                for f in futs:
                    try:
                        outcomes.append(f.result().text)
                    except GenerationError as exc:
                        outcomes.append(exc)
            assert [o for i, o in enumerate(outcomes) if i != 2] == [t for i, t in enumerate(alone) if i != 2]
            assert isinstance(outcomes[2], GenerationError) and "breaks its step" in str(outcomes[2])
            if max(failed) > 1:
                break
    finally:
        rowgroups.RowGroupExecutor.run = run
    assert max(failed) > 1  # it did fail steps shared with other requests
    assert eng.scheduler.idle and eng.generate(PROMPTS[2], max_new_tokens=12, raw=True).text == alone[2]
