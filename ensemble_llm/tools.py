"""Tools: checking `tools` and `tool_choice`, the JSON tool protocol a member without native tool
support reads, tool calls parsed back out of generated text (and held back from streamed content),
the grammar of a forced call, and the tool policy applied to a reply's calls.

Tools travel in OpenAI function format ({"type": "function", "function": {"name", "description",
"parameters"}}), which both LangChain (`convert_to_openai_tool`) and LlamaIndex
(`tool.metadata.to_openai_tool()`) produce. The model answers a call as

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

(the Hermes/Qwen convention most tool-tuned templates use). When a call is required
(`tool_choice="required"`/"any" or a tool name) the reply is constrained to that grammar
(`tool_call_constraint`, llguidance): the JSON syntax is forced and the values are masked to the
schema, so even a 135M model returns a call that parses and validates.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

import jsonschema

from .errors import RequestError
from .results import ToolCall

TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"


TOOL_CHOICES = ("auto", "none", "required")


def check_tools(tools: Any) -> list[dict] | None:
    """Validate OpenAI-format tool specs; returns them as a list (None when there are none)."""
    if tools is None:
        return None
    if not isinstance(tools, (list, tuple)):
        raise RequestError(f"tools must be a list of OpenAI-format tool dicts, got {type(tools).__name__}")
    out, names = [], set()
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise RequestError(
                f"tool {i} must look like {{'type': 'function', 'function': {{'name': ..., 'parameters': {{...}}}}}}, "
                f"got {t!r}"
            )
        if fn["name"] in names:
            raise RequestError(f"two tools are named {fn['name']!r}; tool names must be unique.")
        params = fn.get("parameters")
        if params is not None:
            if not isinstance(params, dict):
                raise RequestError(f"tool {fn['name']!r}: 'parameters' must be a JSON Schema object, got {params!r}")
            from .constraints import check_schema_size  # (llguidance is loaded only where a grammar is built)

            check_schema_size(params, f"tool {fn['name']!r}: 'parameters'")  # before the meta-schema check
            try:  # the JSON Schema meta-schema of the schema's own draft (2020-12 when it names none)
                jsonschema.validators.validator_for(params).check_schema(params)
            except jsonschema.SchemaError as exc:
                where = "/".join(str(p) for p in exc.absolute_path) or "(root)"
                raise RequestError(
                    f"tool {fn['name']!r}: 'parameters' is not a valid JSON Schema at {where}: {exc.message}"
                ) from None
        names.add(fn["name"])
        out.append({"type": "function", "function": dict(fn)})
    return out or None


def check_tool_choice(tool_choice: Any, tools: list[dict] | None) -> str:
    """Normalise tool_choice to "auto", "none", "required" or a tool name."""
    if tool_choice is None:
        return "auto"
    if tool_choice is True or tool_choice == "any":
        tool_choice = "required"
    if isinstance(tool_choice, dict):  # {"type": "function", "function": {"name": ...}} or {"name": ...}
        name = (tool_choice.get("function") or {}).get("name") or tool_choice.get("name")
        if not isinstance(name, str):
            raise RequestError(f"tool_choice dict names no tool: {tool_choice!r}")
        tool_choice = name
    if not isinstance(tool_choice, str):
        raise RequestError(
            f"tool_choice must be None, 'auto', 'none', 'any', 'required', a tool name or a dict, got {tool_choice!r}"
        )
    names = [t["function"]["name"] for t in tools or []]
    if tool_choice in TOOL_CHOICES:
        if tool_choice == "required" and not names:
            raise RequestError("tool_choice='required' needs at least one tool; pass tools=[...].")
        return tool_choice
    if tool_choice not in names:
        raise RequestError(f"tool_choice names {tool_choice!r}, which is not among the tools {names}.")
    return tool_choice


def tool_protocol(tools: list[dict], tool_choice: str) -> str:
    """System-prompt text that teaches a model without a tools-aware template to call tools."""
    specs = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in tools)
    if tool_choice == "required":
        rule = "You must call one of these tools."
    elif tool_choice not in ("auto", "none"):
        rule = f"You must call the tool {tool_choice}."
    else:
        rule = "When a tool helps, call it; otherwise answer normally."
    return (
        f"You can call these tools (JSON schemas):\n{specs}\n{rule} To call a tool, reply with exactly\n"
        f'{TOOL_OPEN}\n{{"name": "<tool name>", "arguments": {{<arguments as JSON>}}}}\n{TOOL_CLOSE}\n'
        "Tool results come back in messages from the tool."
    )


def call_text(name: str, arguments: Any) -> str:
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            pass
    return f"{TOOL_OPEN}\n{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}\n{TOOL_CLOSE}"


def history_calls(messages: Any) -> set[str]:
    """Keys of the tool calls already made in a message history (see `call_key`)."""
    keys = set()
    for m in messages if isinstance(messages, (list, tuple)) else []:
        for c in m.get("tool_calls") or []:
            fn = c.get("function") or {}
            args = fn.get("arguments", {})
            if isinstance(args, str):
                try:
                    args = json.loads(args)
                except ValueError:
                    continue
            keys.add(call_key(fn.get("name"), args))
    return keys


def call_key(name: Any, arguments: Any) -> str:
    return json.dumps([name, arguments], sort_keys=True, ensure_ascii=False)


_DECODER = json.JSONDecoder()


def _call_from(obj: Any, names: set[str]) -> ToolCall | None:
    if not isinstance(obj, dict):
        return None
    if isinstance(obj.get("function"), dict):  # {"type": "function", "function": {...}}
        obj = obj["function"]
    name = obj.get("name")
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            return None
    if name not in names or not isinstance(args, dict):
        return None
    return ToolCall(name, args)


def parse_tool_calls(text: str, tools: list[dict] | None) -> tuple[str, list[ToolCall]]:
    """Split generated text into (content, tool calls).

    Accepts `<tool_call>{json}</tool_call>` blocks (closing tag optional at the end) and, when
    there are none, a reply that is one bare JSON call object (optionally in a ```json fence).
    Calls must name a known tool and carry a JSON object of arguments; anything else stays content
    (returned unstripped: strip it for display).
    """
    names = {t["function"]["name"] for t in tools or []}
    if not names:
        return text, []
    calls: list[ToolCall] = []
    kept: list[str] = []
    pos = 0
    for m in re.finditer(re.escape(TOOL_OPEN), text):
        if m.start() < pos:
            continue
        start = m.end()
        body = text[start:].lstrip()
        try:
            obj, used = _DECODER.raw_decode(body)
        except ValueError:
            continue
        call = _call_from(obj, names)
        if call is None:
            continue
        end = start + (len(text[start:]) - len(body)) + used
        rest = text[end:]
        close = re.match(r"\s*" + re.escape(TOOL_CLOSE), rest)
        end += close.end() if close else 0
        kept.append(text[pos : m.start()])
        calls.append(call)
        pos = end
    if calls:
        kept.append(text[pos:])
        return "".join(kept), calls
    bare = re.sub(r"^```(?:json)?\s*|\s*```$", "", text.strip())
    if bare.startswith("{"):
        try:
            obj, used = _DECODER.raw_decode(bare)
        except ValueError:
            return text, []
        call = _call_from(obj, names)
        if call is not None and not bare[used:].strip():
            return "", [call]
    return text, []


class ToolTextFilter:
    """Streams content while holding back anything that may be tool-call markup.

    `feed(delta)` returns the text that is surely content; text from a possible `<tool_call>` (or a
    leading `{` / ``` that may open a bare JSON call) is held until the end, when `finish()` parses
    everything.
    """

    def __init__(self, tools: list[dict] | None) -> None:
        self.tools = tools
        self.text = ""
        self.sent = 0
        self.held = False

    def feed(self, delta: str) -> str:
        self.text += delta
        if not self.tools:
            return self._release(len(self.text))
        if self.held:
            return ""
        stripped = self.text.lstrip()
        if not stripped:
            return ""
        if self.sent == 0 and stripped[0] in "{`":
            self.held = True
            return ""
        i = self.text.find(TOOL_OPEN, self.sent)
        if i >= 0:
            self.held = True
            return self._release(i)
        keep = 0  # a tail that could be the start of TOOL_OPEN stays back
        for k in range(min(len(TOOL_OPEN) - 1, len(self.text) - self.sent), 0, -1):
            if TOOL_OPEN.startswith(self.text[-k:]):
                keep = k
                break
        return self._release(len(self.text) - keep)

    def _release(self, upto: int) -> str:
        out = self.text[self.sent : upto]
        self.sent = max(self.sent, upto)
        return out

    def finish(self) -> tuple[str, str, list[ToolCall]]:
        """(content not yet released, the whole content, tool calls)."""
        content, calls = parse_tool_calls(self.text, self.tools)
        if not calls:
            return self._release(len(self.text)), self.text, []
        released = self.text[: self.sent]
        tail = content[len(released) :] if content.startswith(released) else ""
        self.sent = len(self.text)
        return tail.rstrip(), content.strip(), calls


def tool_call_constraint(tools: list[dict], tool_choice: str):
    """The grammar of one call to the allowed tools (all for "required", else the named one):

        {"name": "<tool>", "arguments": <JSON valid under the tool's parameters>}

    (a bare call object, without the <tool_call> tags a free reply uses),

    llguidance writes the fixed parts without sampling and masks every token that would leave
    the schema, so the call parses and validates whatever the members would have written."""
    from .constraints import Constraint, styled

    allowed = [t["function"] for t in tools if tool_choice == "required" or t["function"]["name"] == tool_choice]
    heads, bodies = [], []
    for fn in allowed:
        params = fn.get("parameters")
        if not params or (
            isinstance(params, dict)
            and params.get("type") == "object"
            and not params.get("properties")
            and not any(
                k in params for k in ("$ref", "anyOf", "oneOf", "allOf", "additionalProperties", "patternProperties")
            )
        ):
            params = {"type": "object", "properties": {}, "additionalProperties": False}  # no arguments: {}
        elif "type" not in params and not any(k in params for k in ("$ref", "anyOf", "oneOf", "allOf")):
            params = {**params, "type": "object"}  # a tool's arguments are always an object
        try:  # the arguments' schema alone: meta-schema, $ref cycles, what llguidance refuses
            Constraint.json_schema(params).check()
        except RequestError as exc:
            raise RequestError(f"tool {fn['name']!r}: {exc}") from None
        schema = styled(params)
        heads.append(json.dumps({"name": fn["name"]})[:-1] + ', "arguments": ')
        bodies.append(f'%json {json.dumps(schema)} "}}"')
    # no tags: a forced call is known to be a call (`parse_tool_calls` reads a bare call object),
    # and the ~6-10 tokens the tags cost go to the arguments (budget-aware closing counts them)
    if len(heads) == 1:  # one allowed tool: its name is no choice, so the head ends the prompt (Constraint.head)
        return dataclasses.replace(Constraint.lark(f"start: {bodies[0]}"), whole=True, head=heads[0])
    rules = [f"call_{i}: {json.dumps(h)} {b}" for i, (h, b) in enumerate(zip(heads, bodies))]
    grammar = "start: " + " | ".join(f"call_{i}" for i in range(len(rules))) + "\n" + "\n".join(rules)
    return dataclasses.replace(Constraint.lark(grammar), whole=True)


def tool_policy(
    prompt: str | list[dict], calls: list[ToolCall], text: str, tool_choice: str, notes: dict[str, Any]
) -> tuple[list[ToolCall], bool]:
    """The calls to return, and whether to answer again without tools. With tool_choice "none" a
    call is dropped. With "auto", a call identical to one the conversation already made is
    dropped: small models imitate their history, and an agent would loop on it; when nothing else
    is left, the request is answered again without tools (same deadline). Counts go into `notes`."""
    if calls and tool_choice == "none":
        notes["ignored_tool_calls"], calls = len(calls), []
    if calls and tool_choice == "auto":
        seen = history_calls(prompt)
        fresh = [c for c in calls if call_key(c.name, c.arguments) not in seen]
        if len(fresh) < len(calls):
            notes["repeated_tool_calls_dropped"], calls = len(calls) - len(fresh), fresh
            if not calls and not text.strip():
                return [], True
    return calls, False
