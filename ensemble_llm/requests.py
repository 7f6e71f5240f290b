"""Checks of what a caller hands the engine, before anything is queued: the prompt (a string or
chat messages), a member given as a dict, and the request settings, gathered into one `Job`.

The four request entry points (`generate`, `stream`, `agenerate`, `astream`) share one typed
signature: `Settings`, the `GenerationParams` fields as keywords (`**settings: Unpack[Settings]`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Sequence, TypedDict

from .chat import check_preamble, content_text
from .errors import ConfigError, RequestError, RequestTimeout
from .params import FIELDS as PARAM_FIELDS
from .params import GenerationParams, _check_text

ROLES = ("system", "user", "assistant", "tool")
MEMBER_KEYS = (  # "model", "preamble" and members/options.py's OPTION_KEYS (not imported: it needs torch)
    "model",
    "preamble",
    "revision",
    "device_map",
    "max_memory",
    "offload_folder",
    "quantization",
    "backend",
    "url",
    "timeout",
)


class Settings(TypedDict, total=False):
    """One request's settings as keywords (see `GenerationParams` for each); keywords the caller
    leaves out come from `params`, else from the defaults."""

    max_new_tokens: int
    temperature: float
    top_p: float
    seed: int | None
    stop: str | Sequence[str] | None
    raw: bool
    tools: Sequence[dict] | None
    tool_choice: Any
    response_format: Any
    timeout: float | None
    max_retries: int
    trace: bool


assert set(Settings.__annotations__) == set(PARAM_FIELDS), "Settings must list every GenerationParams field"


@dataclass
class Job:
    """One queued request: the prompt, its settings and when it was submitted."""

    prompt: str | list[dict]
    params: GenerationParams
    submitted: float = field(default_factory=time.perf_counter)  # the timeout counts from here
    shows_text: bool = True  # a stream's deltas reach the caller; generate() only keeps the result
    scoring: Any = None  # a scoring.Scoring: continuations to score after the prompt, not a generation

    @property
    def head(self) -> str:
        """The reply's fixed start that ends every member's prompt instead of being generated
        (`Constraint.head`: a forced call to the one allowed tool); "" for other requests."""
        return self.params.constraint.head if self.params.constraint else ""

    def deadline(self) -> float | None:
        """When the request must end (time.perf_counter()), or None without a timeout."""
        return None if self.params.timeout is None else self.submitted + self.params.timeout

    def check_deadline(self) -> None:
        """RequestTimeout once `timeout` seconds have passed since the request was submitted
        (time waiting in the queue, loading and any retry all count)."""
        timeout = self.params.timeout
        if timeout is not None and time.perf_counter() - self.submitted > timeout:
            raise RequestTimeout(
                f"the request took longer than timeout={timeout:g} s (queue wait included); "
                "raise the timeout or lower max_new_tokens."
            )


def make_job(prompt: Any, params: GenerationParams | None, settings: dict[str, Any], method_class, config) -> Job:
    """The request as one Job: `params` with the keyword `settings` on top, the prompt checked,
    and the method's own limits on sampling settings checked (all before any work)."""
    unknown = sorted(set(settings) - set(PARAM_FIELDS))
    if unknown:
        raise TypeError(f"unexpected keyword argument(s) {unknown}; the settings are {list(PARAM_FIELDS)}")
    if params is not None and not isinstance(params, GenerationParams):
        raise RequestError(f"params must be a GenerationParams, got {type(params).__name__}")
    if isinstance(settings.get("stop"), str):
        settings["stop"] = (settings["stop"],)
    if isinstance(settings.get("tools"), list):
        settings["tools"] = tuple(settings["tools"])
    params = (params or GenerationParams()).replace(**settings) if settings else (params or GenerationParams())
    prompt = check_prompt(prompt, params.raw)
    method_class.check_request(config, temperature=params.temperature, top_p=params.top_p)
    return Job(prompt, params)


def check_message(m: Any, i: int) -> None:
    """One chat message: a known role, and text content the members can read. Content is a string
    or a list of text parts; image/audio parts and other objects are refused, naming the part.
    Empty content is refused too, except for an assistant turn that carries tool calls."""
    if not isinstance(m, dict) or m.get("role") not in ROLES:
        raise RequestError(f"message {i} must be a dict with 'role' in {ROLES}, got {m!r}")
    content = m.get("content")
    if isinstance(content, (list, tuple)):
        for j, part in enumerate(content):
            _check_part(m, i, j, part)
    elif content is not None and not isinstance(content, str):
        raise RequestError(
            f"message {i} ({m['role']}) content must be a string or a list of text parts, got {type(content).__name__}"
        )
    text = content_text(content)
    calls = m.get("tool_calls")
    if calls is not None and (m["role"] != "assistant" or not _well_formed_calls(calls)):
        raise RequestError(
            f"message {i}: tool_calls belong to assistant messages and look like "
            "[{'id': ..., 'type': 'function', 'function': {'name': ..., 'arguments': ...}}], "
            f"got {calls!r}"
        )
    if m["role"] == "tool" and not (isinstance(m.get("tool_call_id"), str) and m["tool_call_id"]):
        raise RequestError(
            f"message {i} (tool) has no tool_call_id (got {m.get('tool_call_id')!r}); a tool "
            "result must name the call it answers: give it the 'tool_call_id' of that call "
            "(the id in the assistant message's tool_calls)."
        )
    if not text.strip() and not (m["role"] == "assistant" and calls) and m["role"] != "tool":
        raise RequestError(f"message {i} ({m['role']}) has no text content; give it non-empty 'content'.")
    _check_text(text, f"message {i} ({m['role']})")


def _check_part(m: dict, i: int, j: int, part: Any) -> None:
    """Part j of message i's content: a string or a text part; anything else is refused."""
    if isinstance(part, str):
        return
    if isinstance(part, dict) and part.get("type", "text") == "text":
        if isinstance(part.get("text"), str):
            return
        raise RequestError(
            f"message {i} ({m.get('role')}) content part {j} is a text part with no string "
            f"'text' (got {part.get('text')!r}); give it {{'type': 'text', 'text': '...'}}."
        )
    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
    raise RequestError(
        f"message {i} ({m['role']}) content part {j} is {kind!r}, which these text-only "
        "models cannot read; send text parts ({'type': 'text', 'text': ...}) only."
    )


def _well_formed_calls(calls: Any) -> bool:
    return isinstance(calls, (list, tuple)) and all(
        isinstance(c, dict) and isinstance(c.get("function"), dict) and isinstance(c["function"].get("name"), str)
        for c in calls
    )


def check_prompt(prompt: Any, raw: bool) -> str | list[dict]:
    """A non-empty prompt string, or a non-empty list of valid messages (copied); raw=True takes
    a string only."""
    if isinstance(prompt, str):
        if not prompt.strip():
            raise RequestError("the prompt is empty; pass a non-empty string or a list of messages.")
        _check_text(prompt, "the prompt")
        return prompt
    if isinstance(prompt, (list, tuple)):
        if not prompt:
            raise RequestError("the message list is empty; pass at least one {'role': 'user', 'content': ...}.")
        for i, m in enumerate(prompt):
            check_message(m, i)
        if raw:
            raise RequestError("raw=True takes a prompt string, not messages.")
        return [dict(m) for m in prompt]
    raise RequestError(f"prompt must be a string or a list of messages, got {type(prompt).__name__}")


@dataclass(frozen=True)
class MemberSpec:
    """One member as the caller gave it: the model, the turns put before its chat prompts, and
    its loading options (`MemberOptions`: revision, device_map, max_memory, offload_folder).
    It still unpacks as the former (model, preamble) pair."""

    model: Any
    preamble: list[dict] | None = None
    options: Any = None  # MemberOptions (members/options.py); imported lazily: this module needs no torch

    def __iter__(self):
        return iter((self.model, self.preamble))


def member_spec(spec: Any, i: int) -> MemberSpec:
    """A member is a model (bundled name, folder, .gguf, hub id, 'org/repo:file.gguf') or a dict
    {"model": ..., "preamble": [messages], "revision": ..., "device_map": ..., "max_memory": ...,
    "offload_folder": ..., "quantization": "int8" | "int4", "backend": ..., "url": ..., "timeout": ...}
    that pairs the model with turns put before its chat prompts and with its loading options (a
    member on a server: backend "server", its url and timeout; docs/servers.md)."""
    from .members.options import NO_OPTIONS, member_options

    if not isinstance(spec, dict):
        return MemberSpec(spec, None, NO_OPTIONS)
    unknown = sorted(set(spec) - set(MEMBER_KEYS))
    if unknown or "model" not in spec:
        raise ConfigError(
            f"member {i} is a dict, so it needs a 'model' and may have {list(MEMBER_KEYS[1:])}; got keys {sorted(spec)}"
        )
    where = f"member {i} ({spec['model']})"
    options = member_options({k: v for k, v in spec.items() if k not in ("model", "preamble")}, where)
    return MemberSpec(spec["model"], check_preamble(spec.get("preamble"), where), options)


def member_entries(members: Sequence[Any], placement: str = "local") -> tuple[list, list, list]:
    """Each member's (Source, preamble, MemberOptions), checked before anything loads: options
    that do not fit the source (a revision of a local folder) are refused. With placement="ray"
    the options travel to the member's actor, which loads the member with them."""
    from .members.backends import BACKENDS
    from .members.loader import check_options, resolve_source

    sources, preambles, options = [], [], []
    for i, spec in enumerate(members):
        entry = member_spec(spec, i)
        source = resolve_source(entry.model)
        check_options(source, entry.options)
        backend = BACKENDS.get(entry.options.backend)  # None: "auto", an in-process one
        if placement == "ray" and backend is not None and not backend.in_process:
            raise ConfigError(
                f"member {i} runs in the {backend.name} at {entry.options.url}, so it needs no Ray actor; use "
                f"placement='local' (the server places its own model), or drop backend={backend.name!r}."
            )
        sources.append(source)
        preambles.append(entry.preamble)
        options.append(entry.options)
    return sources, preambles, options
