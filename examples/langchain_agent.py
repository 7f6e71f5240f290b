"""An agent from `langchain.agents.create_agent` with EnsembleLLM and one tool.

Models of 135M/270M parameters rarely decide on their own when to call a tool, and once they have
seen a call they tend to repeat it. A small middleware sets the agent's tool_choice per turn:
"any" until a tool has answered (EnsembleLLM then writes the call field by field), "none" after
it, so the model answers from the tool's result and the loop ends.

    pip install -e "./integrations/langchain[examples]"
    python examples/langchain_agent.py
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from langchain.agents import create_agent  # noqa: E402
from langchain.agents.middleware import wrap_model_call  # noqa: E402
from langchain_core.messages import ToolMessage  # noqa: E402
from langchain_core.tools import tool  # noqa: E402
from langchain_ensemble_llm import EnsembleLLM  # noqa: E402


@tool
def get_population(city: str) -> str:
    """Look up the population of a city."""
    known = {"paris": "about 2.1 million", "tokyo": "about 14 million", "lima": "about 10 million"}
    return known.get(city.strip().lower(), "unknown")


@wrap_model_call
def tool_then_answer(request, handler):
    """Require a tool call until a tool has answered, then require a plain answer."""
    answered = any(isinstance(m, ToolMessage) for m in request.messages)
    return handler(request.override(tool_choice="none" if answered else "any"))


def main(max_tokens: int = 48) -> dict:
    llm = EnsembleLLM(members=["smollm2-135m-instruct", "gemma-3-270m"], max_tokens=max_tokens)
    agent = create_agent(
        llm,
        tools=[get_population],
        middleware=[tool_then_answer],
        system_prompt="You answer questions about cities. Use the tool.",
    )
    state = agent.invoke({"messages": [{"role": "user", "content": "What is the population of Paris?"}]})
    for m in state["messages"]:
        print(f"{m.type}: {m.content or m.tool_calls}")
    return state


if __name__ == "__main__":
    main()
