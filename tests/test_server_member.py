"""Members on a real llama.cpp server (`llama-server`, built once from the llama-cpp-python sdist's
vendored sources: members/backends/server/build.py), started on loopback over the bundled SmolLM2 GGUF.

The server member's answers are checked against the same GGUF in process: its rows, scores and
greedy texts, alone and in a mixed ensemble (one member on the server, one in process); then what
it refuses, concurrent requests, and a server killed mid-request and restarted.
"""

from __future__ import annotations

import threading
import time

import pytest

from ensemble_llm import Ensemble
from ensemble_llm.errors import CapabilityError, ConfigError, GenerationError
from ensemble_llm.members import load_member
from ensemble_llm.members import rows as R
from ensemble_llm.members.backends.server import build
from ensemble_llm.members.fetch import fetch_bundled
from ensemble_llm.members.options import member_options
from ensemble_llm.members.registry import BUNDLED

pytest.importorskip("llama_cpp")
pytestmark = pytest.mark.timeout(900)

SMOL = "smollm2-135m-instruct"
# llama-server batches a prompt in other shapes than the in-process member: its log-probs moved by
# at most 2.3e-4 here (rows, scores), so figures are compared at 2e-3
TOL = 2e-3
PROMPTS = ("What is the capital of France?", "Q: What is 12 + 7?\nA:")


@pytest.fixture(scope="module")
def gguf():
    return fetch_bundled(BUNDLED[SMOL], progress=False)


@pytest.fixture(scope="module")
def url(gguf):
    with build.launch(gguf, args=["--parallel", "4", "-c", "8192", "-t", "2"]) as u:
        yield u


def server_spec(url: str, **kw) -> dict:
    return {"model": SMOL, "backend": "server", "url": url, **kw}


@pytest.fixture(scope="module")
def pair(url):
    local = load_member(SMOL)
    remote = load_member(SMOL, options=member_options({"backend": "server", "url": url}, "m"))
    return local, remote


def test_rows_and_scores_match_the_member_in_process(pair):
    local, remote = pair
    ids = local.prompt_ids("The capital of France is")
    more = local.encode(" Paris, and the capital of Spain is Madrid.")
    a, b = local.prefill(ids), remote.prefill(ids)
    probe = [5, 100, 2000, 30000, local.eos_id, more[0]]
    ra, rb = local.extend(a, more), remote.extend(b, more)
    assert len(ra) == len(rb) == len(more)
    for x, y in zip(ra, rb):  # values inside and outside the top 20 (asked exactly), top ids
        assert R.take(x, probe) == pytest.approx(R.take(y, probe), abs=TOL)
        assert R.top(x, 3)[1] == R.top(y, 3)[1]
    cands = [local.encode(" It is"), local.encode(" The"), [local.eos_id]]
    for x, y in zip(local.score_inline(a, cands), remote.score_inline(b, cands)):
        assert x.tolist() == pytest.approx(y.tolist(), abs=TOL)
    for x, y in zip(local.score_prompt(ids + more, [3, 4, 7]), remote.score_prompt(ids + more, [3, 4, 7])):
        assert (x.logprob, x.gap) == pytest.approx((y.logprob, y.gap), abs=TOL)
    # the scored prompt's state, handed to the prefill that follows (as a request with per-request
    # weights runs it), holds its next row: the methods read it at once
    before = remote.client.requests
    x, y = local.prefill(ids + more).next_logprobs, remote.prefill(ids + more).next_logprobs
    assert remote.client.requests == before and y is not None
    assert R.top(x, 3)[1] == R.top(y, 3)[1]
    assert local.target_logprob(ids, more) == pytest.approx(remote.target_logprob(ids, more), abs=5 * TOL)
    assert local.greedy_after(ids, more[:1]) == remote.greedy_after(ids, more[:1])


def test_following_its_own_continuation_costs_no_request(pair):
    _, remote = pair
    state = remote.prefill(remote.prompt_ids("Count: one, two, three,"))
    before = remote.client.requests
    for _ in range(8):  # greedy, as the server wrote ahead
        remote.extend(state, [R.pick_token(state.next_logprobs)])
    assert remote.client.requests == before


def test_a_greedy_member_alone_asks_the_server_for_no_log_probs(url):
    """Greedy `single` reads only the server's own tokens, so its requests ask for no log-probs (a
    log-prob per token is work for the server), and it writes what the member in process writes.
    A value read later is asked then, and the member asks log-probs from then on."""
    spec = server_spec(url, timeout=59.0)  # options of its own: a member no other test has loaded
    got, want = Ensemble([spec], method="single"), Ensemble([SMOL], method="single")
    try:
        for p in PROMPTS:
            assert got.generate(p, max_new_tokens=24).text == want.generate(p, max_new_tokens=24).text
        remote, local = got.members[0], want.members[0]
        assert remote.top_k == 0
        a, b = local.prefill(local.prompt_ids(PROMPTS[0])), remote.prefill(local.prompt_ids(PROMPTS[0]))
        token = R.pick_token(a.next_logprobs)
        assert R.pick_token(b.next_logprobs) == token
        assert R.take(b.next_logprobs, [token]) == pytest.approx(R.take(a.next_logprobs, [token]), abs=TOL)
        assert remote.top_k == 1
    finally:
        got.close()
        want.close()


@pytest.mark.parametrize("method", ["single", "specfuse", "safe", "unite"])
def test_mixed_ensemble_writes_what_in_process_members_write(url, method):
    members = [server_spec(url), "gemma-3-270m"] if method != "single" else [server_spec(url)]
    alone = [SMOL, "gemma-3-270m"] if method != "single" else [SMOL]
    got, want = Ensemble(members, method=method), Ensemble(alone, method=method)
    try:
        for p in PROMPTS:
            assert got.generate(p, max_new_tokens=24).text == want.generate(p, max_new_tokens=24).text
    finally:
        got.close()
        want.close()


def test_what_needs_whole_rows_is_refused_by_name(url):
    smc, single = Ensemble([server_spec(url), "gemma-3-270m"], method="smc"), Ensemble([server_spec(url)])
    try:
        named = rf"which member '{SMOL}' \(backend 'server', {url}\) does not give"
        with pytest.raises(CapabilityError, match=rf"method 'smc' needs .* at each byte .*{named}"):
            smc.generate("Hi", max_new_tokens=4)
        with pytest.raises(CapabilityError, match=rf"^scoring .*{named}"):
            smc.score("The capital of France is", [" Paris", " Rome"])
        with pytest.raises(CapabilityError, match=rf"with constrained output needs .*{named}"):
            single.generate("Give JSON", max_new_tokens=8, response_format={"type": "json_object"})
        assert single.generate("Hi", max_new_tokens=4).text  # the engine still serves
    finally:
        smc.close()
        single.close()


def test_bad_server_options_are_refused(url):
    with pytest.raises(ConfigError, match="url= applies to backend='server'"):
        member_options({"url": url}, "member 0")
    with pytest.raises(ConfigError, match="needs url="):
        member_options({"backend": "server"}, "member 0")
    with pytest.raises(ConfigError, match="timeout must be a number"):
        member_options({"backend": "server", "url": url, "timeout": 0}, "member 0")
    with pytest.raises(ConfigError, match="needs no Ray actor"):
        Ensemble([server_spec(url)], placement="ray")
    with pytest.raises(ConfigError, match="the server runs another model"):  # gemma's tokenizer, SmolLM2's server
        load_member("gemma-3-270m", options=member_options({"backend": "server", "url": url}, "m"))


def test_concurrent_requests_answer_as_one_at_a_time(url):
    e = Ensemble([server_spec(url)], method="single")
    prompts = [f"Write a word that rhymes with {w}." for w in ("cat", "tree", "blue", "light")]
    try:
        alone = [e.generate(p, max_new_tokens=16).text for p in prompts]
        got = [None] * len(prompts)

        def run(i):
            got[i] = e.generate(prompts[i], max_new_tokens=16).text

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert got == alone
    finally:
        e.close()


def test_a_killed_server_fails_the_request_alone_and_a_restarted_one_serves(gguf):
    port = build.free_port()
    proc, url = build.start(gguf, port, ["-t", "2"])
    e = Ensemble([server_spec(url, timeout=5)], method="single")
    try:
        assert e.generate("Hi", max_new_tokens=4).text
        err: list = []

        def long_request():
            try:
                e.generate("Tell me a long story about a dragon.", max_new_tokens=400, timeout=20)
            except GenerationError as exc:
                err.append(exc)

        t = threading.Thread(target=long_request)
        t0 = time.monotonic()
        t.start()
        time.sleep(0.5)
        proc.kill()
        proc.wait()
        t.join(30)
        assert not t.is_alive() and time.monotonic() - t0 < 20 + 2
        assert err and SMOL in str(err[0]) and url in str(err[0])
        proc, _ = build.start(gguf, port, ["-t", "2"])
        assert e.generate("Hi", max_new_tokens=4).text  # the same engine, not restarted
    finally:
        e.close()
        build.stop(proc)


def test_the_cli_and_both_facades_take_a_server_member(url):
    import json
    import subprocess
    import sys

    from langchain_ensemble_llm import EnsembleLLM as LangChainLLM
    from llama_index.llms.ensemble_llm import EnsembleLLM as LlamaIndexLLM

    spec = [server_spec(url)]
    want = Ensemble(spec).generate("What is the capital of France?", max_new_tokens=8).text
    cmd = [sys.executable, "-m", "ensemble_llm", "generate", "What is the capital of France?"]
    cli = subprocess.run([*cmd, "--models", json.dumps(spec), "--max-new-tokens", "8"], capture_output=True, text=True)
    assert cli.returncode == 0, cli.stderr[-2000:]
    assert want.strip() in cli.stdout
    assert LangChainLLM(members=spec, max_tokens=8).invoke("What is the capital of France?").content == want
    assert LlamaIndexLLM(members=spec, max_new_tokens=8).complete("What is the capital of France?").text == want
