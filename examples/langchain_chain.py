"""LCEL chain: prompt | EnsembleLLM | StrOutputParser, invoked and streamed.

python examples/langchain_chain.py
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from langchain_core.output_parsers import StrOutputParser  # noqa: E402
from langchain_core.prompts import ChatPromptTemplate  # noqa: E402
from langchain_ensemble_llm import EnsembleLLM  # noqa: E402


def main(max_tokens: int = 48) -> dict:
    llm = EnsembleLLM(members=["smollm2-135m-instruct", "gemma-3-270m"], max_tokens=max_tokens)
    prompt = ChatPromptTemplate.from_messages([("system", "You are a concise assistant."), ("human", "{question}")])
    chain = prompt | llm | StrOutputParser()
    answer = chain.invoke({"question": "What is the capital of France?"})
    print("invoke:", answer)
    print("stream: ", end="", flush=True)
    pieces = []
    for piece in chain.stream({"question": "Name a primary colour."}):
        pieces.append(piece)
        print(piece, end="", flush=True)
    print()
    return {"answer": answer, "streamed": pieces}


if __name__ == "__main__":
    main()
