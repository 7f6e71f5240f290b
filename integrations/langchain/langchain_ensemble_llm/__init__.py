"""LangChain chat model backed by ensemble-llm."""

from .chat_models import EnsembleLLM

__all__ = ["EnsembleLLM"]
