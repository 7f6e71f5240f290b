"""Messages -> each member's prompt: message content as text, the member's chat template or a
plain "User:/Assistant:" transcript for a member without one, the preambles, and each member's
view of a conversation with tools (a template that renders tools gets them; any other member
gets the JSON tool protocol of tools.py in its system message, and earlier calls as text).
"""

from __future__ import annotations

from typing import Any

from .errors import ConfigError
from .tools import call_text, tool_protocol

# ---- tools and tool_choice -----------------------------------------------------------------


# ---- messages -> prompt --------------------------------------------------------------------
def content_text(content: Any) -> str:
    """Message content as plain text: strings as is, lists of parts joined (text parts only)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, (list, tuple)):
        out = []
        for part in content:
            if isinstance(part, str):
                out.append(part)
            elif isinstance(part, dict) and isinstance(part.get("text"), str):
                out.append(part["text"])
        return "".join(out)
    return str(content)


# Plain transcript for models without a chat template. Each turn's text starts on its own line,
# so an answer begins without a leading space, as it does after a ChatML "assistant\n" header:
# members with and without templates then see the same answer text.
PLAIN_ROLES = {"system": "", "user": "User:\n", "assistant": "Assistant:\n", "tool": "Tool result:\n"}
PLAIN_STOPS = ("\nUser:", "\nAssistant:")  # a new turn of the transcript ends the reply


def render_chat(
    member, messages: list[dict], tools: list[dict] | None = None, add_generation_prompt: bool = True
) -> str:
    """The prompt text for `messages` ({'role', 'content', ...} dicts) with the member's chat
    template, or a plain 'User:/Assistant:' transcript for a member without one."""
    if member.has_chat_template:
        return member.tokenizer.apply_chat_template(
            messages, tools=tools or None, tokenize=False, add_generation_prompt=add_generation_prompt
        )
    lines = []
    for m in messages:
        lines.append(PLAIN_ROLES.get(m["role"], f"{m['role'].capitalize()}:\n") + content_text(m.get("content")))
    text = "\n".join(lines)
    return text + ("\nAssistant:\n" if add_generation_prompt else "")


def chat_stops(member) -> tuple[str, ...]:
    """Stop strings implied by the member's chat format (a new turn of the plain transcript)."""
    return () if member.has_chat_template else PLAIN_STOPS


def template_features(member) -> tuple[bool, bool]:
    """(template renders `tools`, template renders assistant `tool_calls`)."""
    tpl = getattr(member.tokenizer, "chat_template", None) if member.has_chat_template else None
    tpl = tpl if isinstance(tpl, str) else ""
    return "tools" in tpl, "tool_calls" in tpl


# The built-in preamble of a member without a chat template (a base model such as Gemma-3-270M):
# a system line and two example turns that show the transcript is a conversation with an
# assistant that answers directly. Without them a base model continues a bare "User:/Assistant:"
# transcript by repeating or rephrasing the question. The example facts are generic (none is in
# the bundled dev or chat sets).
BASE_PREAMBLE: tuple[dict, ...] = (
    {
        "role": "system",
        "content": "A conversation between a user and a helpful, knowledgeable assistant. "
        "The assistant answers each question directly, correctly and briefly.",
    },
    {"role": "user", "content": "What is the boiling point of water at sea level?"},
    {"role": "assistant", "content": "Water boils at 100 degrees Celsius (212 degrees Fahrenheit) at sea level."},
    {"role": "user", "content": "Who painted the Mona Lisa?"},
    {"role": "assistant", "content": "Leonardo da Vinci painted the Mona Lisa."},
)


def check_preamble(preamble: Any, owner: str) -> list[dict] | None:
    """Validate a member's preamble: None (the default), or a list of {'role', 'content'} messages
    with roles system/user/assistant (a system message only first)."""
    if preamble is None:
        return None
    if not isinstance(preamble, (list, tuple)):
        raise ConfigError(
            f"{owner}: preamble must be a list of messages ({{'role', 'content'}} dicts) or None, "
            f"got {type(preamble).__name__}"
        )
    out = []
    for i, m in enumerate(preamble):
        if (
            not isinstance(m, dict)
            or m.get("role") not in ("system", "user", "assistant")
            or not isinstance(m.get("content"), str)
            or not m["content"].strip()
        ):
            raise ConfigError(
                f"{owner}: preamble message {i} must be {{'role': 'system'|'user'|'assistant', "
                f"'content': non-empty str}}, got {m!r}"
            )
        if m["role"] == "system" and i:
            raise ConfigError(f"{owner}: a preamble's system message must come first (message {i} is one)")
        out.append({"role": m["role"], "content": m["content"]})
    return out


def with_preamble(preamble: list[dict], messages: list[dict]) -> list[dict]:
    """The preamble's turns before the request's messages; a system message of the request joins
    the preamble's system text (one system message, first)."""
    if not preamble:
        return list(messages)
    pre, msgs = list(preamble), list(messages)
    if msgs and msgs[0]["role"] == "system":
        if pre[0]["role"] == "system":
            pre[0] = {**pre[0], "content": pre[0]["content"] + "\n" + content_text(msgs[0].get("content"))}
        else:
            pre.insert(0, msgs[0])
        msgs = msgs[1:]
    return pre + msgs


def member_messages(
    member, messages: list[dict], tools: list[dict] | None, tool_choice: str
) -> tuple[list[dict], list[dict] | None]:
    """The messages (and template tools) to render for one member.

    Content becomes plain text; assistant tool calls become `<tool_call>` text unless the template
    renders them; tool results keep their role; tools go to the template when it takes them, else
    into the system message as the JSON protocol.
    """
    native_tools, native_calls = template_features(member)
    use_tools = tools if tools and tool_choice != "none" else None
    out = []
    for m in messages:
        role = m["role"]
        msg: dict[str, Any] = {"role": role, "content": content_text(m.get("content"))}
        calls = m.get("tool_calls") or []
        if role == "assistant" and calls:
            if native_calls:
                msg["tool_calls"] = calls
            else:
                texts = [call_text(c["function"]["name"], c["function"].get("arguments", {})) for c in calls]
                msg["content"] = "\n".join([msg["content"]] * bool(msg["content"]) + texts)
        if role == "tool":
            for key in ("tool_call_id", "name"):
                if m.get(key):
                    msg[key] = m[key]
            if not native_calls and m.get("name"):
                msg["content"] = f"[{m['name']}] {msg['content']}"
        elif m.get("name") and role in ("user", "assistant") and not native_calls:
            msg["content"] = f"{m['name']}: {msg['content']}"
        out.append(msg)
    if use_tools and not native_tools:
        text = tool_protocol(use_tools, tool_choice)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": (out[0]["content"] + "\n\n" + text).strip()}
        else:
            out.insert(0, {"role": "system", "content": text})
        return out, None
    return out, use_tools


# ---- tool calls out of text ----------------------------------------------------------------


# ---- forced tool calls -----------------------------------------------------------------------
