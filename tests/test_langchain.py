"""LangChain facade on tiny random-weight members (fast): contracts beyond the standard suite."""

from __future__ import annotations

import asyncio
from typing import Optional

import pytest
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.messages import AIMessage, ChatMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.tools import tool
from langchain_ensemble_llm import EnsembleLLM
from langchain_ensemble_llm.chat_models import to_engine_messages
from pydantic import BaseModel, ValidationError
from typing_extensions import TypedDict

from ensemble_llm import RequestError


@pytest.fixture(scope="module")
def pair(tiny_dirs):
    return [tiny_dirs["smol"], tiny_dirs["gemma"]]


@pytest.fixture(scope="module")
def llm(pair):
    return EnsembleLLM(members=pair, method="safe", max_tokens=12, progress=False)


@tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@tool
def shout(text: str) -> str:
    """Upper-case a text."""
    return text.upper()


class Answer(BaseModel):
    """An answer with a confidence."""

    answer: str
    confidence: int
    note: Optional[str] = None


class AnswerDict(TypedDict):
    """An answer."""

    answer: str


def test_construction_is_lazy_shared_and_validated(pair):
    a = EnsembleLLM(members=pair, method="safe", config={"lookahead": 6}, progress=False)  # a new engine
    b = EnsembleLLM(members=pair, method="safe", config={"lookahead": 6}, progress=False)
    assert a.engine is b.engine and a.engine._members is None  # nothing loaded yet
    assert a.method == "safe" and a.model_name == f"safe:{'+'.join(a.engine.model_names)}"
    for kwargs, field in (
        ({"temperature": -1}, "temperature"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"top_p": 1.5}, "top_p"),
        ({"temprature": 0.5}, "temprature"),
        ({"method": "magic"}, "magic"),
        ({"members": ["no-such-model-9b"]}, "no-such-model-9b"),
        ({"config": {"lookahed": 3}}, "lookahed"),
        ({"engine": "x"}, "engine"),
    ):
        with pytest.raises((ValidationError, ValueError), match=field):
            EnsembleLLM(**{"members": pair, **kwargs})
    shared = EnsembleLLM(engine=a.engine)
    assert shared.engine is a.engine and shared.members == a.engine.model_names


def test_messages_conversion():
    msgs = to_engine_messages(
        [
            SystemMessage("Be brief."),
            HumanMessage(content=[{"type": "text", "text": "2+3?"}], name="bob"),
            AIMessage(content="", tool_calls=[{"name": "add", "args": {"a": 2, "b": 3}, "id": "c1"}]),
            ToolMessage("boom", tool_call_id="c1", status="error"),
            ChatMessage(role="developer", content="dev note"),
        ]
    )
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "tool", "system"]
    assert msgs[1] == {"role": "user", "content": "2+3?", "name": "bob"}
    assert msgs[2]["tool_calls"][0]["function"] == {"name": "add", "arguments": {"a": 2, "b": 3}}
    assert msgs[3]["content"] == "Error: boom" and msgs[3]["tool_call_id"] == "c1"
    with pytest.raises(ValueError, match="cannot send"):
        to_engine_messages([ChatMessage(role="critic", content="x")])


def test_invoke_stream_agree_and_metadata(llm):
    res = llm.invoke("Hello there", seed=1)
    assert isinstance(res, AIMessage) and isinstance(res.content, str)
    assert (
        res.usage_metadata["total_tokens"] == res.usage_metadata["input_tokens"] + res.usage_metadata["output_tokens"]
    )
    assert res.response_metadata["model_name"] == llm.model_name and res.response_metadata["method"] == "safe"
    assert "forward_passes" in next(iter(res.response_metadata["stats"]["members"].values()))
    chunks = list(llm.stream("Hello there"))
    assert chunks[-1].chunk_position == "last" and sum(c.usage_metadata is not None for c in chunks) == 1
    assert "".join(c.content for c in chunks) == res.content  # greedy: same text either way
    full = chunks[0]
    for c in chunks[1:]:
        full += c
    usage = dict(full.usage_metadata)  # the same prompt again: all its tokens but the last were stored
    assert usage.pop("input_token_details") == {"cache_read": usage["input_tokens"] - 1}
    assert usage == {k: v for k, v in res.usage_metadata.items() if k != "input_token_details"}


async def test_async_paths_and_callbacks(llm, loop_ticks):
    tokens = []

    class Handler(BaseCallbackHandler):
        def on_llm_new_token(self, token, **kwargs):
            tokens.append(token)

    sync = llm.invoke("Hi", config={"callbacks": [Handler()]}, stream=True)
    assert "".join(tokens) == sync.content
    res = await llm.ainvoke("Hi")
    assert res.content == sync.content
    chunks = [c async for c in llm.astream("Hi")]
    assert "".join(c.content for c in chunks) == sync.content and chunks[-1].chunk_position == "last"
    # two concurrent calls: the event loop keeps running while the engine works
    async with loop_ticks() as ticks:
        both = await asyncio.gather(llm.ainvoke("Hi"), llm.ainvoke("Hi"))
    assert both[0].content == both[1].content == sync.content and ticks[0] > 3
    assert [r.content for r in llm.batch(["Hi", "Hi"])] == [sync.content] * 2


def test_stop_field_and_per_call(pair):
    # safe: the drafter's greedy text with a stop is its text without one, cut (specfuse's drafts end
    # at a stop, so the winning segment may differ)
    base = EnsembleLLM(members=pair, method="safe", max_tokens=12, progress=False)
    text = base.invoke("Hello").content
    if len(text) < 3:
        pytest.skip("the random model ended too early to place a stop string")
    stop = text[2:4]
    assert base.invoke("Hello", stop=[stop]).content == text[: text.find(stop)]
    assert (
        EnsembleLLM(members=pair, method="safe", max_tokens=12, stop=[stop], progress=False).invoke("Hello").content
        == text[: text.find(stop)]
    )
    # a string is one stop string, never split into characters (reliability D2)
    assert base._request("is", {}).stop == ("is",)
    assert base.invoke("Hello", stop=stop).content == text[: text.find(stop)]


def test_errors_surface_in_every_path(tiny_dirs):
    small = EnsembleLLM(members=[tiny_dirs["smol_short"]], max_tokens=4, progress=False)
    long = "word " * 200  # longer than the 64-token context window
    with pytest.raises(RequestError, match="context window"):
        small.invoke(long)
    with pytest.raises(RequestError, match="context window"):
        list(small.stream(long))
    with pytest.raises(RequestError, match="context window"):
        asyncio.run(small.ainvoke(long))
    with pytest.raises(ValueError, match="unsupported call arguments"):
        small.invoke("hi", frequency_penalty=1.0)
    with pytest.raises(ValueError, match="cannot switch to model"):
        small.invoke("hi", model="gpt-4o")
    assert isinstance(small.invoke("hi").content, str)  # still usable


def test_bind_tools_choices_and_forced_calls(llm):
    with pytest.raises(RequestError, match="not among the tools"):
        llm.bind_tools([add], tool_choice="multiply")
    for choice in (
        None,
        "auto",
        "none",
        "any",
        "required",
        "add",
        True,
        {"type": "function", "function": {"name": "add"}},
    ):
        llm.bind_tools([add, shout], tool_choice=choice)  # every documented form is accepted
    # forced syntax counts toward max_tokens like every written token: a call needs ~30
    res = llm.bind_tools([add, shout], tool_choice="add", max_tokens=64).invoke("What is 2 + 3?")
    (call,) = res.tool_calls
    assert (
        call["name"] == "add"
        and set(call["args"]) == {"a", "b"}
        and all(isinstance(v, int) for v in call["args"].values())
    )
    assert call["id"] and res.response_metadata["finish_reason"] == "tool_calls"
    chunks = list(llm.bind_tools([add], tool_choice="any", max_tokens=64).stream("What is 2 + 3?"))
    full = chunks[0]
    for c in chunks[1:]:
        full += c
    assert full.tool_calls and full.tool_calls[0]["name"] == "add" and full.tool_call_chunks[0]["index"] == 0


@pytest.mark.parametrize("method", ["json_schema", "function_calling", "json_mode"])
def test_structured_output_pydantic_typeddict_json_schema(pair, method):
    """Random-weight members write noise, but the grammar makes it parse and validate; strings
    are bounded so that noise ends within the budget."""
    llm = EnsembleLLM(members=pair, method="safe", max_tokens=80, progress=False)
    small = Answer.model_json_schema()
    small["properties"]["answer"]["maxLength"] = 6
    small["properties"]["note"] = {"type": "null"}
    schema = {
        "title": "verdict",
        "description": "A verdict.",
        "type": "object",
        "properties": {"guilty": {"type": "boolean"}},
        "required": ["guilty"],
    }
    if method == "json_mode":  # any JSON object: parsed as JSON, not checked against a schema
        out = llm.with_structured_output(None, method="json_mode").invoke("Reply in JSON.")
        assert isinstance(out, dict)
        return
    out = llm.with_structured_output(small, method=method).invoke("Is water wet?")
    assert Answer.model_validate(out) and isinstance(out["confidence"], int) and len(out["answer"]) <= 6
    raw = llm.with_structured_output(schema, include_raw=True, method=method).invoke("Guilty?")
    assert isinstance(raw["parsed"]["guilty"], bool) and raw["parsing_error"] is None
    if method == "json_schema":
        assert raw["raw"].response_metadata["stats"]["constraint"] == "json_schema"


def test_token_counting_offline(llm):
    assert llm.get_num_tokens("Hello world") == len(llm.engine.members[0].encode("Hello world"))


def test_logprobs_in_response_metadata_invoke_and_stream(pair):
    llm = EnsembleLLM(members=pair, method="safe", max_tokens=6, temperature=0, logprobs=True, top_logprobs=2)
    msg = llm.invoke("Name a color.")
    lp = msg.response_metadata["logprobs"]["content"]
    assert b"".join(bytes(t["bytes"]) for t in lp) == msg.content.encode()
    (want,) = llm.engine.score([{"role": "user", "content": "Name a color."}], [msg.content], raw=False, top=2)
    assert [t["token"] for t in lp] == [t.token for t in want.tokens]
    assert all(abs(a["logprob"] - t.logprob) < 1e-9 for a, t in zip(lp, want.tokens))
    assert all(len(t["top_logprobs"]) == 2 and set(t["members"]) == set(want.members) for t in lp)
    last = list(llm.stream("Name a color."))[-1]
    assert last.response_metadata["logprobs"] == msg.response_metadata["logprobs"]  # greedy: the same reply
    got = asyncio.run(llm.ainvoke("Name a color."))
    assert got.response_metadata["logprobs"] == msg.response_metadata["logprobs"]
    assert "logprobs" not in EnsembleLLM(members=pair, method="safe", max_tokens=2).invoke("Hi").response_metadata
    with pytest.raises(ValueError, match="top_logprobs needs logprobs"):
        EnsembleLLM(members=pair, top_logprobs=2)
    with pytest.raises(ValueError, match="tools"):
        llm.bind_tools([add]).invoke("What is 2 + 3?")
