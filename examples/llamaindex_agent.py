"""A LlamaIndex FunctionAgent with EnsembleLLM and one tool.

Models of 135M/270M parameters rarely decide on their own to call a tool, so the agent's first
turn requires the tool (`initial_tool_choice`); EnsembleLLM writes the call field by field, the
agent runs the tool and the model answers from its result.

    python examples/llamaindex_agent.py
"""

from __future__ import annotations

import asyncio
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from llama_index.core.agent.workflow import FunctionAgent  # noqa: E402
from llama_index.core.tools import FunctionTool  # noqa: E402
from llama_index.llms.ensemble_llm import EnsembleLLM  # noqa: E402


def get_population(city: str) -> str:
    """Look up the population of a city."""
    known = {"paris": "about 2.1 million", "tokyo": "about 14 million", "lima": "about 10 million"}
    return known.get(city.strip().lower(), "unknown")


async def run(max_new_tokens: int = 48):
    llm = EnsembleLLM(members=["smollm2-135m-instruct", "gemma-3-270m"], max_new_tokens=max_new_tokens)
    agent = FunctionAgent(
        tools=[FunctionTool.from_defaults(fn=get_population)],
        llm=llm,
        system_prompt="You answer questions about cities. Use the tool.",
        initial_tool_choice="get_population",
    )
    handler = agent.run("What is the population of Paris?")
    calls = []
    async for event in handler.stream_events():
        if type(event).__name__ == "ToolCallResult":
            calls.append((event.tool_name, event.tool_kwargs, str(event.tool_output)))
            print(f"tool {event.tool_name}({event.tool_kwargs}) -> {event.tool_output}")
    response = await handler
    print("answer:", response.response.content)
    return {"calls": calls, "answer": response.response.content}


def main(max_new_tokens: int = 48) -> dict:
    return asyncio.run(run(max_new_tokens))


if __name__ == "__main__":
    main()
