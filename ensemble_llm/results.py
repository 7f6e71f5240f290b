"""What a request returns: the reply, its token usage and its tool calls. Plain data on the
ground floor (no torch), shared by the engine, the server and the HTTP client."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ToolCall:
    name: str
    arguments: dict
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])

    def to_dict(self) -> dict:
        return {"id": self.id, "name": self.name, "arguments": self.arguments}


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # prompt tokens whose KV came from a stored prompt (members/prefix.py)

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def to_dict(self) -> dict[str, Any]:
        """The OpenAI form: prompt, completion and total tokens, and the cached prompt tokens."""
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.total_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


@dataclass
class GenerationResult:
    text: str  # the reply's content (tool-call markup removed when tools were given)
    finish_reason: str  # "stop" (EOS or stop string), "length" or "tool_calls"
    usage: Usage
    stats: dict[str, Any] = field(default_factory=dict)
    method: str = ""
    models: list[str] = field(default_factory=list)
    tool_calls: list[ToolCall] = field(default_factory=list)
    raw_text: str = ""  # the reply's whole text, tool-call markup (and a forced call's fixed head) included
    run_stats: Any = None  # the method's own figures, typed (a `methods.base.RunStats` of the method's class)
