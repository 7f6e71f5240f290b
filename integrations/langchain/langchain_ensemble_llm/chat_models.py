"""`EnsembleLLM`: a LangChain chat model over an `ensemble_llm.Ensemble`.

The facade only translates: LangChain messages and tools in, `AIMessage`s (content, tool calls,
usage, metadata) out. Prompt building per member, tool protocol, tool-call parsing, stop strings
and the request queue all live in the engine, shared with the LlamaIndex facade.
"""

from __future__ import annotations

import json
from operator import itemgetter
from typing import Any, AsyncIterator, Callable, Iterator, Literal, Sequence

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel, LanguageModelInput
from langchain_core.language_models.chat_models import LangSmithParams
from langchain_core.messages import (
    AIMessage,
    AIMessageChunk,
    BaseMessage,
    ChatMessage,
    HumanMessage,
    SystemMessage,
    ToolMessage,
)
from langchain_core.output_parsers import JsonOutputParser, PydanticOutputParser
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from langchain_core.runnables import Runnable, RunnableMap, RunnablePassthrough
from langchain_core.tools import BaseTool
from langchain_core.utils.function_calling import convert_to_json_schema, convert_to_openai_tool
from langchain_core.utils.pydantic import is_basemodel_subclass
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, SecretStr, model_validator

from ensemble_llm import GenerationParams, RequestError, defaults
from ensemble_llm.chat import content_text
from ensemble_llm.client import RemoteEnsemble
from ensemble_llm.logprobs import areply_logprobs, check_facade_call, check_facade_options, reply_logprobs
from ensemble_llm.params import call_params
from ensemble_llm.results import GenerationResult
from ensemble_llm.sharing import ENGINE_OPTIONS, check_model_id
from ensemble_llm.stopping import stop_list
from ensemble_llm.tools import check_tool_choice

# per-call keyword arguments that LangChain or its agents may pass and that we understand
_CALL_KEYS = {
    "tools",
    "tool_choice",
    "max_tokens",
    "max_new_tokens",
    "temperature",
    "top_p",
    "seed",
    "model",
    "response_format",
    "trace",
}
# keyword arguments LangChain passes through that carry no generation setting for us
_PASSTHROUGH = {"ls_structured_output_format", "parallel_tool_calls", "strict", "stream"}


def _role_of(message: BaseMessage) -> str:
    if isinstance(message, SystemMessage):
        return "system"
    if isinstance(message, HumanMessage):
        return "user"
    if isinstance(message, AIMessage):
        return "assistant"
    if isinstance(message, ToolMessage):
        return "tool"
    if isinstance(message, ChatMessage):
        role = {"human": "user", "ai": "assistant", "developer": "system"}.get(message.role, message.role)
        if role in ("system", "user", "assistant", "tool"):
            return role
    raise ValueError(
        f"EnsembleLLM cannot send a {type(message).__name__} (role "
        f"{getattr(message, 'role', message.type)!r}); use system, human, ai or tool messages."
    )


def to_engine_messages(messages: Sequence[BaseMessage]) -> list[dict]:
    """LangChain messages -> the engine's {'role', 'content', ...} dicts."""
    out = []
    for m in messages:
        role = _role_of(m)
        # the content blocks of an input message go as they are, so the engine can name a block
        # (an image, audio) that these text-only members cannot read instead of dropping it; an
        # AI message's non-text blocks (tool-call blocks) travel in tool_calls below
        as_is = (
            isinstance(m.content, list)
            and role != "assistant"
            and not all(
                isinstance(b, str) or (isinstance(b, dict) and b.get("type", "text") == "text") for b in m.content
            )
        )
        msg: dict[str, Any] = {"role": role, "content": m.content if as_is else content_text(m.content)}
        if m.name:
            msg["name"] = m.name
        if isinstance(m, AIMessage) and m.tool_calls:
            msg["tool_calls"] = [
                {
                    "id": c.get("id") or f"call_{i}",
                    "type": "function",
                    "function": {"name": c["name"], "arguments": c.get("args") or {}},
                }
                for i, c in enumerate(m.tool_calls)
            ]
        if isinstance(m, ToolMessage):
            msg["tool_call_id"] = m.tool_call_id
            if m.status == "error":
                msg["content"] = f"Error: {content_text(m.content)}"
        out.append(msg)
    return out


class EnsembleLLM(BaseChatModel):
    """Chat model whose replies come from several local LMs decoded together.

    Example:
        ```python
        from langchain_ensemble_llm import EnsembleLLM

        llm = EnsembleLLM(members=["smollm2-135m-instruct", "gemma-3-270m"])  # auto, the default for 2+ members
        llm.invoke("What is the capital of France?")
        ```

    Constructor arguments are those of `ensemble_llm.Ensemble` plus LangChain's usual sampling
    fields. Nothing loads at construction; the first call loads the weights, once per process for
    every instance with the same members, method and devices (`Ensemble.shared`). Pass `engine=`
    to share an `Ensemble` you built yourself (for instance with a LlamaIndex `EnsembleLLM`).
    """

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True, protected_namespaces=())

    model: str | None = None
    """The model's id, as ChatOpenAI and ChatOllama have it. In process it is `method:member+member`
    (set from `members` and `method`, which choose the models; a different value is an error).
    Client mode: the served model to ask for (the server's id, its method name, or "ensemble", the default)."""
    members: list[str | dict[str, Any]] | None = None
    """Bundled names, local folders, local .gguf files or cached hub ids (default: the bundled pair), or
    {"model": ..., "preamble": [messages]} dicts that give one member its own preamble."""
    method: str | None = None
    """"single", "unite", "safe", "specfuse", "smc" or "auto" (the default for two or more members:
    specfuse for raw prompts, safe for chat)."""
    config: Any = None
    """The method's config: its dataclass (e.g. `SafeConfig(lookahead=4)`) or a dict."""
    device: Any = "auto"
    dtype: Any = "auto"
    cache_dir: str | None = None
    trust_remote_code: bool = False
    progress: bool = True
    placement: str = "local"
    """"local" (members in this process) or "ray" (each member in a Ray actor, on this machine or a cluster)."""
    ray_address: str | None = None
    """placement="ray": the cluster to join ("auto", "ray://HEAD:10001"); None starts a local one."""
    member_resources: dict[str, float] | list[dict[str, float]] | None = None
    """placement="ray": Ray resources per member actor, one dict for all or one each, e.g. {"num_gpus": 1}."""
    max_batch: int | Literal["auto"] = "auto"
    """Requests run at once, their forwards batched per member ("auto": 8 on CPU, 32 on CUDA, 1 on Ray)."""
    kv_budget: int | float | str | None = "auto"
    """KV-cache bytes the running requests may hold per device; others wait, one that never fits is refused
    ("auto": 90% of free GPU memory, half the free RAM; "2GB"; None: no limit)."""

    temperature: float = Field(default=defaults.TEMPERATURE, ge=0.0)
    """0 = greedy."""
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    max_tokens: int = Field(default=defaults.MAX_NEW_TOKENS, gt=0)
    """Most new tokens per reply (the drafter's tokens)."""
    stop: list[str] | None = None
    seed: int | None = None
    timeout: float | None = Field(default=None, gt=0)
    """Seconds a call may run before it raises `ensemble_llm.RequestTimeout` (None: no limit)."""
    max_retries: int = Field(default=0, ge=0, le=100)
    """Times a call that failed inside generation (`ensemble_llm.GenerationError`) is run again,
    within the same `timeout` (a streamed call only before it showed text)."""
    streaming: bool = False
    logprobs: bool = False
    """Put the reply's tokens with the ensemble's log-probabilities in `response_metadata["logprobs"]`
    (`{"content": [{"token", "logprob", "bytes", "top_logprobs", "members"}]}`, docs/scoring.md)."""
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    """With `logprobs`: that many alternatives per token."""
    base_url: str | None = None
    """Client mode: the URL of a served ensemble (`ensemble-llm serve`), e.g.
    "http://127.0.0.1:8000/v1"; nothing loads here, and `max_retries` retries transport failures."""
    api_key: SecretStr | None = None
    """The served ensemble's API key (client mode); accepted and unused in process."""
    engine: Any = Field(default=None, exclude=True)
    """An existing engine to share (an `ensemble_llm.Ensemble`); its members and method win over
    the fields above."""

    _let_go: Any = PrivateAttr(default=None)  # ends this facade's hold on a shared engine (None: engine= given)

    @model_validator(mode="after")
    def _build_engine(self) -> "EnsembleLLM":
        check_facade_options(self.logprobs, self.top_logprobs, self.base_url is not None)
        if self.base_url is not None:  # client mode: the engine is the server's
            key = self.api_key.get_secret_value() if self.api_key is not None else None
            self.model = self.model or "ensemble"
            self.engine = RemoteEnsemble(
                self.base_url, key, max_retries=self.max_retries, timeout=self.timeout, model=self.model
            )
        else:
            # Ensemble validates members, method, config and devices and names the bad one
            from ensemble_llm.engine import Ensemble  # torch loads when a facade is built, not imported

            self.engine, self._let_go = Ensemble.shared_or_given(
                self.engine,
                self.members,
                self.method,
                self.config,
                self,
                **{k: getattr(self, k) for k in ENGINE_OPTIONS},
            )
            self.members = self.engine.model_names
            self.method = self.engine.method_name
            self.model = check_model_id(self.model, self.model_name)
        if self.profile is None:
            self.profile = {
                "tool_calling": True,
                "tool_choice": True,
                "structured_output": True,
                "text_inputs": True,
                "text_outputs": True,
                "temperature": True,
            }
        return self

    def close(self) -> None:
        """Let go of the shared engine now (also done when this object is garbage-collected); when no
        other EnsembleLLM holds it, its members are freed, and a later call loads them again. An
        `engine=` you passed stays yours to close."""
        if self._let_go is not None:
            self._let_go()

    # ---- identity ------------------------------------------------------------------------
    @property
    def model_name(self) -> str:
        if self.base_url is not None:
            return f"ensemble-llm@{self.base_url}"
        return f"{self.method}:{'+'.join(self.members or [])}"

    @property
    def _llm_type(self) -> str:
        return "ensemble-llm"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {
            "members": self.members,
            "method": self.method,
            "config": repr(getattr(self.engine, "config", None)),
            "base_url": self.base_url,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "max_tokens": self.max_tokens,
        }

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        params = LangSmithParams(
            ls_provider="ensemble_llm",
            ls_model_name=kwargs.get("model") or self.model_name,
            ls_model_type="chat",
            ls_temperature=kwargs.get("temperature", self.temperature),
        )
        max_tokens = kwargs.get("max_tokens", self.max_tokens)
        if max_tokens:
            params["ls_max_tokens"] = max_tokens
        if stop or self.stop:
            params["ls_stop"] = stop or self.stop
        return params

    def get_token_ids(self, text: str) -> list[int]:
        """Token ids of `text` in the main member's tokenizer (loads the members)."""
        if self.base_url is not None:  # client mode: the members' tokenizers are on the server
            return list(text.encode("utf-8"))  # an upper bound: one id per UTF-8 byte
        members = self.engine.members
        return members[self.engine.member_weights("chat")[1]].encode(text)

    # ---- tools ---------------------------------------------------------------------------
    def bind_tools(
        self,
        tools: Sequence[dict[str, Any] | type | Callable | BaseTool],
        *,
        tool_choice: str | dict | bool | None = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, AIMessage]:
        """Bind tools (any form `convert_to_openai_tool` takes). tool_choice: None/"auto", "none",
        "any"/"required"/True (a call is forced), a tool name or {"type": "function", ...}."""
        formatted = [convert_to_openai_tool(t) for t in tools]
        check_tool_choice(tool_choice, formatted)  # fail here, not at the first call
        return super().bind(tools=formatted, tool_choice=tool_choice, **kwargs)

    def with_structured_output(
        self,
        schema: dict | type | None = None,
        *,
        method: str = "json_schema",
        include_raw: bool = False,
        strict: bool | None = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, dict | BaseModel]:
        """Replies parsed into `schema` (a pydantic model, a TypedDict, or a JSON Schema dict).

        method="json_schema" (default): the reply is constrained to the schema's grammar
        (llguidance), so it always parses and validates. "json_mode": a JSON object; when a schema
        is given it constrains the reply as well (a local grammar costs nothing extra, and a small
        model left to the prompt adds keys of its own). "function_calling": a forced call of a tool
        shaped like the schema (also grammar-constrained). `strict` is accepted for compatibility:
        every method here is strict."""
        if kwargs:
            raise ValueError(f"Received unsupported arguments {kwargs}")
        if method == "function_calling":
            return super().with_structured_output(schema, include_raw=include_raw)
        if method not in ("json_schema", "json_mode"):
            raise ValueError(f"method must be 'json_schema', 'json_mode' or 'function_calling', got {method!r}")
        is_model = isinstance(schema, type) and is_basemodel_subclass(schema)
        if method == "json_schema" and schema is None:
            raise ValueError("method='json_schema' needs a schema (a pydantic model, a TypedDict or a dict)")
        if schema is not None:
            if is_model:  # pydantic 2, or a pydantic.v1 model
                json_schema = schema.model_json_schema() if hasattr(schema, "model_json_schema") else schema.schema()
            elif isinstance(schema, dict) and "title" not in schema and ("properties" in schema or "type" in schema):
                json_schema = schema  # a plain JSON Schema (LangChain's converter wants a title to name a function)
            else:
                json_schema = convert_to_json_schema(schema)
            name = json_schema.get("title") or "response"
            fmt = {"type": "json_schema", "json_schema": {"name": name, "schema": json_schema, "strict": True}}
        else:
            fmt = {"type": "json_object"}
        llm = self.bind(
            response_format=fmt, ls_structured_output_format={"kwargs": {"method": method}, "schema": schema}
        )
        parser = PydanticOutputParser(pydantic_object=schema) if is_model else JsonOutputParser()
        if include_raw:
            assign = RunnablePassthrough.assign(parsed=itemgetter("raw") | parser, parsing_error=lambda _: None)
            none = RunnablePassthrough.assign(parsed=lambda _: None)
            return RunnableMap(raw=llm) | assign.with_fallbacks([none], exception_key="parsing_error")
        return llm | parser

    # ---- generation ----------------------------------------------------------------------
    def _convert_input(self, model_input: LanguageModelInput) -> Any:
        """LangChain's conversion, after a check it lacks: a tool message given as a dict or a
        ("tool", text) tuple without a tool_call_id is a RequestError naming the message (LangChain
        itself fails on it with a bare KeyError)."""
        if isinstance(model_input, (list, tuple)):
            for i, m in enumerate(model_input):
                if isinstance(m, dict):
                    role, call_id = m.get("role", m.get("type")), m.get("tool_call_id")
                elif isinstance(m, (list, tuple)) and len(m) == 2 and isinstance(m[0], str):
                    role, call_id = m[0], None
                else:
                    continue
                if role == "tool" and not (isinstance(call_id, str) and call_id):
                    raise RequestError(
                        f"message {i} (tool) has no tool_call_id (got {call_id!r}); a tool result must name "
                        "the call it answers: use ToolMessage(content, tool_call_id=...) or "
                        "{'role': 'tool', 'content': ..., 'tool_call_id': ...} with the id of that call."
                    )
        return super()._convert_input(model_input)

    def _request(self, stop: list[str] | None, kwargs: dict[str, Any]) -> GenerationParams:
        unknown = set(kwargs) - _CALL_KEYS - _PASSTHROUGH
        if unknown:
            raise ValueError(
                f"EnsembleLLM got unsupported call arguments {sorted(unknown)}; it takes {sorted(_CALL_KEYS)}."
            )
        model = kwargs.get("model")
        if model is not None and model not in (self.model_name, self.model):
            raise ValueError(
                f"EnsembleLLM cannot switch to model {model!r} per call; build another "
                f"EnsembleLLM(members=[...]) (this one is {self.model_name!r})."
            )
        # a string is ONE stop string (as in LlamaIndex and OpenAI), never its characters
        stops = stop_list(self.stop, stop)  # duplicates are harmless: StopMatcher drops them
        model_fields = {
            "max_new_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "seed": self.seed,
            "timeout": self.timeout,
            "max_retries": 0 if self.base_url is not None else self.max_retries,
        }
        params = call_params(kwargs, model_fields, stops)  # the core's one builder (its precedence)
        check_facade_call(self.logprobs, params)
        return params

    def _metadata(self, result: GenerationResult, logprobs: dict | None = None) -> dict[str, Any]:
        out = {
            "model_name": self.model_name,
            "members": result.models,
            "method": result.method,
            "finish_reason": result.finish_reason,
            "stats": result.stats,
        }
        return out if logprobs is None else {**out, "logprobs": logprobs}

    @staticmethod
    def _usage(result: GenerationResult) -> dict[str, Any]:
        """usage_metadata; prompt tokens whose KV came from a stored prompt are its cache reads."""
        u = result.usage
        out: dict[str, Any] = {
            "input_tokens": u.prompt_tokens,
            "output_tokens": u.completion_tokens,
            "total_tokens": u.total_tokens,
        }
        if u.cached_tokens:
            out["input_token_details"] = {"cache_read": u.cached_tokens}
        return out

    def _reply_logprobs(self, prompt: Any, result: GenerationResult) -> dict[str, Any] | None:
        """The reply's log-probabilities (`logprobs=True`): the ensemble's score of its text."""
        return reply_logprobs(self.engine, prompt, result.text, top=self.top_logprobs or 0) if self.logprobs else None

    async def _areply_logprobs(self, prompt: Any, result: GenerationResult) -> dict[str, Any] | None:
        if not self.logprobs:
            return None
        return await areply_logprobs(self.engine, prompt, result.text, top=self.top_logprobs or 0)

    @staticmethod
    def _chat_result(message: AIMessage) -> ChatResult:
        meta = message.response_metadata  # generation_info as ChatOpenAI gives it: finish_reason, logprobs
        info = {k: meta[k] for k in ("finish_reason", "logprobs") if k in meta}
        return ChatResult(generations=[ChatGeneration(message=message, generation_info=info)])

    def _message(self, result: GenerationResult, logprobs: dict | None = None) -> AIMessage:
        calls = [{"name": c.name, "args": c.arguments, "id": c.id, "type": "tool_call"} for c in result.tool_calls]
        return AIMessage(
            content=result.text,
            tool_calls=calls,
            usage_metadata=self._usage(result),
            response_metadata=self._metadata(result, logprobs),
        )

    def _last_chunk(self, result: GenerationResult, logprobs: dict | None = None) -> ChatGenerationChunk:
        chunks = [
            {
                "name": c.name,
                "args": json.dumps(c.arguments, ensure_ascii=False),
                "id": c.id,
                "index": i,
                "type": "tool_call_chunk",
            }
            for i, c in enumerate(result.tool_calls)
        ]
        msg = AIMessageChunk(
            content="",
            tool_call_chunks=chunks,
            usage_metadata=self._usage(result),
            response_metadata=self._metadata(result, logprobs),
            chunk_position="last",
        )
        return ChatGenerationChunk(message=msg, generation_info={"finish_reason": result.finish_reason})

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        request = self._request(stop, kwargs)
        prompt = to_engine_messages(messages)
        result = self.engine.generate(prompt, request)
        message = self._message(result, self._reply_logprobs(prompt, result))
        return self._chat_result(message)

    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        request = self._request(stop, kwargs)
        prompt = to_engine_messages(messages)
        result = await self.engine.agenerate(prompt, request)
        message = self._message(result, await self._areply_logprobs(prompt, result))
        return self._chat_result(message)

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        request = self._request(stop, kwargs)
        prompt = to_engine_messages(messages)
        stream = self.engine.stream(prompt, request)
        for delta in stream:
            chunk = ChatGenerationChunk(message=AIMessageChunk(content=delta))
            if run_manager:
                run_manager.on_llm_new_token(delta, chunk=chunk)
            yield chunk
        yield self._last_chunk(stream.result, self._reply_logprobs(prompt, stream.result))

    async def _astream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[ChatGenerationChunk]:
        request = self._request(stop, kwargs)
        prompt = to_engine_messages(messages)
        stream = self.engine.astream(prompt, request)
        async for delta in stream:
            chunk = ChatGenerationChunk(message=AIMessageChunk(content=delta))
            if run_manager:
                await run_manager.on_llm_new_token(delta, chunk=chunk)
            yield chunk
        yield self._last_chunk(stream.result, await self._areply_logprobs(prompt, stream.result))


__all__ = ["EnsembleLLM", "to_engine_messages"]
