"""LangChain's own standard test suites (langchain-tests) against EnsembleLLM.

Unit suite: no weights load (construction is lazy). Integration suite: the real bundled pair
with the default method (specfuse), greedy, on transformers: on llama.cpp the suite's
test_unicode_tool_call_integration flips between runs (the Japanese name came out as "Hello
Corporation" inside the suite and right alone), as llama.cpp's numerics move with where a prompt
sits in the KV cache (docs/benchmarks/llama_speed.md); tests/test_llama.py runs the facades there.
"""

from __future__ import annotations

import pytest
from helpers import HF_PAIR  # noqa: E402
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
        return {"members": HF_PAIR, "max_tokens": 24, "progress": False}

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

        proc, base = start_server(HF_PAIR, "specfuse", api_key="test-key")
        atexit.register(lambda: (proc.terminate(), proc.wait(timeout=30)))
        _SERVED["url"] = base + "/v1"
    return _SERVED["url"]


# What client mode changes is the transport (HTTP, the openai client, server-sent events, usage and
# tool calls in OpenAI's shapes): the client-mode class runs the suite's tests of those paths; the
# in-process class above runs the whole suite (structured output included) on the same engine code.
CLIENT_TESTS = {
    "test_invoke",
    "test_ainvoke",
    "test_stream",
    "test_astream",
    "test_stream_time",
    "test_batch",
    "test_abatch",
    "test_conversation",
    "test_message_with_name",
    "test_stop_sequence",
    "test_usage_metadata",
    "test_usage_metadata_streaming",
    "test_tool_calling",
    "test_tool_calling_async",
    "test_tool_choice",
    "test_tool_message_histories_string_content",
    "test_unicode_tool_call_integration",
    "test_json_mode",
}


@pytest.mark.real
class TestEnsembleLLMClientIntegration(ChatModelIntegrationTests):
    """The suite's transport tests against a served ensemble: EnsembleLLM(base_url=..., api_key=...)."""

    @pytest.fixture(autouse=True)
    def _transport_tests_only(self, request):
        if request.node.originalname not in CLIENT_TESTS:
            pytest.skip("client mode runs the suite's transport tests (CLIENT_TESTS); in process runs all")

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
