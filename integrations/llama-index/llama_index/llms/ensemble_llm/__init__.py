"""LlamaIndex LLM backed by ensemble-llm."""

from llama_index.llms.ensemble_llm.base import EnsembleLLM

__all__ = ["EnsembleLLM"]
