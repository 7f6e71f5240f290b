"""LlamaIndex facade on tiny random-weight members (fast): the LLM contract, tools, agents' plumbing."""

from __future__ import annotations

import asyncio

import pytest
from langchain_ensemble_llm import EnsembleLLM as LangChainEnsembleLLM
from llama_index.core.base.llms.types import ChatMessage, MessageRole, TextBlock, ToolCallBlock
from llama_index.core.callbacks import CallbackManager, TokenCountingHandler
from llama_index.core.tools import FunctionTool
from llama_index.llms.ensemble_llm import EnsembleLLM
from llama_index.llms.ensemble_llm.base import to_engine_messages
from pydantic import BaseModel, Field, ValidationError

from ensemble_llm import RequestError


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


ADD = FunctionTool.from_defaults(fn=add)


@pytest.fixture(scope="module")
def pair(tiny_dirs):
    return [tiny_dirs["smol"], tiny_dirs["gemma"]]


@pytest.fixture(scope="module")
def llm(pair):
    return EnsembleLLM(members=pair, method="safe", max_new_tokens=12, progress=False)


def test_construction_metadata_and_sharing(pair):
    a = EnsembleLLM(members=pair, method="safe", config={"lookahead": 7}, progress=False)  # a new engine
    assert a.engine._members is None
    md = a.metadata
    assert md.is_chat_model and md.is_function_calling_model and md.context_window == 2048
    assert md.model_name == a.model_name and md.num_output == 256
    assert a.engine._members is None  # metadata reads configs, it loads no weights
    lc = LangChainEnsembleLLM(members=pair, method="safe", config={"lookahead": 7}, progress=False)
    assert lc.engine is a.engine  # one engine, one set of loaded models, for both frameworks
    assert EnsembleLLM(engine=lc.engine).engine is lc.engine
    for kwargs, field in (
        ({"temperature": -1}, "temperature"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"method": "magic"}, "magic"),
        ({"members": ["no-such-model-9b"]}, "no-such-model-9b"),
        ({"temprature": 0.5}, "temprature"),
    ):
        with pytest.raises((ValidationError, ValueError), match=field):
            EnsembleLLM(**{"members": pair, **kwargs})


def test_messages_conversion():
    msgs = to_engine_messages(
        [
            ChatMessage(role=MessageRole.SYSTEM, content="Be brief."),
            ChatMessage(role=MessageRole.USER, content="2+3?"),
            ChatMessage(
                role=MessageRole.ASSISTANT,
                blocks=[ToolCallBlock(tool_call_id="c1", tool_name="add", tool_kwargs={"a": 2, "b": 3})],
            ),
            ChatMessage(role=MessageRole.TOOL, content="5", additional_kwargs={"tool_call_id": "c1", "name": "add"}),
        ]
    )
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "tool"]
    assert msgs[2]["tool_calls"][0]["function"] == {"name": "add", "arguments": {"a": 2, "b": 3}}
    assert msgs[3] == {"role": "tool", "content": "5", "tool_call_id": "c1", "name": "add"}


def test_chat_complete_stream_agree(llm):
    msgs = [ChatMessage(role=MessageRole.USER, content="Hello there")]
    chat = llm.chat(msgs)
    assert chat.message.role == MessageRole.ASSISTANT
    assert chat.raw["usage"]["completion_tokens"] > 0 and chat.raw["method"] == "safe"
    assert llm.complete("Hello there").text == chat.message.content
    parts = list(llm.stream_chat(msgs))
    assert "".join(p.delta for p in parts) == chat.message.content
    assert all(p.message.content == "".join(q.delta for q in parts[: i + 1]) for i, p in enumerate(parts))
    parts = list(llm.stream_complete("Hello there"))
    assert parts[-1].text == chat.message.content == "".join(p.delta for p in parts)


async def test_async_paths_do_not_block(llm, loop_ticks):
    msgs = [ChatMessage(role=MessageRole.USER, content="Hello there")]
    ref = llm.chat(msgs).message.content
    async with loop_ticks() as ticks:
        res = await llm.achat(msgs)
        comp = await llm.acomplete("Hello there")
        gen = await llm.astream_chat(msgs)
        deltas = [r.delta async for r in gen]
        gen = await llm.astream_complete("Hello there")
        last = [r async for r in gen][-1]
    assert res.message.content == comp.text == "".join(deltas) == last.text == ref
    assert ticks[0] > 3


def test_system_prompt_is_applied(pair, llm):
    with_sys = EnsembleLLM(members=pair, max_new_tokens=12, system_prompt="Answer in French.", progress=False)
    msgs = with_sys._messages([ChatMessage(role=MessageRole.USER, content="hi")])
    assert msgs[0] == {"role": "system", "content": "Answer in French."}
    kept = with_sys._messages(
        [ChatMessage(role=MessageRole.SYSTEM, content="mine"), ChatMessage(role=MessageRole.USER, content="hi")]
    )
    assert kept[0]["content"] == "mine" and len(kept) == 2


def test_token_counting_handler(pair):
    counter = TokenCountingHandler()
    llm = EnsembleLLM(members=pair, max_new_tokens=8, progress=False, callback_manager=CallbackManager([counter]))
    res = llm.chat([ChatMessage(role=MessageRole.USER, content="Hello")])
    assert counter.completion_llm_token_count == res.raw["usage"]["completion_tokens"] > 0
    assert counter.prompt_llm_token_count == res.raw["usage"]["prompt_tokens"] > 0


def test_errors_surface(tiny_dirs):
    small = EnsembleLLM(members=[tiny_dirs["smol_short"]], max_new_tokens=4, progress=False)
    long = "word " * 200
    with pytest.raises(RequestError, match="context window"):
        small.complete(long)
    with pytest.raises(RequestError, match="context window"):
        list(small.stream_chat([ChatMessage(role=MessageRole.USER, content=long)]))
    with pytest.raises(RequestError, match="context window"):
        asyncio.run(small.achat([ChatMessage(role=MessageRole.USER, content=long)]))
    with pytest.raises(TypeError, match="unsupported call arguments"):
        small.complete("hi", frequency_penalty=1.0)
    assert isinstance(small.complete("hi").text, str)


def test_tools_forced_and_parsed(llm):
    kw = llm._prepare_chat_with_tools([ADD], user_msg="What is 2 + 3?", tool_required=True)
    assert kw["tool_choice"] == "required" and kw["tools"][0]["function"]["name"] == "add"
    # the forced syntax counts toward the budget like every written token: a call needs ~30
    res = llm.chat_with_tools([ADD], user_msg="What is 2 + 3?", tool_required=True, max_new_tokens=64)
    (sel,) = llm.get_tool_calls_from_response(res)
    assert sel.tool_name == "add" and set(sel.tool_kwargs) == {"a", "b"} and sel.tool_id
    assert ADD.call(**sel.tool_kwargs).raw_output == sel.tool_kwargs["a"] + sel.tool_kwargs["b"]
    plain = llm.chat([ChatMessage(role=MessageRole.USER, content="hi")])
    assert llm.get_tool_calls_from_response(plain, error_on_no_tool_call=False) == []
    with pytest.raises(ValueError, match="Expected at least one tool call"):
        llm.get_tool_calls_from_response(plain)
    last = list(llm.stream_chat_with_tools([ADD], user_msg="2 + 3?", tool_required=True, max_new_tokens=64))[-1]
    assert [s.tool_name for s in llm.get_tool_calls_from_response(last)] == ["add"]


def test_structured_predict(llm):
    from llama_index.core.prompts import PromptTemplate

    class Person(BaseModel):
        """A person."""

        name: str = Field(max_length=6)  # random-weight members: bounded, so the noise ends in the budget
        age: int = Field(ge=0, le=150)

    out = llm.structured_predict(
        Person, PromptTemplate("Describe {who}."), who="Ada Lovelace", llm_kwargs={"max_new_tokens": 48}
    )
    assert isinstance(out, Person) and 0 <= out.age <= 150 and len(out.name) <= 6


def test_reply_blocks(llm):
    res = llm.chat_with_tools([ADD], user_msg="2+3?", tool_required=True, max_new_tokens=64)
    assert any(isinstance(b, ToolCallBlock) for b in res.message.blocks)
    assert not any(isinstance(b, TextBlock) and b.text for b in res.message.blocks)


def test_logprobs_filled_in_complete_chat_and_streams(pair):
    llm = EnsembleLLM(members=pair, method="safe", max_new_tokens=6, temperature=0, logprobs=True, top_logprobs=2)
    res = llm.complete("Name a color.")
    assert b"".join(bytes(tok[0].bytes) for tok in res.logprobs) == res.text.encode()
    (want,) = llm.engine.score([{"role": "user", "content": "Name a color."}], [res.text], raw=False, top=2)
    assert [tok[0].token for tok in res.logprobs] == [t.token for t in want.tokens]
    assert all(abs(tok[0].logprob - t.logprob) < 1e-9 for tok, t in zip(res.logprobs, want.tokens))
    assert all(1 <= len(tok) <= 3 for tok in res.logprobs)  # the token, then its alternatives
    last = list(llm.stream_complete("Name a color."))[-1]
    assert last.logprobs == res.logprobs  # greedy: the same reply
    chat = llm.chat([ChatMessage(role="user", content="Name a color.")])
    assert chat.logprobs == res.logprobs
    assert asyncio.run(llm.acomplete("Name a color.")).logprobs == res.logprobs
    assert EnsembleLLM(members=pair, method="safe", max_new_tokens=2).complete("Hi").logprobs is None
    with pytest.raises(ValueError, match="top_logprobs needs logprobs"):
        EnsembleLLM(members=pair, top_logprobs=2)
