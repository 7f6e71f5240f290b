"""`GenerationParams`: one request's settings, frozen and validated when made (like vLLM's
`SamplingParams` or transformers' `GenerationConfig`). The engine's `generate / stream /
agenerate / astream` take one (`params=`) and/or the same settings as keywords; both facades build
one from their fields and call arguments."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from .constraints import Constraint
from .defaults import MAX_NEW_TOKENS, TEMPERATURE, TOP_P
from .errors import RequestError
from .stopping import StopPolicy, stop_list
from .tools import check_tool_choice, check_tools, tool_call_constraint


def _check_text(text: str, what: str) -> None:
    """Text the tokenizers can take: valid Unicode (no lone surrogates)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise RequestError(
            f"{what} holds a lone surrogate {text[exc.start]!r} at character {exc.start}, which is not "
            "valid Unicode; decode your bytes with errors='replace' or remove it."
        ) from None


@dataclass(frozen=True)
class GenerationParams:
    """How to generate one reply.

    max_new_tokens: budget in the main member's tokens. temperature: 0 = greedy. top_p: nucleus
    mass. seed: None = random. stop: one string or several; the reply is cut before the first.
    raw: the prompt string is used as is (no chat template). tools / tool_choice: OpenAI-format
    tools; "auto", "none", "required" (or "any") or a tool name. response_format: a `Constraint`,
    or OpenAI's {"type": "json_object"} / {"type": "json_schema", "json_schema": {"schema": ...}}.
    timeout: seconds from submission (queue wait included) after which the request stops with
    RequestTimeout. max_retries: times an internal fault (GenerationError) is retried under the
    same deadline (by a stream only before it showed text). trace: put the method's decisions (which member
    wrote which span, where the ensemble decided) in `result.stats["trace"]`.
    """

    max_new_tokens: int = MAX_NEW_TOKENS
    temperature: float = TEMPERATURE
    top_p: float = TOP_P
    seed: int | None = None
    stop: tuple[str, ...] = ()
    raw: bool = False
    tools: tuple[dict, ...] | None = None
    tool_choice: str = "auto"
    response_format: Constraint | None = None
    timeout: float | None = None
    max_retries: int = 0
    trace: bool = False
    stops: StopPolicy = dataclasses.field(init=False, repr=False, compare=False)  # `stop`, normalised once

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # frozen: normalised values are written once, here
        n = self.max_new_tokens
        if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
            raise RequestError(f"max_new_tokens must be a positive integer, got {n!r}")
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 <= t < math.inf:
            raise RequestError(f"temperature must be a finite number >= 0 (0 = greedy), got {t!r}")
        set_(self, "temperature", float(t))
        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 1:
            raise RequestError(f"top_p must be in (0, 1], got {p!r}")
        set_(self, "top_p", float(p))
        s = self.seed
        if s is not None and (isinstance(s, bool) or not isinstance(s, int) or not 0 <= s < 2**63):
            raise RequestError(f"seed must be an integer in [0, 2**63) or None, got {s!r}")
        stops = stop_list(self.stop)
        for x in stops:
            _check_text(x, f"stop string {x!r}")
        set_(self, "stops", StopPolicy(tuple(stops)))
        set_(self, "stop", self.stops.strings)
        if not isinstance(self.raw, bool):
            raise RequestError(f"raw must be True or False, got {self.raw!r}")
        to = self.timeout
        if to is not None and (isinstance(to, bool) or not isinstance(to, (int, float)) or not 0 < to < math.inf):
            raise RequestError(f"timeout must be a positive finite number of seconds or None, got {to!r}")
        set_(self, "timeout", None if to is None else float(to))
        r = self.max_retries
        if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r <= 100:
            raise RequestError(f"max_retries must be an integer in [0, 100], got {r!r}")
        if not isinstance(self.trace, bool):
            raise RequestError(f"trace must be True or False, got {self.trace!r}")
        tools = check_tools(self.tools)
        set_(self, "tools", tuple(tools) if tools else None)
        set_(self, "tool_choice", check_tool_choice(self.tool_choice, tools))
        if tools and self.raw:
            raise RequestError("tools need a chat prompt (a string or messages) with raw=False.")
        try:
            rf = Constraint.from_response_format(self.response_format)
        except RequestError as exc:  # named, so the server's 400 names the field
            raise RequestError(
                str(exc) if str(exc).startswith("response_format") else f"response_format: {exc}"
            ) from None
        if rf is not None and tools and self.tool_choice not in ("auto", "none"):
            raise RequestError(
                f"response_format and a forced tool call (tool_choice={self.tool_choice!r}) both "
                "constrain the reply; give one of them."
            )
        if rf is not None:
            rf.check()
        set_(self, "response_format", rf)
        if tools and self.tool_choice not in ("auto", "none"):
            self.constraint.check()  # a schema llguidance cannot compile fails here, before queueing

    @cached_property
    def constraint(self) -> Constraint | None:
        """What the reply must match: the response format, or the grammar of a forced tool call."""
        if self.response_format is not None:
            return self.response_format
        if self.tools and self.tool_choice not in ("auto", "none"):
            return tool_call_constraint(list(self.tools), self.tool_choice)
        return None

    def replace(self, **changes: Any) -> "GenerationParams":
        """A copy with `changes` (validated again)."""
        return dataclasses.replace(self, **changes)


FIELDS = tuple(f.name for f in dataclasses.fields(GenerationParams) if f.init)


def call_params(call: dict[str, Any], model: dict[str, Any], stop: tuple[str, ...] | list[str]) -> GenerationParams:
    """One call's GenerationParams as both facades build it: the call's settings over the model's
    fields (`model`: max_new_tokens, temperature, top_p, seed, timeout, max_retries). The budget
    is the call's `max_new_tokens`, else its `max_tokens` (OpenAI's and LangChain's name), else
    the model's; `stop`: the model's and the call's stop strings, merged (`stop_list`)."""
    budget = call.get("max_new_tokens", call.get("max_tokens", model["max_new_tokens"]))
    return GenerationParams(
        max_new_tokens=budget,
        temperature=call.get("temperature", model["temperature"]),
        top_p=call.get("top_p", model["top_p"]),
        seed=call.get("seed", model["seed"]),
        stop=tuple(stop),
        timeout=model["timeout"],
        max_retries=model["max_retries"],
        tools=call.get("tools"),
        tool_choice=call.get("tool_choice"),
        response_format=call.get("response_format"),
        trace=bool(call.get("trace", False)),
    )
