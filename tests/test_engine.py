"""The engine on tiny random-weight models with the real tokenizers: equivalence with
transformers' own greedy generate, streaming, stop strings, concurrency, errors."""

import asyncio
import threading
import time

import pytest
import torch

from ensemble_llm import ConfigError, ContextLengthError, Ensemble, GenerationError, ModelNotFoundError, RequestError
from ensemble_llm.chat import BASE_PREAMBLE, render_chat
from ensemble_llm.members import BUNDLED


@pytest.fixture(scope="module")
def engine(tiny_dirs):
    return Ensemble([tiny_dirs["smol"], tiny_dirs["gemma"]], method="single").load()


def test_single_greedy_equals_transformers_generate(engine):
    m = engine.members[0]
    res = engine.generate("Tell me a story.", max_new_tokens=12)
    ids = m.prompt_ids(render_chat(m, [{"role": "user", "content": "Tell me a story."}]))
    with torch.inference_mode():
        out = m.model.generate(
            torch.tensor([ids]), max_new_tokens=12, do_sample=False, eos_token_id=sorted(m.eos_ids), pad_token_id=0
        )[0, len(ids) :].tolist()
    out = [t for t in out if t not in m.eos_ids]
    assert res.text == m.decode(out)
    assert res.usage.prompt_tokens == len(ids)
    assert res.usage.completion_tokens == len(m.encode(res.text))
    assert res.stats["tokens_out"] == len(out)
    assert res.stats["members"][m.name]["forward_passes"] == len(out)


def test_single_on_second_member_uses_plain_fallback(tiny_dirs):
    eng = Ensemble([tiny_dirs["smol"], tiny_dirs["gemma"]], method="single", config={"member": 1})
    res = eng.generate("Hi", max_new_tokens=5)
    g = eng.members[1]
    prompt = eng._chat_prompt(1, "Hi")  # the built-in base-model preamble, then the plain transcript
    assert prompt.endswith("\nUser:\nHi\nAssistant:\n") and prompt.startswith(BASE_PREAMBLE[0]["content"])
    assert res.usage.prompt_tokens == len(g.prompt_ids(prompt))
    assert res.stats["members"][eng.members[0].name]["forward_passes"] == 0


def test_stream_deltas_join_to_generate_text(engine):
    stream = engine.stream("Count to ten.", max_new_tokens=20)
    deltas = list(stream)
    assert len(deltas) > 1
    assert "".join(deltas) == stream.result.text == engine.generate("Count to ten.", max_new_tokens=20).text


def test_stop_string_cuts_output_and_is_never_streamed(engine):
    full = engine.generate("Say something.", max_new_tokens=30, raw=True).text
    assert len(full) > 6
    stop = full[3:6]  # a multi-character string that certainly occurs
    stream = engine.stream("Say something.", max_new_tokens=30, raw=True, stop=[stop])
    deltas = list(stream)
    want = full[: full.find(stop)]
    assert "".join(deltas) == want == stream.result.text
    assert stream.result.finish_reason == "stop"


def test_sampling_is_seeded(engine):
    a = engine.generate("Hi", max_new_tokens=8, temperature=1.0, seed=5).text
    b = engine.generate("Hi", max_new_tokens=8, temperature=1.0, seed=5).text
    c = engine.generate("Hi", max_new_tokens=8, temperature=1.0, seed=6).text
    assert a == b and a != c


async def test_eight_concurrent_agenerate_equal_sequential_runs(engine):
    prompts = [f"Question number {i}: what is {i} plus {i}?" for i in range(8)]
    alone = [engine.generate(p, max_new_tokens=10).text for p in prompts]
    together = await asyncio.gather(*(engine.agenerate(p, max_new_tokens=10) for p in prompts))
    assert [r.text for r in together] == alone


async def test_async_does_not_block_the_event_loop(engine, loop_ticks):
    async with loop_ticks(0.001) as ticks:
        res = await engine.agenerate("A long answer please.", max_new_tokens=40)
    assert res.stats["tokens_out"] > 0 and ticks[0] > 5
    chunks = [d async for d in engine.astream("Hi", max_new_tokens=6)]
    assert "".join(chunks) == engine.generate("Hi", max_new_tokens=6).text


def test_threads_do_not_interleave(engine):
    prompts = [f"Thread {i} says" for i in range(4)]
    alone = {p: engine.generate(p, max_new_tokens=8, raw=True).text for p in prompts}
    got = {}

    def work(p):
        got[p] = "".join(engine.stream(p, max_new_tokens=8, raw=True))

    threads = [threading.Thread(target=work, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == alone


def test_abandoned_stream_leaves_engine_usable(engine):
    stream = iter(engine.stream("Go on and on.", max_new_tokens=50))
    next(stream)
    stream.close()
    assert engine.generate("Hi", max_new_tokens=4).usage.completion_tokens > 0


# ---- bad input: clear errors, engine still usable ----------------------------------------


def test_unknown_model_lists_valid_names():
    with pytest.raises(ModelNotFoundError) as e:
        Ensemble(["smollm3-9000b"])
    for name in BUNDLED:
        assert name in str(e.value)


def test_unknown_method_lists_valid_methods(tiny_dirs):
    with pytest.raises(ConfigError, match="valid methods: .*single"):
        Ensemble([tiny_dirs["smol"]], method="magic")


def test_bad_method_config_names_the_field(tiny_dirs):
    with pytest.raises(ConfigError, match="membr"):
        Ensemble([tiny_dirs["smol"]], config={"membr": 1})
    with pytest.raises(ConfigError, match="member"):
        Ensemble([tiny_dirs["smol"]], config={"member": -1})
    with pytest.raises(ConfigError, match="member=3"):
        Ensemble([tiny_dirs["smol"]], config={"member": 3}).load()


@pytest.mark.parametrize("device", ["cuda:7", "gpu0", "tpu"])
def test_device_that_does_not_exist(tiny_dirs, device):
    if device.startswith("cuda") and torch.cuda.device_count() > 7:
        pytest.skip("this machine has 8 GPUs")
    with pytest.raises(ConfigError, match="device"):
        Ensemble([tiny_dirs["smol"]], device=device)


def test_missing_gguf_and_folder_without_config(tmp_path):
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        Ensemble([str(tmp_path / "nope.gguf")])
    with pytest.raises(ModelNotFoundError, match="config.json"):
        Ensemble([str(tmp_path)])


def test_hub_id_not_in_cache_is_a_clear_offline_error(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    eng = Ensemble(["someorg/some-model-not-cached"])
    with pytest.raises(ModelNotFoundError, match="not in the local Hugging Face cache"):
        eng.load()


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(prompt=""), "empty"),
        (dict(prompt="   "), "empty"),
        (dict(prompt=[]), "empty"),
        (dict(prompt=[{"role": "robot", "content": "x"}]), "role"),
        (dict(prompt="hi", max_new_tokens=0), "max_new_tokens"),
        (dict(prompt="hi", max_new_tokens=-3), "max_new_tokens"),
        (dict(prompt="hi", temperature=-0.5), "temperature"),
        (dict(prompt="hi", top_p=0), "top_p"),
        (dict(prompt="hi", stop=[3]), "stop"),
        # reliability D3-D6, D11: refused before any work, naming the problem
        (dict(prompt=[{"role": "user"}]), "no text content"),
        (dict(prompt=[{"role": "user", "content": None}]), "no text content"),
        (dict(prompt=[{"role": "user", "content": "  "}]), "no text content"),
        (
            dict(prompt=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
            "part 0 is 'image_url'",
        ),
        (dict(prompt=[{"role": "user", "content": {"text": "hi"}}]), "string or a list of text parts"),
        (dict(prompt=[{"role": "assistant", "content": "", "tool_calls": [{"id": "1"}]}]), "tool_calls"),
        (dict(prompt="hi", temperature=float("inf")), "finite"),
        (dict(prompt="hi", temperature=float("nan")), "finite"),
        (dict(prompt="hi", timeout=float("nan")), "timeout"),
        (dict(prompt="hi", timeout=float("inf")), "timeout"),
        (dict(prompt="hi", seed=2**64), "seed"),
        (dict(prompt="hi", stop=123), "stop must be a string"),
        (dict(prompt="caf\udce9"), "lone surrogate"),
        (dict(prompt=[{"role": "user", "content": "x\ud800"}]), "lone surrogate"),
    ],
)
def test_bad_requests(engine, kw, match):
    prompt = kw.pop("prompt")
    with pytest.raises(RequestError, match=match):
        engine.generate(prompt, **kw)
    assert engine.generate("hi", max_new_tokens=2).usage.completion_tokens >= 0


def test_prompt_longer_than_context_window(tiny_dirs):
    eng = Ensemble([tiny_dirs["smol_short"]])
    with pytest.raises(ContextLengthError, match="context window is 64"):
        eng.generate("word " * 200)
    res = eng.generate("short", max_new_tokens=500)  # budget capped at the window, no crash
    assert res.finish_reason in ("length", "stop") and res.stats["tokens_out"] <= 64


async def test_failure_inside_generation_raises_in_caller_and_engine_survives(tiny_dirs, monkeypatch):
    eng = Ensemble([tiny_dirs["smol"]]).load()
    m = eng.members[0]
    real_extend = type(m).extend
    calls = {"n": 0}

    def flaky(self, state, ids, **kw):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("simulated device failure")
        return real_extend(self, state, ids, **kw)

    monkeypatch.setattr(type(m), "extend", flaky)
    with pytest.raises(GenerationError, match="simulated device failure"):
        eng.generate("hi", max_new_tokens=10)
    calls["n"] = 0
    with pytest.raises(GenerationError, match="simulated"):
        "".join(eng.stream("hi", max_new_tokens=10))
    calls["n"] = 0
    with pytest.raises(GenerationError, match="simulated"):
        await asyncio.wait_for(eng.agenerate("hi", max_new_tokens=10), timeout=60)
    calls["n"] = 0
    with pytest.raises(GenerationError, match="simulated"):
        async for _ in eng.astream("hi", max_new_tokens=10):
            pass
    monkeypatch.setattr(type(m), "extend", real_extend)
    assert eng.generate("hi", max_new_tokens=3).stats["tokens_out"] >= 1


def test_construction_loads_nothing(tiny_dirs):
    t0 = time.perf_counter()
    eng = Ensemble([tiny_dirs["smol"], tiny_dirs["gemma"]])
    assert eng._members is None and time.perf_counter() - t0 < 5


def test_same_model_is_loaded_once_per_process(tiny_dirs):
    a = Ensemble([tiny_dirs["smol"]]).load()
    b = Ensemble([tiny_dirs["smol"]]).load()
    assert a.members[0] is b.members[0]


def test_timeout_counts_the_time_waiting_in_the_queue(tiny_dirs):
    """Reliability D6: a request queued behind a long one (every slot taken: max_batch=1) times
    out on its own clock."""
    from ensemble_llm import RequestTimeout

    engine = Ensemble([tiny_dirs["smol"], tiny_dirs["gemma"]], method="single", max_batch=1)
    long = engine.stream("Tell me a long story.", max_new_tokens=300)
    short = engine.stream("hi", max_new_tokens=2, timeout=0.05)
    t = time.perf_counter()
    with pytest.raises(RequestTimeout, match="queue wait included"):
        list(short)
    list(long)
    assert time.perf_counter() - t < 120
    assert engine.generate("hi", max_new_tokens=2).finish_reason in ("stop", "length")


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the thread's end, on purpose
def test_a_job_that_kills_its_worker_thread_fails_alone_and_a_new_thread_serves(tiny_dirs, monkeypatch):
    """A SystemExit inside a request (a library calling sys.exit, say) ends its worker thread: its
    caller gets a GenerationError instead of waiting forever, and the next request gets a new
    thread (max_batch=1: the dead one is not counted)."""
    import threading

    from ensemble_llm import GenerationError

    engine = Ensemble([tiny_dirs["smol"]], method="single", max_batch=1).load()
    run, calls = engine._method.run, []

    def dies_once(req):
        calls.append(1)
        if len(calls) == 1:
            raise SystemExit("bye")
        return run(req)

    monkeypatch.setattr(engine._method, "run", dies_once)
    out = {}

    def first():
        try:
            engine.generate("hi", max_new_tokens=2)
        except GenerationError as exc:
            out["error"] = str(exc)

    t = threading.Thread(target=first)
    t.start()
    t.join(60)
    assert "SystemExit" in out.get("error", ""), out  # not a hang
    assert engine.generate("hi", max_new_tokens=2).finish_reason in ("stop", "length")


def test_budget_never_ends_in_a_replacement_character(engine):
    """Reliability D12: a character cut by max_new_tokens is dropped, not shown as U+FFFD."""
    for n in range(1, 6):
        res = engine.generate("Write one sentence about 東京 and München.", max_new_tokens=n, temperature=1.0, seed=n)
        assert not res.text.endswith("\ufffd")


def _still_alive(threads, wait: float = 5.0) -> list:
    """The threads still alive after up to `wait` seconds."""
    import time

    deadline = time.monotonic() + wait
    while (live := [t for t in threads if t.is_alive()]) and time.monotonic() < deadline:
        time.sleep(0.01)
    return live


def test_close_frees_the_members_and_a_later_request_loads_them_again(tiny_dirs):
    import gc
    import weakref

    from ensemble_llm.members.loader import clear_cache

    clear_cache()  # members of its own: other tests' engines hold the cached ones
    with Ensemble([tiny_dirs["smol"], tiny_dirs["gemma"]], method="unite", config={"weights": None}) as eng:
        first = eng.generate("Hi", max_new_tokens=3).text
        refs = [weakref.ref(m) for m in eng.members]
        threads = list(eng._worker._threads)
    gc.collect()
    assert all(r() is None for r in refs)  # no cache, engine or method keeps them
    assert threads and not _still_alive(threads)  # nor a thread of its worker, idle on its queue
    assert eng.generate("Hi", max_new_tokens=3).text == first  # loaded again, on a new thread
    threads = list(eng._worker._threads)
    eng.close()
    assert threads and not _still_alive(threads)
    shared = Ensemble.shared([tiny_dirs["smol"]])
    shared.close()
    assert Ensemble.shared([tiny_dirs["smol"]]) is not shared  # a closed shared engine is not handed out
