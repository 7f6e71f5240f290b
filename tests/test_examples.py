"""Every script in examples/ runs end to end on the real bundled pair (marker `real`)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytestmark = pytest.mark.real
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.fixture
def no_network():
    """Any attempt to open an internet socket fails the test (unix sockets, used by asyncio, stay)."""
    import pytest_socket

    pytest_socket.disable_socket(allow_unix_socket=True)
    yield
    pytest_socket.enable_socket()


def load(name):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_every_example_has_a_test():
    tested = {"langchain_chain", "langchain_rag", "langchain_agent", "llamaindex_rag", "llamaindex_agent"}
    assert {p.stem for p in EXAMPLES.glob("*.py")} == tested


def test_langchain_chain():
    out = load("langchain_chain").main(max_tokens=24)
    assert "Paris" in out["answer"]
    assert len(out["streamed"]) > 1 and "".join(out["streamed"]).strip()


def test_langchain_rag_cites_the_right_source(no_network):
    out = load("langchain_rag").main(max_tokens=24)
    assert out["sources"] == ["peaks.txt"] and out["answer"].strip()


def test_langchain_agent_uses_the_tool():
    from langchain_core.messages import AIMessage, ToolMessage

    msgs = load("langchain_agent").main(max_tokens=32)["messages"]
    calls = [c for m in msgs if isinstance(m, AIMessage) for c in m.tool_calls]
    assert calls and calls[0]["name"] == "get_population" and calls[0]["args"]["city"].lower() == "paris"
    assert any(isinstance(m, ToolMessage) and "2.1 million" in m.content for m in msgs)
    assert isinstance(msgs[-1], AIMessage) and not msgs[-1].tool_calls and msgs[-1].content.strip()


def test_llamaindex_rag_query_stream_async_chat(no_network):
    """Settings.llm = EnsembleLLM and an offline embedding: no step reaches for OpenAI or the network."""
    out = load("llamaindex_rag").main(max_new_tokens=24)
    assert out["sources"] == ["peaks.txt"] and "8,849" in out["answer"]
    assert len(out["streamed"]) > 1 and "1889" in "".join(out["streamed"])
    assert "Danube" in out["async"] and out["chat"].strip()


def test_llamaindex_agent_uses_the_tool(no_network):
    out = load("llamaindex_agent").main(max_new_tokens=32)
    assert out["calls"] and out["calls"][0][0] == "get_population" and "2.1 million" in out["calls"][0][2]
    assert out["answer"].strip()


def test_llamaindex_react_agent_completes():
    """ReActAgent drives EnsembleLLM through achat/astream_chat and finishes with an answer. (The
    135M/270M pair answers directly instead of writing the ReAct `Action:` format, so the tool
    is not called; FunctionAgent above is the way to use tools with these models.)"""
    import asyncio

    from llama_index.core.agent.workflow import ReActAgent
    from llama_index.core.tools import FunctionTool
    from llama_index.llms.ensemble_llm import EnsembleLLM

    agent_mod = load("llamaindex_agent")

    async def run():
        llm = EnsembleLLM(members=["smollm2-135m-instruct", "gemma-3-270m"], max_new_tokens=32, progress=False)
        agent = ReActAgent(tools=[FunctionTool.from_defaults(fn=agent_mod.get_population)], llm=llm)
        return await agent.run("What is the population of Paris?", max_iterations=6)

    assert str(asyncio.run(run()).response.content).strip()
