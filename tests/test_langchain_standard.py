"""LangChain's own standard test suites (langchain-tests) against EnsembleLLM.

Unit suite: no weights load (construction is lazy). Integration suite: the real bundled pair
(SmolLM2-135M-Instruct drafting, Gemma-3-270M verifying) with method "safe", greedy.
"""

from __future__ import annotations

import pytest
from langchain_ensemble_llm import EnsembleLLM
from langchain_tests.integration_tests import ChatModelIntegrationTests
from langchain_tests.unit_tests import ChatModelUnitTests

PAIR = ["smollm2-135m-instruct", "gemma-3-270m"]


class TestEnsembleLLMUnit(ChatModelUnitTests):
    @property
    def chat_model_class(self):
        return EnsembleLLM

    @property
    def chat_model_params(self):
        return {"members": PAIR, "method": "safe", "progress": False}


@pytest.mark.real
class TestEnsembleLLMIntegration(ChatModelIntegrationTests):
    @property
    def chat_model_class(self):
        return EnsembleLLM

    @property
    def chat_model_params(self):
        # the budget LangChain's suite is meant to pass with: a forced call's fixed start is in the
        # prompt, its arguments close within the budget (budget-aware closing)
        return {"members": PAIR, "method": "safe", "max_tokens": 24, "progress": False}

    @property
    def has_structured_output(self) -> bool:
        return True  # with_structured_output: json_schema (default), json_mode, function_calling

    @property
    def supports_json_mode(self) -> bool:
        return True

    @pytest.mark.xfail(
        reason="capability: a 135M/270M model does not decide on its own (tool_choice=None) "
        "to call a tool; required calls (tool_choice='any' or a name) work and pass "
        "test_tool_calling, test_tool_choice and the structured-output tests"
    )
    def test_agent_loop(self, model) -> None:
        super().test_agent_loop(model)


_SERVED: dict[str, str] = {}


def _served_pair() -> str:
    """The real pair served once in a separate process (`ensemble-llm serve`) for the client-mode
    suite; stopped when the test session ends."""
    if "url" not in _SERVED:
        import atexit

        from helpers import start_server

        proc, base = start_server(PAIR, "safe", api_key="test-key")
        atexit.register(lambda: (proc.terminate(), proc.wait(timeout=30)))
        _SERVED["url"] = base + "/v1"
    return _SERVED["url"]


@pytest.mark.real
class TestEnsembleLLMClientIntegration(ChatModelIntegrationTests):
    """The same suite against a served ensemble: EnsembleLLM(base_url=..., api_key=...)."""

    @property
    def chat_model_class(self):
        return EnsembleLLM

    @property
    def chat_model_params(self):
        return {"base_url": _served_pair(), "api_key": "test-key", "max_tokens": 64}

    @property
    def has_structured_output(self) -> bool:
        return True

    @property
    def supports_json_mode(self) -> bool:
        return True

    @pytest.mark.xfail(
        reason="capability: a 135M/270M model does not decide on its own (tool_choice=None) "
        "to call a tool; required calls work"
    )
    def test_agent_loop(self, model) -> None:
        super().test_agent_loop(model)
