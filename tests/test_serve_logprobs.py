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


def test_echo_with_max_tokens_0_scores_the_whole_prompt(client, direct):
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


@pytest.mark.parametrize("choice", [" Rome", " Milan, Italy"])
def test_echo_in_lm_evals_form_is_the_choice_scored_after_its_context(client, direct, choice):
    """max_tokens 1, as lm-evaluation-harness sends it: one entry per prompt token, then exactly
    one for the generated token (the harness drops it); the choice's entries add up to
    `Ensemble.score(context, [choice])`, the prompt's before them are null."""
    main = direct.members[direct.member_weights("raw")[1]]
    ids, ctx = main.encode(PROMPT + choice), len(main.encode(PROMPT))
    assert ids[:ctx] == main.encode(PROMPT)  # the harness's split: context tokens, then the choice's
    got = _echo(client, [ids], 1)
    lp = got.logprobs
    assert len(lp.token_logprobs) == len(ids) + 1 and got.text.startswith(PROMPT + choice)
    assert all(x is None for x in lp.token_logprobs[:ctx]) and None not in lp.token_logprobs[ctx:]
    (want,) = direct.score(PROMPT, [choice])
    assert math.isclose(sum(lp.token_logprobs[ctx:-1]), want.logprob, abs_tol=1e-5)
    members = lp.model_extra["members"][ctx:-1]
    for name, value in want.members.items():
        assert math.isclose(sum(m[name] for m in members), value, abs_tol=1e-5)


def test_a_list_of_prompts_gets_one_choice_each_in_order(server, client, direct):
    main = direct.members[direct.member_weights("raw")[1]]
    prompts = [main.encode(PROMPT + c) for c in (" Rome", " Milan", " Turin, Italy")]
    alone = [_echo(client, [p], 1).logprobs.token_logprobs for p in prompts]
    res = client.completions.create(model="ensemble", prompt=prompts, echo=True, max_tokens=1, logprobs=1)
    assert [c.index for c in res.choices] == [0, 1, 2]
    for c, want in zip(res.choices, alone):  # batched with each other: the same up to float rounding
        got = c.logprobs.token_logprobs[:-1]
        assert [x is None for x in got] == [x is None for x in want[:-1]]
        assert all(math.isclose(a, b, abs_tol=1e-6) for a, b in zip(got, want) if a is not None)
    texts = client.completions.create(model="ensemble", prompt=["Hi", "Q: 1?\nA:"], max_tokens=2, temperature=0)
    assert len(texts.choices) == 2 and texts.usage.completion_tokens >= 2


def test_a_reply_that_re_encodes_longer_is_cut_to_the_budget(direct):
    from ensemble_llm.results import GenerationResult, Usage
    from ensemble_llm.serve_scoring import Wants, _generated

    main = direct.members[direct.member_weights("raw")[1]]
    text = " Milan, Italy"
    assert len(main.encode(text)) > 1
    result = GenerationResult(text=text, finish_reason="length", usage=Usage(3, 1))
    gen, cut = _generated(main, Wants(logprobs=True, echo=True, max_tokens=1), result)
    assert gen == main.encode(text)[:1] and cut.text == main.decode(gen) and cut.finish_reason == "length"
    same, kept = _generated(main, Wants(logprobs=True, echo=True, max_tokens=5), result)
    assert same == main.encode(text) and kept is result


def echo_rome(engine, reply: str, finish: str, stops: tuple[str, ...] = ()) -> dict:
    """The echo logprobs of PROMPT + " Rome" (as token ids, lm-eval's one-token budget) with the
    given one-token reply and finish reason."""
    from ensemble_llm.results import GenerationResult, Usage
    from ensemble_llm.serve_scoring import Wants, echoed

    ids = engine.members[engine.member_weights("raw")[1]].encode(PROMPT + " Rome")
    want = Wants(logprobs=True, top=1, echo=True, ids=tuple(ids), max_tokens=1)
    result = GenerationResult(text=reply, finish_reason=finish, usage=Usage(len(ids), 1))
    return asyncio.run(echoed(engine, [want], [PROMPT + " Rome"], [result], stops))[0][0]


def test_an_eos_reply_gets_its_own_entry(direct):
    """A reply that ends on EOS before its budget: one entry for the EOS, the ensemble's
    probability of the end of text there."""
    main = direct.members[direct.member_weights("raw")[1]]
    ids = main.encode(PROMPT + " Rome")
    lp = echo_rome(direct, "", "stop")
    assert len(lp["token_logprobs"]) == len(ids) + 1
    assert lp["tokens"][-1] == main.decode([main.eos_id], skip_special_tokens=False)
    end = lp["token_logprobs"][-1]
    assert -50 < end < 0 and lp["top_logprobs"][-1] == {lp["tokens"][-1]: end}
    res = asyncio.run(direct.ascore(PROMPT, Scoring((" Rome",), ends=(True,))))
    assert math.isclose(res.scores[0].end.logprob, end, abs_tol=1e-6)
    stopped = echo_rome(direct, "", "stop", ("\n",))
    assert len(stopped["token_logprobs"]) == len(ids)  # a stop string ended it: no EOS written


def test_a_reply_of_half_a_character_keeps_its_entry(direct):
    """A method that wrote one token of half a UTF-8 character shows no text for it (the engine never
    ends a reply in U+FFFD); echo still gives that token its entry, with null figures, so that a
    harness dropping the last entry drops none of the choice's tokens."""
    ids = direct.members[direct.member_weights("raw")[1]].encode(PROMPT + " Rome")
    lp = echo_rome(direct, "", "length")
    assert len(lp["token_logprobs"]) == len(ids) + 1
    assert lp["tokens"][-1] == "" and lp["token_logprobs"][-1] is None and lp["top_logprobs"][-1] is None
    shown = echo_rome(direct, " is", "length")
    assert lp["token_logprobs"][:-1] == shown["token_logprobs"][:-1]  # the choice's figures are the same
    assert len(shown["token_logprobs"]) == len(ids) + 1 and shown["token_logprobs"][-1] is not None


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


def test_tokenizer_endpoints_speak_the_main_members_tokenizer(server, direct):
    """vLLM's /tokenizer_info, /tokenize and /detokenize, as lm-evaluation-harness's remote
    tokenizer reads them: the ids of the member that reads token-id prompts, special tokens in
    the text read as themselves."""
    main = direct.members[direct.member_weights("raw")[1]]
    info = httpx.get(server + "/tokenizer_info", timeout=60).json()
    eos = main.decode([main.eos_id], skip_special_tokens=False)
    assert info["eos_token"] == eos and info["model_max_length"] == main.context_window
    text = "Q: Où est Paris?\nA:"
    got = httpx.post(server + "/tokenize", json={"prompt": text, "add_special_tokens": False}, timeout=60).json()
    assert got["tokens"] == main.encode(text) and got["count"] == len(got["tokens"])
    both = httpx.post(server + "/tokenize", json={"prompt": eos + text, "add_special_tokens": False}, timeout=60)
    assert both.json()["tokens"] == [main.eos_id] + main.encode(text)
    with_bos = httpx.post(server + "/tokenize", json={"prompt": text}, timeout=60).json()["tokens"]
    assert with_bos == main.prompt_ids(text)
    back = httpx.post(server + "/detokenize", json={"tokens": got["tokens"]}, timeout=60).json()
    assert back == {"prompt": text}
    for path, body in (("/tokenize", {"prompt": 3}), ("/detokenize", {"tokens": [10**9]}), ("/tokenize", [])):
        r = httpx.post(server + path, json=body, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["message"], r.text


def test_one_member_reads_its_reply_off_the_scoring(tiny_dirs):
    """lm-evaluation-harness's request to a one-member server (greedy, max_tokens 1): the reply is
    the member's most probable next token, the one `single` writes, read off the scoring's rows
    without a second prefill; its entry is that token's log-probability."""
    import torch

    from ensemble_llm.serve_scoring import Wants, echoed, reply_in_scoring

    with Ensemble([tiny_dirs["smol"]], method="single") as one:
        m = one.members[0]
        text = PROMPT + " Rome"
        ids = m.encode(text)
        want = Wants(logprobs=True, top=1, echo=True, ids=tuple(ids), max_tokens=1)
        from ensemble_llm.params import GenerationParams

        assert reply_in_scoring(one, want, GenerationParams(max_new_tokens=1, temperature=0))
        assert not reply_in_scoring(one, want, GenerationParams(max_new_tokens=1, temperature=0.7))
        lp, result = asyncio.run(echoed(one, [want], [text], [None], ()))[0]
        written = one.generate(text, raw=True, max_new_tokens=1, temperature=0)
        assert result.text == written.text and result.usage.completion_tokens == 1
        assert len(lp["token_logprobs"]) == len(ids) + 1
        row = torch.log_softmax(m.forward_batch([ids])[0][-1].double(), -1)
        assert lp["token_logprobs"][-1] == pytest.approx(float(row.max()), abs=1e-5)
        assert lp["top_logprobs"][-1] == {lp["tokens"][-1]: lp["token_logprobs"][-1]}
