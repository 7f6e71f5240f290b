"""Members on llama.cpp (members/backends/llama_cpp/member.py) on the real bundled GGUF files: a batched step, forks,
crops, candidates and trees give what the same calls give one at a time in a second context of
the same file (llama.cpp's results depend on where a sequence's cells sit, so each reference
replays the same calls in the same order: the cells land where they landed); the tokenizer check;
sizing; every method, a mixed pair, two engines apart."""

from __future__ import annotations

import threading

import pytest
import torch
from helpers import DEMONYM, GEMMA, RUSSIAN, SMOL, TINY_METHODS

from ensemble_llm import Ensemble
from ensemble_llm.errors import ConfigError, KVBudgetError
from ensemble_llm.members import load_member, member_options
from ensemble_llm.members.backends.llama_cpp.member import LlamaByteLM, LlamaMember, check_tokenizer
from ensemble_llm.members.loader import gguf_file, gguf_tokenizer, resolve_backend, resolve_source
from ensemble_llm.members.options import MemberOptions
from ensemble_llm.members.plan import gguf_params_and_config, kv_bytes_per_token
from ensemble_llm.members.prefix import configured_bytes
from ensemble_llm.members.steps import BatchingConfig, Extend, Prefill, Score

pytest.importorskip("llama_cpp")
CONFIG = BatchingConfig()
PROMPTS = ["The capital of France is", "Write a haiku about rain and the sea, please.", "2+2="]


def fresh(name: str, tokenizer=None) -> LlamaMember:
    """A llama.cpp member of a bundled model with a context of its own (not the process's cached one)."""
    src = resolve_source(name)
    path = gguf_file(src, progress=False)
    _, cfg = gguf_params_and_config(path)
    m = LlamaMember(
        name,
        str(path),
        tokenizer or gguf_tokenizer(src, path),
        n_ctx=4096,
        kv_per_token=kv_bytes_per_token(cfg, torch.float16),
        device=torch.device("cpu"),
    )
    m.prefixes.max_bytes = 0  # no stored prompts: the two contexts' histories stay alike
    return m


def batch_invariant(m: LlamaMember) -> bool:
    """Whether llama.cpp gives this file's tokens the same logits decoded 6 at once as one by one
    (its kernels for a batch of rows depend on the batch size for some weight types: Gemma-3's)."""
    a, b = m.new_state(), m.new_state()
    p = m.prompt_ids(PROMPTS[0])
    m.extend(a, p, last_only=True)
    m.extend(b, p, last_only=True)
    together = m.extend(a, list(range(600, 606)))
    alone = torch.cat([m.extend(b, [t]) for t in range(600, 606)])
    return bool((together - alone).abs().max() == 0)


def close(got: torch.Tensor, want: torch.Tensor, exact: bool) -> None:
    """Within 1e-4, or (llama.cpp's batch-size-dependent kernels) within 0.5 nat at the top tokens."""
    if exact:
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    else:
        assert (got - want).abs().max() < 0.5


@pytest.fixture(scope="module", params=[SMOL, GEMMA])
def pair(request):
    """Two contexts of one model: the one under test and the one that replays its calls one by one."""
    return fresh(request.param), fresh(request.param)


def test_a_batched_step_gives_each_call_what_it_gets_alone(pair):
    """Three requests' one-token extends in one llama_decode, step after step: each call's
    log-probs are those of the same calls one at a time (0 apart). A step that also carries a
    3-token extend gives it its own decode's rows up to llama.cpp's kernels, which depend on the
    batch's size (Gemma-3's Q4_K/Q6_K weights: 8 tokens of one sequence at once against one by one
    0.52 nat apart; SmolLM2's Q4_1: 0): the same top tokens."""
    a, b = pair
    ids = [a.prompt_ids(t) for t in PROMPTS]
    sa, sb = [a.prefill(p) for p in ids], [b.prefill(p) for p in ids]
    decodes = a.runner.decodes
    for k in range(8):
        mixed = k == 7
        plan = [[100 + k], [7, 8, 9] if mixed else [9 + k], [300 + k]]
        calls = [Extend(a, s, tokens=t) for s, t in zip(sa, plan)]
        a.executor.run(calls, CONFIG)
        for s, t, c in zip(sb, plan, calls):
            want = b.extend(s, t)
            assert c.result.shape == want.shape
            if not mixed:
                torch.testing.assert_close(c.result, want, atol=1e-4, rtol=0)
                continue
            top = torch.topk(want, 2, dim=-1).indices
            assert torch.equal(torch.topk(c.result, 2, dim=-1).indices[:, 0], top[:, 0])
    assert a.runner.decodes - decodes == 8  # one decode per step
    assert [s.ids for s in sa] == [s.ids for s in sb]


def test_prompts_decoded_together_give_their_own_prefills(pair):
    """Three prompts in one llama_decode, each at its own positions in its own sequence: the
    state's next row is its prompt's own prefill's (Gemma-3: up to llama.cpp's kernels for a batch
    of 30 tokens rather than 10, measured 0.72 nat apart at most; the same top token)."""
    a, b = pair
    exact = batch_invariant(fresh(a.name))
    ids = [a.prompt_ids(t) for t in PROMPTS]
    states = [a.new_state() for _ in ids]
    calls = [Prefill(a, s, ids=p) for s, p in zip(states, ids)]
    a.executor.run(calls, CONFIG)
    for s, p, c in zip(states, ids, calls):
        alone = b.prefill(p)
        assert s.ids == p and c.result.shape == (1, a.vocab_size)
        top = torch.topk(alone.next_logprobs, 5).indices
        assert torch.equal(torch.topk(s.next_logprobs, 5).indices[:1], top[:1])
        close(s.next_logprobs[top], alone.next_logprobs[top], exact)


def test_forks_candidates_and_crops_match_their_one_by_one_decodes(pair):
    """specfuse's candidates are forks of the state decoded in one llama_decode: each candidate's
    token log-probs are those of the same forks decoded one after another; keeping one makes its
    fork the state (what follows matches extending the reference by it); a crop gives what never
    extending gives."""
    a, b = pair
    exact = batch_invariant(fresh(a.name))
    p = a.prompt_ids(PROMPTS[0])
    sa, sb = a.prefill(p), b.prefill(p)
    cands = [[11, 12, 13], [14, 15], [16]]
    got = a.score_inline(sa, cands, keep=True)
    refs = []
    for c in cands:  # one fork at a time, each kept while the next runs: the cells land as in one decode
        call = Score(b, sb, cands=[c])
        b.executor.run([call], CONFIG)
        refs.append((call.result, sb.forks))
        rows = torch.cat([sb.next_logprobs[None], torch.log_softmax(call.result[:-1], dim=-1)])
        want = rows.gather(1, torch.tensor(c)[:, None])[:, 0]
        close(got[len(refs) - 1], want, exact)
    a.keep_candidate(sa, 1)
    assert sa.ids == p + cands[1] and sa.forks is None
    after = torch.log_softmax(refs[1][0][-1], dim=-1)
    close(sa.next_logprobs[torch.topk(after, 10).indices], after[torch.topk(after, 10).indices], exact)
    # a crop: extend three, roll back, extend one = extend that one
    x, y = a.prefill(a.prompt_ids(PROMPTS[1])), b.prefill(b.prompt_ids(PROMPTS[1]))
    n = len(x.ids)
    a.extend(x, [5, 6, 7])
    a.crop(x, n)
    assert x.next_logprobs is None and len(x.ids) == n
    torch.testing.assert_close(a.extend(x, [9]), b.extend(y, [9]), atol=1e-4, rtol=0)
    with a.scratch(x):  # a scratch extension leaves the state as it was, its next row untouched
        before = x.next_logprobs.clone()
        a.extend(x, [1, 2])
    assert x.ids == y.ids and torch.equal(x.next_logprobs, before)


def test_trees_of_two_requests_in_one_decode_match_each_alone(pair):
    """smc's byte LMs of two requests: their new contexts (forks of their parents' sequences) in one
    llama_decode give each byte LM the distributions it gets stepping alone, and compacting gives
    the sequences of the nodes no hypothesis stands on back."""
    from ensemble_llm.members.bytelm import next_logprobs_many

    a, b = pair
    exact = batch_invariant(fresh(a.name))
    lms_a = [LlamaByteLM(a, 3, 0.0, 1.0) for _ in range(2)]
    lms_b = [LlamaByteLM(b, 3, 0.0, 1.0) for _ in range(2)]
    texts = ["The capital of France is", "Name a colour:"]
    beams_a = [lm.start(a.prompt_ids(t)) for lm, t in zip(lms_a, texts)]
    beams_b = [lm.start(b.prompt_ids(t)) for lm, t in zip(lms_b, texts)]
    for step in b" Paris":
        outs = next_logprobs_many([(lm, [bm]) for lm, bm in zip(lms_a, beams_a)])
        for lm, bm, out in zip(lms_b, beams_b, outs):
            want = torch.as_tensor(lm.next_logprobs([bm]))
            top = torch.topk(want[0], 5).indices
            close(torch.as_tensor(out)[0, top], want[0, top], exact)
        beams_a = [lm.advance(bm, step) for lm, bm in zip(lms_a, beams_a)]
        beams_b = [lm.advance(bm, step) for lm, bm in zip(lms_b, beams_b)]
        for lm, bm in zip(lms_a + lms_b, beams_a + beams_b):
            lm.compact([bm])
    assert a.runner.seqs.in_use < 40  # compact gives the nodes' sequences back


def test_the_tokenizer_check_refuses_a_mismatch(tokenizers):
    """A llama.cpp member whose transformers tokenizer is not its file's is refused by name."""
    with pytest.raises(ConfigError, match="tokenizes"):
        check_tokenizer(fresh(SMOL, tokenizer=tokenizers[GEMMA]))
    check_tokenizer(fresh(SMOL))  # its own passes


def test_backend_choice_and_its_errors(tiny_dirs):
    assert resolve_backend(resolve_source(SMOL), MemberOptions()) == "llama.cpp"
    assert resolve_backend(resolve_source(SMOL), MemberOptions(backend="transformers")) == "transformers"
    assert resolve_backend(resolve_source(tiny_dirs["smol"]), MemberOptions()) == "transformers"
    with pytest.raises(ConfigError, match="runs GGUF files"):
        resolve_backend(resolve_source(tiny_dirs["smol"]), MemberOptions(backend="llama.cpp"))
    with pytest.raises(ConfigError, match="own quantization"):
        resolve_backend(resolve_source(SMOL), MemberOptions(backend="llama.cpp", quantization="int8"))
    with pytest.raises(ConfigError, match="backend="):
        member_options({"backend": "vllm"}, "m")
    m = load_member(SMOL, progress=False)
    assert isinstance(m, LlamaMember) and m.runner.n_ctx == 8 * 2048


def test_specfuse_drafts_side_by_side_on_a_cpu_pair_and_writes_what_it_writes_in_turn(monkeypatch):
    """On the CPU the llama.cpp pair drafts and scores in two threads, each decode on its share of
    the cores (one thread of two); the greedy texts are those of the members taking turns on every
    core, and a decode outside the drafts gets every core again."""
    from ensemble_llm.members.backends.llama_cpp.runner import LlamaRunner
    from ensemble_llm.methods.specfuse import _FuseRun

    engine = Ensemble([SMOL, GEMMA], method="specfuse")
    for m in engine.members:  # no stored prompts: each pass's cells sit where the other's sat (runner.py)
        m.prefixes.clear()
        monkeypatch.setattr(m.prefixes, "max_bytes", 0)
    threads = []
    set_threads = LlamaRunner.set_threads
    monkeypatch.setattr(LlamaRunner, "set_threads", lambda r, n: (threads.append(n), set_threads(r, n))[1])
    side_by_side = [engine.generate(p, max_new_tokens=24, raw=True).text for p in PROMPTS]
    assert 1 in threads and max(threads) == min(m.cores for m in engine.members) == 2
    monkeypatch.setattr(_FuseRun, "map", lambda run, fn, items: [fn(x) for x in items])
    threads.clear()
    in_turn = [engine.generate(p, max_new_tokens=24, raw=True).text for p in PROMPTS]
    assert in_turn == side_by_side and set(threads) == {2}
    assert all(not m._sharing for m in engine.members)


def test_a_file_llama_cpp_cannot_load_is_refused_with_its_reason(tmp_path):
    """The reason comes from llama.cpp's own error lines (its log callback drops them: they are
    read again from a second open of the failed file), and a later load still works."""
    from ensemble_llm.members.backends.llama_cpp.runner import LlamaRunner

    bad = tmp_path / "truncated.gguf"
    bad.write_bytes(gguf_file(resolve_source(SMOL), progress=False).read_bytes()[:4096])
    with pytest.raises(ConfigError, match=r"could not load .*truncated\.gguf \(.*failed to load model.*\); check"):
        LlamaRunner(str(bad), 256, 1, 0)
    assert fresh(SMOL).runner.n_vocab == 49152


def test_a_request_that_cannot_fit_the_context_is_refused_and_the_engine_answers():
    eng = Ensemble([SMOL], max_batch=1).load()  # a context of 2048 cells
    with pytest.raises(KVBudgetError, match="kv_budget"):
        eng.generate("Hello " * 1200, max_new_tokens=1500, raw=True)
    assert eng.generate("Hello", max_new_tokens=4).text


@pytest.mark.parametrize("method,config", TINY_METHODS, ids=[m for m, _ in TINY_METHODS])
def test_every_method_on_the_llama_pair_and_with_a_transformers_member(method, config, tiny_dirs):
    """Every method on the bundled pair on llama.cpp, and on a mixed pair (SmolLM2 on llama.cpp, a
    tiny transformers Gemma with the real tokenizer): texts, usage and per-member figures."""
    pairs = {"llama": [SMOL, GEMMA], "mixed": [SMOL, tiny_dirs["gemma"]]}
    if method == "single":
        pairs = {"llama": [SMOL]}
    for kind, members in pairs.items():
        eng = Ensemble(members, method, config, progress=False)
        res = eng.generate("What is the capital of France?", max_new_tokens=12)
        # (the tiny random Gemma may end the mixed pair's reply at once: then on EOS)
        assert res.usage.completion_tokens >= 1 or (kind == "mixed" and res.finish_reason == "stop"), (kind, res)
        forwards = {n: st["forward_passes"] for n, st in res.stats["members"].items()}
        assert all(v > 0 for v in forwards.values()) or res.stats.get("solo"), (kind, forwards)
        assert [type(m).__name__ for m in eng.members][0] == "LlamaMember"


def test_concurrent_requests_on_llama_members_share_decodes(tiny_dirs):
    """Four requests at once on the llama.cpp pair: every one answers, and each decode served
    several of them (fewer decodes ran than the requests took part in)."""
    eng = Ensemble([SMOL, GEMMA], "unite", {"weights": None}, max_batch=4, progress=False).load()
    ran0 = sum(m.n_forward for m in eng.members)
    results = eng.generate_many(PROMPTS + ["Name three rivers."], max_new_tokens=16)
    ran = sum(m.n_forward for m in eng.members) - ran0
    took_part = sum(st["forward_passes"] for r in results for st in r.stats["members"].values())
    assert all(r.text for r in results) and ran < 0.75 * took_part and eng.scheduler.idle


def test_cancelling_a_request_on_llama_members_frees_its_sequences():
    eng = Ensemble([SMOL], max_batch=2, progress=False).load()
    m = eng.members[0]
    before = m.runner.seqs.in_use
    stream = eng.stream("Tell me a long story about a cat.", max_new_tokens=200)
    it = iter(stream)
    next(it)
    it.close()
    done = threading.Event()
    threading.Thread(target=lambda: (eng.generate("Hi", max_new_tokens=4), done.set())).start()
    assert done.wait(60)
    import gc

    gc.collect()
    m.runner.seqs.flush()
    assert m.runner.seqs.in_use <= before + 2  # the stored prompts' forks at most


@pytest.mark.parametrize("method,config", TINY_METHODS, ids=[m for m, _ in TINY_METHODS])
def test_structured_output_and_forced_calls_on_llama_members(method, config):
    """Grammar constraints drive llama.cpp members as they drive transformers ones: schema-valid
    JSON and a valid forced tool call, every method, on the bundled pair."""
    import json

    import jsonschema
    from test_constraints import ADD, PERSON, WEATHER

    eng = Ensemble([SMOL] if method == "single" else [SMOL, GEMMA], method, config, progress=False)
    res = eng.generate(
        "Describe a user.",
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}},
        max_new_tokens=60,
    )
    assert res.finish_reason == "stop", res.text
    jsonschema.validate(json.loads(res.text), PERSON)
    res = eng.generate("Weather in Oslo for 2 days?", tools=[WEATHER, ADD], tool_choice="required", max_new_tokens=60)
    assert res.finish_reason == "tool_calls", res.raw_text
    (call,) = res.tool_calls
    jsonschema.validate(call.arguments, {"get_weather": WEATHER, "add": ADD}[call.name]["function"]["parameters"])


def test_the_facades_and_serve_on_llama_members():
    """LangChain's and LlamaIndex's EnsembleLLM and a real `ensemble-llm serve` process with the
    openai client, all on the bundled pair on llama.cpp: the same greedy answer."""
    import openai
    from helpers import start_server
    from langchain_ensemble_llm import EnsembleLLM as ChatEnsemble
    from llama_index.llms.ensemble_llm import EnsembleLLM as IndexEnsemble

    eng = Ensemble([SMOL, GEMMA], "safe", progress=False).load()
    assert all(isinstance(m, LlamaMember) for m in eng.members)
    want = eng.generate("What is the capital of France?", max_new_tokens=16).text
    assert ChatEnsemble(engine=eng, max_tokens=16).invoke("What is the capital of France?").content == want
    assert IndexEnsemble(engine=eng, max_new_tokens=16).complete("What is the capital of France?").text == want
    proc, base = start_server([SMOL, GEMMA], "safe")
    try:
        client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
        model = client.models.list().data[0].id
        r = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "What is the capital of France?"}], max_tokens=16
        )
        assert r.choices[0].message.content == want
        assert r.model_extra["ensemble"]["stats"]["members"][SMOL]["forward_passes"] > 0
    finally:
        proc.terminate()
        proc.wait(30)


GREEDY_PROMPT = (
    "You are a careful assistant. Answer in one short paragraph, plainly and without lists. "
    "Tell me about the sea and the ships that sail on it."
)


@pytest.mark.parametrize("method,config", TINY_METHODS, ids=[m for m, _ in TINY_METHODS])
def test_a_greedy_request_alone_repeats_with_its_prefix_reused_or_not(method, config):
    """The same greedy request five times alone: one text, and the text of an engine that keeps no
    prompts. The later runs start from the stored prompt's cells (usage.cached_tokens): llama.cpp's
    results depend on a decode's size and on the order of a sequence's cells, so a reused prompt is
    restored outside the cells the rest runs in, and its rest runs in the same aligned pieces."""
    members = [SMOL] if method == "single" else [SMOL, GEMMA]
    eng = Ensemble(members, method, config, progress=False).load()
    for m in eng.members:  # members are shared in the process: none starts with this prompt's beginning kept
        m.prefixes.clear()
    runs = [eng.generate(GREEDY_PROMPT, max_new_tokens=24, temperature=0) for _ in range(5)]
    assert len({r.text for r in runs}) == 1, [r.text for r in runs]
    assert runs[0].usage.cached_tokens == 0 and all(r.usage.cached_tokens >= 32 for r in runs[1:])
    for m in eng.members:
        m.prefixes.clear()
        m.prefixes.max_bytes = 0
    try:
        off = [eng.generate(GREEDY_PROMPT, max_new_tokens=24, temperature=0).text for _ in range(2)]
    finally:
        for m in eng.members:
            m.prefixes.max_bytes = configured_bytes()
    assert off == [runs[0].text] * 2


def test_the_default_method_follows_the_member_that_writes_the_shown_answers_on_llama_members():
    """The shot exam on the GGUF pair (the default method, specfuse): on Russian country names
    SmolLM2 steps aside and the answer is Gemma-3's own; on English plurals nobody does."""
    eng = Ensemble([SMOL, GEMMA], progress=False).load()
    res = eng.generate(RUSSIAN, raw=True, max_new_tokens=8, stop=["\n"])
    assert res.stats["aside"] == [eng.members[0].name] and res.stats["solo"] == eng.members[1].name
    alone = Ensemble([GEMMA], progress=False).generate(RUSSIAN, raw=True, max_new_tokens=8, stop=["\n"])
    assert res.text == alone.text
    plural = "Q: cat\nA: cats\nQ: dog\nA: dogs\nQ: house\nA: houses\nQ: tree\nA: trees\nQ: car\nA:"
    r2 = eng.generate(plural, raw=True, max_new_tokens=8, stop=["\n"])
    assert "aside" not in r2.stats and r2.stats["exam"]["examined"] == 3
    r3 = eng.generate(DEMONYM, raw=True, max_new_tokens=8, stop=["\n"])  # Gemma-3 copies the country
    assert r3.stats["copy"] == [eng.members[1].name] and r3.stats["solo"] == eng.members[0].name
    smol = Ensemble([SMOL], progress=False).generate(DEMONYM, raw=True, max_new_tokens=8, stop=["\n"])
    assert r3.text == smol.text == " Lithuanian"
