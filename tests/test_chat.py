"""Messages/tools -> prompts, tool-call parsing, streaming filter and forced calls (ensemble_llm.chat)."""

from __future__ import annotations

import json

import jsonschema
import pytest

from ensemble_llm import Ensemble, RequestError
from ensemble_llm.chat import content_text, member_messages, render_chat
from ensemble_llm.tools import TOOL_CLOSE, TOOL_OPEN, ToolTextFilter, check_tool_choice, check_tools, parse_tool_calls


def tool(name, props=None, required=None, desc=""):
    params = {"type": "object", "properties": props or {}}
    if required is not None:
        params["required"] = required
    return {"type": "function", "function": {"name": name, "description": desc, "parameters": params}}


WEATHER = tool("get_weather", {"city": {"type": "string"}, "days": {"type": "integer"}}, ["city", "days"])
ADD = tool("add", {"a": {"type": "integer"}, "b": {"type": "integer"}}, ["a", "b"])


# ---- validation ------------------------------------------------------------------------------
def test_check_tools_and_choice():
    assert check_tools(None) is None and check_tools([]) is None
    with pytest.raises(RequestError, match="tool 0 must look like"):
        check_tools([{"name": "x"}])
    with pytest.raises(RequestError, match="unique"):
        check_tools([ADD, ADD])
    tools = check_tools([WEATHER, ADD])
    assert check_tool_choice(None, tools) == "auto"
    assert check_tool_choice("any", tools) == check_tool_choice(True, tools) == "required"
    assert check_tool_choice({"type": "function", "function": {"name": "add"}}, tools) == "add"
    assert check_tool_choice("add", tools) == "add"
    with pytest.raises(RequestError, match="not among the tools"):
        check_tool_choice("mul", tools)
    with pytest.raises(RequestError, match="needs at least one tool"):
        check_tool_choice("required", None)


def test_content_text():
    assert content_text(None) == ""
    assert content_text([{"type": "text", "text": "a"}, "b", {"type": "image_url", "image_url": "x"}]) == "ab"


# ---- parsing ----------------------------------------------------------------------------------
def test_parse_tagged_calls_keeps_content():
    text = (
        f'Let me check.\n{TOOL_OPEN}\n{{"name": "add", "arguments": {{"a": 1, "b": 2}}}}\n{TOOL_CLOSE}\n'
        f'{TOOL_OPEN}{{"name": "get_weather", "arguments": "{{\\"city\\": \\"Oslo\\", \\"days\\": 2}}"}}'
    )
    content, calls = parse_tool_calls(text, [WEATHER, ADD])
    assert content.strip() == "Let me check."
    assert [(c.name, c.arguments) for c in calls] == [
        ("add", {"a": 1, "b": 2}),
        ("get_weather", {"city": "Oslo", "days": 2}),
    ]
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)


def test_parse_bare_json_and_fence():
    for text in (
        '{"name": "add", "arguments": {"a": 1, "b": 2}}',
        '```json\n{"name": "add", "parameters": {"a": 1, "b": 2}}\n```',
    ):
        content, calls = parse_tool_calls(text, [ADD])
        assert content == "" and calls[0].arguments == {"a": 1, "b": 2}


def test_parse_rejects_unknown_tools_and_bad_args():
    for text in (
        f'{TOOL_OPEN}{{"name": "mul", "arguments": {{}}}}{TOOL_CLOSE}',
        f'{TOOL_OPEN}{{"name": "add", "arguments": [1, 2]}}{TOOL_CLOSE}',
        f'{TOOL_OPEN}{{"name": "add", "arguments": {{"a": 1',
    ):
        content, calls = parse_tool_calls(text, [ADD])
        assert calls == [] and content == text
    assert parse_tool_calls('{"name": "add", "arguments": {}} and more', [ADD])[1] == []
    assert parse_tool_calls("anything", None) == ("anything", [])


def test_filter_streams_content_and_holds_calls():
    f = ToolTextFilter([ADD])
    out = "".join(
        f.feed(p) for p in ["Sure", ", here: <to", "ol_call>", '{"name": "add", "arguments": {"a": 1, "b": 2}}']
    )
    assert out == "Sure, here: "
    tail, content, calls = f.finish()
    assert content == "Sure, here:" and tail == "" and calls[0].arguments == {"a": 1, "b": 2}
    f = ToolTextFilter([ADD])  # "<to" that turns out to be prose is released at the end
    out = "".join(f.feed(p) for p in ["a <to", "ast>"])
    tail, content, calls = f.finish()
    assert out + tail == "a <toast>" and calls == []
    f = ToolTextFilter(None)
    assert f.feed("<tool_call>") == "<tool_call>"


# ---- prompts ----------------------------------------------------------------------------------
def test_member_messages_protocol_and_history(tiny_members):
    smol = tiny_members["smol"]  # ChatML template without tools support
    history = [
        {"role": "user", "content": [{"type": "text", "text": "Weather in Oslo?"}], "name": "ann"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Oslo", "days": 1}},
                }
            ],
        },
        {"role": "tool", "content": "sunny", "tool_call_id": "c1", "name": "get_weather"},
    ]
    msgs, native = member_messages(smol, history, [WEATHER], "auto")
    assert native is None and msgs[0]["role"] == "system" and '"name": "get_weather"' in msgs[0]["content"]
    assert msgs[1]["content"] == "ann: Weather in Oslo?"
    call = json.loads(msgs[2]["content"].split(TOOL_OPEN)[1].split(TOOL_CLOSE)[0])
    assert call == {"name": "get_weather", "arguments": {"city": "Oslo", "days": 1}}
    assert msgs[3] == {"role": "tool", "content": "[get_weather] sunny", "tool_call_id": "c1", "name": "get_weather"}
    prompt = render_chat(smol, msgs)
    assert "sunny" in prompt and prompt.endswith("<|im_start|>assistant\n")
    # tool_choice "none": no tools in the prompt at all
    msgs, native = member_messages(smol, history[:1], [WEATHER], "none")
    assert all(m["role"] != "system" for m in msgs) and native is None
    # an existing system message is extended, not replaced
    msgs, _ = member_messages(smol, [{"role": "system", "content": "Be brief."}, history[0]], [WEATHER], "auto")
    assert msgs[0]["content"].startswith("Be brief.") and "get_weather" in msgs[0]["content"]


# ---- through the engine (tiny random-weight models: values are noise, the call is well formed) --
def test_engine_forced_call_is_well_formed(tiny_dirs):
    eng = Ensemble([tiny_dirs["smol"], tiny_dirs["gemma"]], method="safe")
    weather = {
        "type": "function",
        "function": {
            **WEATHER["function"],
            "parameters": {
                **WEATHER["function"]["parameters"],
                "properties": {
                    "city": {"type": "string", "maxLength": 8},
                    "days": {"type": "integer", "minimum": 1, "maximum": 9},
                },
            },
        },
    }
    res = eng.generate("Weather in Oslo for 2 days?", tools=[weather], tool_choice="required", max_new_tokens=40)
    assert res.finish_reason == "tool_calls"  # random weights: the values are noise, the call is valid
    (call,) = res.tool_calls
    assert call.name == "get_weather" and set(call.arguments) <= {"city", "days"} and "city" in call.arguments
    assert isinstance(call.arguments["city"], str) and len(call.arguments["city"]) <= 8
    # a forced call is a bare call object: the tags' tokens go to the arguments
    assert res.text == "" and TOOL_OPEN not in res.raw_text and res.raw_text.startswith('{"name": "get_weather"')
    assert res.stats["constraint"] == "lark" and res.stats["tokens_out"] <= 40
    assert res.usage.completion_tokens > 0


def test_engine_tool_errors(tiny_dirs):
    eng = Ensemble([tiny_dirs["smol"]])
    with pytest.raises(RequestError, match="not among the tools"):
        eng.generate("hi", tools=[ADD], tool_choice="mul")
    with pytest.raises(RequestError, match="raw=False"):
        eng.generate("hi", tools=[ADD], raw=True)
    with pytest.raises(RequestError, match="timeout"):
        eng.generate("hi", timeout=0)
    assert eng.generate("hi", max_new_tokens=2).usage.completion_tokens <= 2  # still usable


def test_engine_timeout_raises_and_engine_survives(tiny_dirs):
    from ensemble_llm import RequestTimeout

    eng = Ensemble([tiny_dirs["smol"]])
    with pytest.raises(RequestTimeout, match="timeout"):
        eng.generate("hi", max_new_tokens=400, timeout=1e-6)
    assert eng.generate("hi", max_new_tokens=3).finish_reason in ("stop", "length")


def test_shared_engine_is_one_object(tiny_dirs):
    a = Ensemble.shared([tiny_dirs["smol"], tiny_dirs["gemma"]], "safe", {"lookahead": 3})
    b = Ensemble.shared([tiny_dirs["smol"], tiny_dirs["gemma"]], "safe", {"lookahead": 3})
    c = Ensemble.shared([tiny_dirs["smol"], tiny_dirs["gemma"]], "safe", {"lookahead": 4})
    assert a is b and a is not c
    assert Ensemble([tiny_dirs["smol"], tiny_dirs["gemma"]]).method_name == "auto"
    assert Ensemble([tiny_dirs["smol"]]).method_name == "single"
    assert a.context_window == 2048


def test_tool_choice_none_cuts_calls_from_content(tiny_dirs, monkeypatch):
    """With tool_choice="none" no call is returned, and call markup never reaches the content."""
    from ensemble_llm.methods.single import Single

    script = f'Sure. {TOOL_OPEN}{{"name": "add", "arguments": {{"a": 1, "b": 2}}}}{TOOL_CLOSE} Done.'

    def scripted_run(self, req):  # a stand-in method run: the text a model imitating its history writes
        req.stats.tokens_out = 5
        yield from (script[i : i + 7] for i in range(0, len(script), 7))

    monkeypatch.setattr(Single, "run", scripted_run)
    eng = Ensemble([tiny_dirs["smol"]])
    none = eng.generate("hi", tools=[ADD], tool_choice="none")
    assert none.tool_calls == [] and TOOL_OPEN not in none.text and none.stats["ignored_tool_calls"] == 1
    assert none.text.startswith("Sure.") and none.text.endswith("Done.") and none.finish_reason != "tool_calls"
    auto = eng.generate("hi", tools=[ADD])
    assert [c.arguments for c in auto.tool_calls] == [{"a": 1, "b": 2}] and auto.finish_reason == "tool_calls"
    streamed = "".join(eng.stream("hi", tools=[ADD], tool_choice="none"))
    assert streamed == none.text


def test_repeated_call_from_history_is_dropped(tiny_dirs, monkeypatch):
    from ensemble_llm.methods.single import Single

    script = f'The sum is 3. {TOOL_OPEN}{{"name": "add", "arguments": {{"b": 2, "a": 1}}}}{TOOL_CLOSE}'

    def scripted_run(self, req):
        req.stats.tokens_out = 5
        yield script

    monkeypatch.setattr(Single, "run", scripted_run)
    eng = Ensemble([tiny_dirs["smol"]])
    history = [
        {"role": "user", "content": "1+2?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}
            ],
        },
        {"role": "tool", "content": "3", "tool_call_id": "c1"},
    ]
    res = eng.generate(history, tools=[ADD])
    assert res.tool_calls == [] and res.text == "The sum is 3." and res.stats["repeated_tool_calls_dropped"] == 1
    fresh = eng.generate(history[:1], tools=[ADD])  # not made before: returned
    assert [c.arguments for c in fresh.tool_calls] == [{"a": 1, "b": 2}]
    script = f'{TOOL_OPEN}{{"name": "add", "arguments": {{"b": 2, "a": 1}}}}{TOOL_CLOSE}'  # only the repeat:
    again = eng.generate(history, tools=[ADD])  # asked again with tools off, markup cut from the text
    assert again.tool_calls == [] and again.stats["answered_without_tools_after_repeated_call"]
    assert again.stats["ignored_tool_calls"] == 1 and again.text == ""


def test_self_referencing_schema_fails_fast_and_engine_survives(tiny_dirs):
    """Reliability D1: a $ref cycle with no type used to loop forever in the worker."""
    eng = Ensemble([tiny_dirs["smol"]])
    loop = {
        "type": "function",
        "function": {
            "name": "f",
            "parameters": {
                "$defs": {"A": {"$ref": "#/$defs/A"}},
                "type": "object",
                "properties": {"a": {"$ref": "#/$defs/A"}},
            },
        },
    }
    with pytest.raises(RequestError, match="refers back to itself|allows no output"):
        eng.generate("hi", tools=[loop], tool_choice="f", timeout=5)
    bad = {"type": "function", "function": {"name": "g", "parameters": {"type": "object", "properties": "x"}}}
    with pytest.raises(RequestError, match="properties"):
        eng.generate("hi", tools=[bad], tool_choice="g")
    assert eng.generate("hi", max_new_tokens=2).usage.completion_tokens <= 2  # still usable


def test_recursive_optional_model_is_a_valid_forced_call(tiny_dirs):
    """A tree (`child: Optional[Node]`, pydantic's schema) through a forced call: the grammar
    allows any depth, the call parses and validates (or the budget ends it)."""
    node = {
        "$defs": {
            "Node": {
                "type": "object",
                "properties": {
                    "value": {"type": "string", "maxLength": 4},
                    "child": {"anyOf": [{"$ref": "#/$defs/Node"}, {"type": "null"}]},
                },
                "required": ["value", "child"],
            }
        },
        "$ref": "#/$defs/Node",
    }
    tool = {"type": "function", "function": {"name": "Node", "parameters": node}}
    eng = Ensemble([tiny_dirs["smol"]])
    res = eng.generate("A tree please.", tools=[tool], tool_choice="Node", max_new_tokens=80)
    if res.finish_reason == "tool_calls":
        jsonschema.validate(res.tool_calls[0].arguments, node)
    else:
        assert res.finish_reason == "length" and not res.tool_calls


@pytest.mark.parametrize("params", [{"type": "object", "properties": {}}, {}, None])
def test_forced_call_without_properties_is_a_call_with_empty_arguments(tiny_dirs, params):
    """Reliability D8: no '"arguments": null', no raw markup in the text."""
    eng = Ensemble([tiny_dirs["smol"]])
    fn = {"name": "ping", **({} if params is None else {"parameters": params})}
    res = eng.generate("Ping the server.", tools=[{"type": "function", "function": fn}], tool_choice="ping")
    assert [(c.name, c.arguments) for c in res.tool_calls] == [("ping", {})]
    assert TOOL_OPEN not in res.text and res.finish_reason == "tool_calls"


def test_tool_schemas_are_checked_against_the_meta_schema(tiny_dirs):
    eng = Ensemble([tiny_dirs["smol"]])
    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}
    with pytest.raises(RequestError, match="not a valid JSON Schema"):
        eng.generate("hi", tools=[bad])
    assert eng.generate("hi", max_new_tokens=2).usage.completion_tokens <= 2
