"""Log-probabilities through `serve` (serve_scoring.py): a real server process on the tiny pair,
driven by the official `openai` client, its figures against `Ensemble.score` run here on the
same members; and the options it cannot honour, refused by name."""

from __future__ import annotations

import asyncio
import math

import httpx
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from ensemble_llm import Ensemble  # noqa: E402
from ensemble_llm.scoring import Scoring  # noqa: E402

METHOD = "unite"
PROMPT = "Q: What is the capital of France?\nA: Paris\nQ: What is the capital of Italy?\nA:"


@pytest.fixture(scope="module")
def server(tiny_dirs):
    from helpers import start_server

    proc, base = start_server([tiny_dirs["smol"], tiny_dirs["gemma"]], METHOD)
    yield base
    proc.terminate()
    proc.wait(timeout=30)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def direct(tiny_dirs):
    with Ensemble([tiny_dirs["smol"], tiny_dirs["gemma"]], method=METHOD) as eng:
        yield eng


def close(a: float, b: float) -> bool:
    return math.isclose(a, b, abs_tol=1e-4)


def test_chat_logprobs_are_the_ensembles_score_of_the_reply(client, direct):
    messages = [{"role": "user", "content": "Name a color."}]
    res = client.chat.completions.create(
        model="ensemble", messages=messages, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2
    )
    choice = res.choices[0]
    content = choice.logprobs.content
    assert b"".join(bytes(t.bytes) for t in content) == choice.message.content.encode()
    (want,) = direct.score(messages, [choice.message.content], raw=False, top=2)
    assert len(content) == len(want.tokens)
    for got, tok in zip(content, want.tokens):
        assert got.token == tok.token and close(got.logprob, tok.logprob)
        assert len(got.top_logprobs) == 2
        assert [(t.token, round(t.logprob, 4)) for t in got.top_logprobs] == [(a, round(b, 4)) for a, b in tok.top[:2]]
        assert set(got.model_extra["members"]) == {m.name for m in direct.members}


def test_completion_logprobs_of_the_generated_text(client, direct):
    res = client.completions.create(model="ensemble", prompt=PROMPT, max_tokens=4, temperature=0, logprobs=1)
    choice = res.choices[0]
    lp = choice.logprobs
    assert "".join(lp.tokens) == choice.text and lp.text_offset[0] == len(PROMPT)
    (want,) = direct.score(PROMPT, [choice.text], top=1)
    assert [t.token for t in want.tokens] == lp.tokens
    assert all(close(a, t.logprob) for a, t in zip(lp.token_logprobs, want.tokens))
    for top, tok in zip(lp.top_logprobs, want.tokens):
        assert tok.token in top and max(top.values()) >= top[tok.token]


def _echo(client, prompt, max_tokens: int, logprobs: int = 1):
    return client.completions.create(
        model="ensemble", prompt=prompt, echo=True, max_tokens=max_tokens, logprobs=logprobs, temperature=0
    ).choices[0]


def test_echo_scores_a_token_id_prompt_as_lm_eval_asks(client, direct):
    main = direct.members[direct.member_weights("raw")[1]]
    ids = main.encode(PROMPT)
    choice = _echo(client, [ids], 0)
    lp = choice.logprobs
    assert choice.text == PROMPT and len(lp.tokens) == len(ids)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    head = main.vocab_bytes[ids[0]].decode()
    res = asyncio.run(
        direct.ascore(head, Scoring((PROMPT[len(head) :],), weigh=PROMPT, token_ids=(tuple(ids[1:]),), top=1))
    )
    (want,) = res.scores
    assert all(close(a, t.logprob) for a, t in zip(lp.token_logprobs[1:], want.tokens))
    # lm-evaluation-harness's form: max_tokens 1, one entry per prompt token and the generated one
    more = _echo(client, [ids], 1).logprobs
    assert len(more.token_logprobs) >= len(ids) + 1
    assert all(close(a, b) for a, b in zip(more.token_logprobs[1 : len(ids)], lp.token_logprobs[1:]))


@pytest.mark.parametrize(
    "kwargs, param",
    [
        ({"prompt": "Hi", "logprobs": 1, "stream": True, "max_tokens": 2}, "logprobs"),
        ({"prompt": "Hi", "logprobs": 99, "max_tokens": 2}, "logprobs"),
        ({"prompt": "Hi", "max_tokens": 0}, "max_tokens"),
        ({"prompt": [[10**9]], "echo": True, "max_tokens": 0, "logprobs": 0}, "prompt"),
        ({"prompt": [["a", 1]], "max_tokens": 1}, "prompt"),
    ],
)
def test_completion_options_it_cannot_honour_are_refused(server, kwargs, param):
    r = httpx.post(server + "/v1/completions", json={"model": "ensemble", **kwargs}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


def test_chat_options_it_cannot_honour_are_refused(server, client):
    msgs = [{"role": "user", "content": "Hi"}]
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
    for extra, param in (({"top_logprobs": 2}, "top_logprobs"), ({"logprobs": True, "tools": [tool]}, "logprobs")):
        r = httpx.post(server + "/v1/chat/completions", json={"messages": msgs, "max_tokens": 2, **extra}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    res = client.chat.completions.create(model="ensemble", messages=msgs, max_tokens=2)  # still serving
    assert res.choices[0].logprobs is None
