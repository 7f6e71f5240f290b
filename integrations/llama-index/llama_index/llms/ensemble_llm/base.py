"""`EnsembleLLM`: a LlamaIndex function-calling LLM over an `ensemble_llm.Ensemble`.

The facade only translates: LlamaIndex chat messages and tools in, `ChatResponse`s (content,
`ToolCallBlock`s, usage in `raw`) out. Prompts per member, the tool protocol, tool-call parsing,
stop strings and the request queue live in the engine, shared with the LangChain facade. Every
async method awaits the engine's own async API, so no event loop is ever blocked by generation.
"""

from __future__ import annotations

import warnings
from typing import Any, AsyncGenerator, Dict, Generator, List, Literal, Optional, Sequence, Union

from llama_index.core.base.llms.types import (
    ChatMessage,
    ChatResponse,
    ChatResponseAsyncGen,
    ChatResponseGen,
    CompletionResponse,
    CompletionResponseAsyncGen,
    CompletionResponseGen,
    LLMMetadata,
    LogProb,
    MessageRole,
    TextBlock,
    ToolCallBlock,
)
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.function_calling import FunctionCallingLLM
from llama_index.core.llms.llm import ToolSelection
from pydantic import ConfigDict, Field, PrivateAttr, SecretStr, model_validator

from ensemble_llm import GenerationParams, RequestError, defaults
from ensemble_llm.client import RemoteEnsemble
from ensemble_llm.logprobs import areply_logprobs, check_facade_call, check_facade_options, reply_logprobs
from ensemble_llm.params import call_params
from ensemble_llm.results import GenerationResult
from ensemble_llm.sharing import ENGINE_OPTIONS, check_model_id
from ensemble_llm.stopping import stop_list
from ensemble_llm.tools import check_tool_choice

_ROLES = {
    MessageRole.SYSTEM: "system",
    MessageRole.DEVELOPER: "system",
    MessageRole.USER: "user",
    MessageRole.ASSISTANT: "assistant",
    MessageRole.CHATBOT: "assistant",
    MessageRole.MODEL: "assistant",
    MessageRole.TOOL: "tool",
    MessageRole.FUNCTION: "tool",
}
_CALL_KEYS = {
    "tools",
    "tool_choice",
    "max_new_tokens",
    "max_tokens",
    "temperature",
    "top_p",
    "seed",
    "stop",
    "response_format",
    "trace",
}


def to_engine_messages(messages: Sequence[ChatMessage]) -> list[dict]:
    """LlamaIndex chat messages -> the engine's {'role', 'content', ...} dicts."""
    out = []
    for i, m in enumerate(messages):
        role = _ROLES.get(m.role)
        if role is None:
            raise ValueError(
                f"EnsembleLLM cannot send a message with role {m.role!r}; use system, user, assistant or tool."
            )
        text = "".join(b.text for b in m.blocks if isinstance(b, TextBlock))
        msg: dict[str, Any] = {"role": role, "content": text}
        calls = [b for b in m.blocks if isinstance(b, ToolCallBlock)]
        if role == "assistant" and calls:
            msg["tool_calls"] = [
                {
                    "id": c.tool_call_id or f"call_{i}",
                    "type": "function",
                    "function": {"name": c.tool_name, "arguments": c.tool_kwargs},
                }
                for i, c in enumerate(calls)
            ]
        extra = m.additional_kwargs or {}
        if role == "assistant" and not calls and extra.get("tool_calls"):  # OpenAI-style history
            msg["tool_calls"] = list(extra["tool_calls"])
        if role == "tool":
            if not (isinstance(extra.get("tool_call_id"), str) and extra["tool_call_id"]):
                raise RequestError(
                    f"message {i} (tool) has no tool_call_id (got {extra.get('tool_call_id')!r}); a tool result must "
                    "name the call it answers: ChatMessage(role='tool', content=..., additional_kwargs="
                    "{'tool_call_id': <the call's id>})."
                )
            msg["tool_call_id"] = extra["tool_call_id"]
            if extra.get("name"):
                msg["name"] = extra["name"]
        out.append(msg)
    return out


class EnsembleLLM(FunctionCallingLLM):
    """LlamaIndex LLM whose replies come from several local LMs decoded together.

    Example:
        ```python
        from llama_index.core import Settings
        from llama_index.llms.ensemble_llm import EnsembleLLM

        Settings.llm = EnsembleLLM(members=["smollm2-135m-instruct", "gemma-3-270m"])
        ```

    Constructor arguments are those of `ensemble_llm.Ensemble` plus sampling fields. Nothing loads
    at construction; the first call loads the weights, once per process for every instance with
    the same members, method and devices (`Ensemble.shared`). `engine=` shares an `Ensemble`,
    for instance with the LangChain `EnsembleLLM` in the same process.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True, extra="forbid")  # a misspelt argument is an error

    model: Optional[str] = Field(
        default=None,
        description="The model's id. In process `method:member+member`, set from members and method (a "
        'different value is an error); client mode: the served model to ask for (default "ensemble").',
    )
    members: Optional[List[Union[str, Dict[str, Any]]]] = Field(
        default=None,
        description="Bundled names, folders, .gguf files or cached hub ids; or "
        "{'model': ..., 'preamble': [messages]} dicts.",
    )
    method: Optional[str] = Field(
        default=None,
        description='"single", "unite", "safe", "specfuse", "smc" or "auto" (default auto for 2+ members: '
        "specfuse for raw prompts, safe for chat).",
    )
    config: Any = Field(default=None, description="The method's config dataclass or a dict.")
    device: Any = Field(default="auto", description='"auto", a device, or one device per member.')
    dtype: Any = Field(default="auto", description='"auto" (bf16 on CUDA, fp32 on CPU) or a torch dtype.')
    cache_dir: Optional[str] = Field(default=None, description="Where converted bundled models are cached.")
    trust_remote_code: bool = Field(default=False)
    progress: bool = Field(default=True, description="Show download/conversion progress bars.")
    placement: str = Field(
        default="local",
        description=(
            '"local" (members in this process) or "ray" (each member in a Ray actor, on this machine or a cluster).'
        ),
    )
    ray_address: Optional[str] = Field(
        default=None,
        description=('placement="ray": the cluster to join ("auto", "ray://HEAD:10001"); None starts a local one.'),
    )
    member_resources: Union[Dict[str, float], List[Dict[str, float]], None] = Field(
        default=None,
        description=(
            'placement="ray": Ray resources per member actor, one dict for all or one each, e.g. {"num_gpus": 1}.'
        ),
    )
    max_batch: Union[int, Literal["auto"]] = Field(
        default="auto",
        description=(
            'Requests run at once, their forwards batched per member ("auto": 8 on CPU, 32 on CUDA, 1 on Ray).'
        ),
    )
    kv_budget: Union[int, float, str, None] = Field(
        default="auto",
        description=(
            "KV-cache bytes the running requests may hold per device; others wait, one that never "
            'fits is refused ("auto": 90% of free GPU memory, half the free RAM; "2GB"; None: no limit).'
        ),
    )
    temperature: float = Field(default=defaults.TEMPERATURE, ge=0.0, description="0 = greedy.")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    max_new_tokens: int = Field(default=defaults.MAX_NEW_TOKENS, gt=0, description="Most new tokens per reply.")
    stop: Optional[List[str]] = Field(default=None, description="Stop strings.")
    seed: Optional[int] = Field(default=None)
    timeout: Optional[float] = Field(default=None, gt=0, description="Seconds a call may run.")
    max_retries: int = Field(
        default=0,
        ge=0,
        le=100,
        description=(
            "Times a call that failed inside generation (GenerationError) is run again, within the same "
            "timeout (a streamed call only before it showed text)."
        ),
    )
    base_url: Optional[str] = Field(
        default=None,
        description=(
            "Client mode: the URL of a served ensemble (`ensemble-llm serve`), e.g. http://127.0.0.1:8000/v1."
        ),
    )
    api_key: Optional[SecretStr] = Field(default=None, description="The served ensemble's API key (client mode).")
    context_window: Optional[int] = Field(
        default=None,
        gt=0,
        description=(
            "Tokens LlamaIndex may fill with prompt and reply. In process: the members' smallest window "
            "(default), or this if smaller; client mode: default 2048."
        ),
    )
    logprobs: bool = Field(
        default=False,
        description="Fill the responses' logprobs: per reply token, the token and its alternatives with the "
        "ensemble's log-probabilities (docs/scoring.md).",
    )
    top_logprobs: Optional[int] = Field(default=None, ge=0, le=20, description="Alternatives per token, with logprobs.")
    engine: Any = Field(default=None, exclude=True, description="An Ensemble to share.")
    _context_window: Optional[int] = PrivateAttr(default=None)
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
            self._context_window = self.context_window or 2048
            return self
        # Ensemble validates members, method, config and devices and names the bad one
        from ensemble_llm.engine import Ensemble  # torch loads when a facade is built, not imported

        self.engine, self._let_go = Ensemble.shared_or_given(
            self.engine, self.members, self.method, self.config, self, **{k: getattr(self, k) for k in ENGINE_OPTIONS}
        )
        self.members = self.engine.model_names
        self.method = self.engine.method_name
        self.model = check_model_id(self.model, self.model_name)
        return self

    def close(self) -> None:
        """Let go of the shared engine now (also done when this object is garbage-collected); when no
        other EnsembleLLM holds it, its members are freed, and a later call loads them again. An
        `engine=` you passed stays yours to close."""
        if self._let_go is not None:
            self._let_go()

    @classmethod
    def class_name(cls) -> str:
        return "EnsembleLLM"

    @property
    def model_name(self) -> str:
        if self.base_url is not None:
            return f"ensemble-llm@{self.base_url}"
        return f"{self.method}:{'+'.join(self.members or [])}"

    @property
    def metadata(self) -> LLMMetadata:
        if self._context_window is None:  # in process: read once (configs only, no weights)
            window = self.engine.context_window
            if self.context_window is not None and self.context_window > window:
                warnings.warn(
                    f"context_window={self.context_window} is more than the members hold ({window} tokens); "
                    f"LlamaIndex gets {window}.",
                    stacklevel=2,
                )
            self._context_window = min(window, self.context_window or window)
        return LLMMetadata(
            context_window=self._context_window,
            num_output=self.max_new_tokens,
            is_chat_model=True,
            is_function_calling_model=True,
            model_name=self.model_name,
            system_role=MessageRole.SYSTEM,
        )

    # ---- request plumbing ----------------------------------------------------------------
    def _messages(self, messages: Sequence[ChatMessage]) -> list[dict]:
        msgs = to_engine_messages(messages)
        if self.system_prompt and not any(m["role"] == "system" for m in msgs):
            msgs.insert(0, {"role": "system", "content": self.system_prompt})
        return msgs

    def _request(self, kwargs: dict[str, Any]) -> GenerationParams:
        unknown = set(kwargs) - _CALL_KEYS
        if unknown:
            raise TypeError(
                f"EnsembleLLM got unsupported call arguments {sorted(unknown)}; it takes {sorted(_CALL_KEYS)}."
            )
        model_fields = {
            "max_new_tokens": self.max_new_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "seed": self.seed,
            "timeout": self.timeout,
            "max_retries": 0 if self.base_url is not None else self.max_retries,
        }
        # the core's one builder (its precedence); a string stop is ONE stop string
        params = call_params(kwargs, model_fields, stop_list(self.stop, kwargs.get("stop")))
        check_facade_call(self.logprobs, params)
        return params

    def _logprobs(self, prompt: Any, result: GenerationResult) -> Optional[List[List[LogProb]]]:
        """Per reply token: the token, then its alternatives (`logprobs=True`), the ensemble's figures."""
        if not self.logprobs:
            return None
        return _as_logprobs(reply_logprobs(self.engine, prompt, result.text, top=self.top_logprobs or 0))

    async def _alogprobs(self, prompt: Any, result: GenerationResult) -> Optional[List[List[LogProb]]]:
        if not self.logprobs:
            return None
        return _as_logprobs(await areply_logprobs(self.engine, prompt, result.text, top=self.top_logprobs or 0))

    def _raw(self, result: GenerationResult) -> dict[str, Any]:
        return {
            "usage": result.usage.to_dict(),
            "finish_reason": result.finish_reason,
            "model": self.model_name,
            "method": result.method,
            "members": result.models,
            "stats": result.stats,
            "text": result.raw_text,
        }

    def _reply(self, result: GenerationResult) -> ChatMessage:
        blocks: list = [TextBlock(text=result.text)] if result.text else []
        blocks += [
            ToolCallBlock(tool_call_id=c.id, tool_name=c.name, tool_kwargs=c.arguments) for c in result.tool_calls
        ]
        return ChatMessage(role=MessageRole.ASSISTANT, blocks=blocks or [TextBlock(text="")])

    def _prompt_messages(self, prompt: str) -> list[ChatMessage]:
        return [ChatMessage(role=MessageRole.USER, content=prompt)]

    # ---- chat ----------------------------------------------------------------------------
    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        prompt = self._messages(messages)
        result = self.engine.generate(prompt, self._request(kwargs))
        return ChatResponse(message=self._reply(result), raw=self._raw(result), logprobs=self._logprobs(prompt, result))

    @llm_chat_callback()
    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        prompt = self._messages(messages)
        result = await self.engine.agenerate(prompt, self._request(kwargs))
        lp = await self._alogprobs(prompt, result)
        return ChatResponse(message=self._reply(result), raw=self._raw(result), logprobs=lp)

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        prompt = self._messages(messages)
        stream = self.engine.stream(prompt, self._request(kwargs))

        def gen() -> Generator[ChatResponse, None, None]:
            text = ""
            for delta in stream:
                text += delta
                yield ChatResponse(message=ChatMessage(role=MessageRole.ASSISTANT, content=text), delta=delta)
            result = stream.result
            lp = self._logprobs(prompt, result)
            yield ChatResponse(message=self._reply(result), delta="", raw=self._raw(result), logprobs=lp)

        return gen()

    @llm_chat_callback()
    async def astream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseAsyncGen:
        prompt = self._messages(messages)
        stream = self.engine.astream(prompt, self._request(kwargs))

        async def gen() -> AsyncGenerator[ChatResponse, None]:
            text = ""
            async for delta in stream:
                text += delta
                yield ChatResponse(message=ChatMessage(role=MessageRole.ASSISTANT, content=text), delta=delta)
            result = stream.result
            lp = await self._alogprobs(prompt, result)
            yield ChatResponse(message=self._reply(result), delta="", raw=self._raw(result), logprobs=lp)

        return gen()

    # ---- structured output: the reply constrained to the model's JSON Schema ---------------------
    def _structured_messages(
        self, output_cls: type, prompt: Any, llm_kwargs: dict | None, prompt_args: dict
    ) -> tuple[list[ChatMessage], dict]:
        messages = prompt.format_messages(llm=self, **prompt_args)
        fmt = {
            "type": "json_schema",
            "json_schema": {"name": output_cls.__name__, "schema": output_cls.model_json_schema()},
        }
        return messages, {**(llm_kwargs or {}), "response_format": fmt}

    def structured_predict(
        self, output_cls: type, prompt: Any, llm_kwargs: Optional[Dict[str, Any]] = None, **prompt_args: Any
    ) -> Any:
        """An instance of `output_cls` (a pydantic model): the reply is constrained to its JSON
        Schema (llguidance), so it always parses and validates, whatever the members write."""
        messages, kwargs = self._structured_messages(output_cls, prompt, llm_kwargs, prompt_args)
        return output_cls.model_validate_json(self.chat(messages, **kwargs).message.content)

    async def astructured_predict(
        self, output_cls: type, prompt: Any, llm_kwargs: Optional[Dict[str, Any]] = None, **prompt_args: Any
    ) -> Any:
        messages, kwargs = self._structured_messages(output_cls, prompt, llm_kwargs, prompt_args)
        return output_cls.model_validate_json((await self.achat(messages, **kwargs)).message.content)

    # ---- complete (a single user turn through each member's chat template) -----------------
    def _completion_prompt(self, prompt: str, formatted: bool) -> str:
        if not formatted and self.completion_to_prompt is not None:
            prompt = self.completion_to_prompt(prompt)
        return prompt

    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        msgs = self._messages(self._prompt_messages(self._completion_prompt(prompt, formatted)))
        result = self.engine.generate(msgs, self._request(kwargs))
        return CompletionResponse(text=result.text, raw=self._raw(result), logprobs=self._logprobs(msgs, result))

    @llm_completion_callback()
    async def acomplete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        msgs = self._messages(self._prompt_messages(self._completion_prompt(prompt, formatted)))
        result = await self.engine.agenerate(msgs, self._request(kwargs))
        lp = await self._alogprobs(msgs, result)
        return CompletionResponse(text=result.text, raw=self._raw(result), logprobs=lp)

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        msgs = self._messages(self._prompt_messages(self._completion_prompt(prompt, formatted)))
        stream = self.engine.stream(msgs, self._request(kwargs))

        def gen() -> Generator[CompletionResponse, None, None]:
            text = ""
            for delta in stream:
                text += delta
                yield CompletionResponse(text=text, delta=delta)
            lp = self._logprobs(msgs, stream.result)
            yield CompletionResponse(text=text, delta="", raw=self._raw(stream.result), logprobs=lp)

        return gen()

    @llm_completion_callback()
    async def astream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseAsyncGen:
        msgs = self._messages(self._prompt_messages(self._completion_prompt(prompt, formatted)))
        stream = self.engine.astream(msgs, self._request(kwargs))

        async def gen() -> AsyncGenerator[CompletionResponse, None]:
            text = ""
            async for delta in stream:
                text += delta
                yield CompletionResponse(text=text, delta=delta)
            lp = await self._alogprobs(msgs, stream.result)
            yield CompletionResponse(text=text, delta="", raw=self._raw(stream.result), logprobs=lp)

        return gen()

    # ---- tools ---------------------------------------------------------------------------
    def _prepare_chat_with_tools(
        self,
        tools: Sequence[Any],
        user_msg: Optional[Union[str, ChatMessage]] = None,
        chat_history: Optional[List[ChatMessage]] = None,
        verbose: bool = False,
        allow_parallel_tool_calls: bool = False,
        tool_required: bool = False,
        tool_choice: Any = None,
        **kwargs: Any,
    ) -> dict[str, Any]:
        """Messages plus OpenAI-format tool specs; tool_required forces a call (the call grammar, closed
        within the budget; a budget too small for the shortest call is a RequestError)."""
        specs = [t.metadata.to_openai_tool() for t in tools]
        messages = list(chat_history or [])
        if user_msg:
            messages.append(
                ChatMessage(role=MessageRole.USER, content=user_msg) if isinstance(user_msg, str) else user_msg
            )
        choice = tool_choice if tool_choice is not None else ("required" if tool_required else "auto")
        if not specs:
            choice = None
        check_tool_choice(choice, specs or None)
        return {"messages": messages, "tools": specs or None, "tool_choice": choice, **kwargs}

    def get_tool_calls_from_response(
        self, response: ChatResponse, error_on_no_tool_call: bool = True, **kwargs: Any
    ) -> List[ToolSelection]:
        calls = [b for b in response.message.blocks if isinstance(b, ToolCallBlock)]
        if not calls and error_on_no_tool_call:
            raise ValueError(f"Expected at least one tool call, but the model replied: {response.message.content!r}")
        return [
            ToolSelection(
                tool_id=c.tool_call_id or "",
                tool_name=c.tool_name,
                tool_kwargs=c.tool_kwargs if isinstance(c.tool_kwargs, dict) else {},
            )
            for c in calls
        ]


__all__ = ["EnsembleLLM", "to_engine_messages"]


def _as_logprobs(chat: dict) -> List[List[LogProb]]:
    """The chat `logprobs` object as LlamaIndex holds it: per token, that token, then its alternatives."""
    out = []
    for t in chat["content"]:
        first = LogProb(token=t["token"], logprob=t["logprob"], bytes=t["bytes"])
        alts = [LogProb(token=a["token"], logprob=a["logprob"], bytes=a["bytes"]) for a in t["top_logprobs"]]
        out.append([first] + [a for a in alts if a.token != t["token"]])
    return out
