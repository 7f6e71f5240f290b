"""The bad-input corpus (reliability issue): every case through the engine, the constructor or
one of the two facades, each with its expected outcome (an error class and a phrase of its
message, or an accepted result), and each followed by a valid request on the same engine.

Outcomes counted as failures: a silent acceptance (a case that should raise and did not), an
unclear error (wrong class or a message without the phrase that names the problem), a hang (the
per-case timeout), a crash (any exception that is not ours). Text-level cases (arbitrary Unicode,
surrogates, control characters) come from hypothesis."""

from __future__ import annotations

import json
import math
import re
from typing import Optional

import pytest
from helpers import NODE_SCHEMA
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from ensemble_llm import ConfigError, Ensemble, GenerationResult, ModelNotFoundError, RequestError, SafeConfig

OK = "ok"
TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CALL = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}


def _fmt(schema):
    return {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}


def _doubling(levels):
    """`levels` definitions each referring twice to the next (2-3 KB; unrolled: 2**levels copies)."""
    defs = {f"d{levels}": {"type": "string"}}
    for i in range(levels):
        ref = {"$ref": f"#/$defs/d{i + 1}"}
        defs[f"d{i}"] = {"type": "object", "properties": {"a": ref, "b": dict(ref)}, "required": ["a", "b"]}
    return {"$ref": "#/$defs/d0", "$defs": defs}


def _nested(levels):
    schema = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


NODE = NODE_SCHEMA  # pydantic's schema of Node(name: str, child: Optional[Node]), child required


def _tool(name="f", parameters=None, **extra):
    fn = {"name": name, **extra}
    if parameters is not None:
        fn["parameters"] = parameters
    return {"type": "function", "function": fn}


@pytest.fixture(scope="module")
def engine(tiny_dirs):
    return Ensemble([tiny_dirs["smol"], tiny_dirs["gemma"]], method="unite", config={"weights": None}).load()


@pytest.fixture(scope="module")
def smc_engine(tiny_dirs):
    return Ensemble(
        [tiny_dirs["smol"], tiny_dirs["gemma"]], method="smc", config={"weights": None, "n_particles": 2}
    ).load()


def _still_usable(engine):
    res = engine.generate("Say hi.", max_new_tokens=2)
    assert isinstance(res, GenerationResult) and res.finish_reason in ("stop", "length")


def _expect(call, expected):
    """Run `call` and compare its outcome with `expected` (OK or (error class, phrase))."""
    if expected == OK:
        out = call()
        if isinstance(out, GenerationResult):
            assert out.finish_reason in ("stop", "length", "tool_calls")
            out.text.encode("utf-8")  # valid Unicode, no lone surrogate
            assert not out.text.endswith("\ufffd")
        return out
    cls, phrase = expected
    with pytest.raises(cls) as info:
        call()
    # our own errors say what is wrong; pydantic's ValidationError wraps ours and keeps the text
    assert re.search(phrase, str(info.value), re.IGNORECASE), (
        f"unclear error: {type(info.value).__name__}: {info.value}"
    )
    return None


class Node(BaseModel):
    name: str
    child: Optional["Node"]


# ---- requests through the engine --------------------------------------------------------------
def msg(content, role="user", **kw):
    return [{"role": role, "content": content, **kw}]


REQUESTS = [
    # prompts
    ("", {}, (RequestError, "prompt is empty")),
    ("   \n\t ", {}, (RequestError, "prompt is empty")),
    (None, {}, (RequestError, "prompt must be a string")),
    (123, {}, (RequestError, "prompt must be a string")),
    (b"bytes", {}, (RequestError, "prompt must be a string")),
    ({"role": "user", "content": "hi"}, {}, (RequestError, "prompt must be a string")),
    ([], {}, (RequestError, "message list is empty")),
    ([None], {}, (RequestError, "message 0 must be a dict")),
    (["hi"], {}, (RequestError, "message 0 must be a dict")),
    ([{"role": "bot", "content": "x"}], {}, (RequestError, "'role'")),
    ([{"content": "x"}], {}, (RequestError, "'role'")),
    ([{"role": "user"}], {}, (RequestError, "no text content")),
    (msg(None), {}, (RequestError, "no text content")),
    (msg(""), {}, (RequestError, "no text content")),
    (msg("   "), {}, (RequestError, "no text content")),
    (msg({"a": 1}), {}, (RequestError, "content must be a string or a list of text parts")),
    (msg(42), {}, (RequestError, "content must be a string")),
    (
        msg([{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]),
        {},
        (RequestError, "'image_url'.*cannot read"),
    ),
    (msg([{"type": "text", "text": "hi"}, {"type": "image", "data": "AAAA"}]), {}, (RequestError, "part 1 is 'image'")),
    (msg([{"type": "input_audio", "input_audio": {}}]), {}, (RequestError, "'input_audio'")),
    (msg([42]), {}, (RequestError, "part 0 is 'int'")),
    (msg([{"type": "text", "text": None}]), {}, (RequestError, "part 0.*no string 'text'")),
    (msg([{"type": "text"}]), {}, (RequestError, "part 0.*no string 'text'")),
    (msg([]), {}, (RequestError, "no text content")),
    (msg("a\ud800b"), {}, (RequestError, "lone surrogate")),
    ("a\udc80", {}, (RequestError, "lone surrogate")),
    (msg("x", role="assistant", tool_calls=[{"bad": 1}]), {}, (RequestError, "tool_calls belong")),
    (msg("x", tool_calls=[CALL]), {}, (RequestError, "tool_calls belong to assistant")),
    (msg("x", role="assistant", tool_calls="get_weather"), {}, (RequestError, "tool_calls")),
    (msg("x", role="assistant", tool_calls=[{"function": {"arguments": "{}"}}]), {}, (RequestError, "tool_calls")),
    (
        [
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": "", "tool_calls": [CALL]},
            {"role": "tool", "content": "sunny", "tool_call_id": "c1"},
        ],
        {},
        OK,
    ),
    ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}], {}, OK),
    (msg([{"type": "text", "text": "hi"}, "there"]), {}, OK),
    ("hi", {"raw": True}, OK),
    (msg("hi"), {"raw": True}, (RequestError, "raw=True takes a prompt string")),
    ("hi", {"raw": "yes"}, (RequestError, "raw must be True or False")),
    ("word " * 5000, {}, (RequestError, "context window")),
    # max_new_tokens
    *[("hi", {"max_new_tokens": v}, (RequestError, "max_new_tokens")) for v in (0, -1, 1.5, "4", None, True, math.nan)],
    # temperature
    *[
        ("hi", {"temperature": v}, (RequestError, "temperature"))
        for v in (-0.1, math.nan, math.inf, -math.inf, "0.5", None, True)
    ],
    ("hi", {"temperature": 0}, OK),
    ("hi", {"temperature": 100.0, "seed": 1}, OK),
    # top_p
    *[("hi", {"top_p": v}, (RequestError, "top_p")) for v in (0, -0.5, 1.5, math.nan, math.inf, "1", None, True)],
    ("hi", {"top_p": 0.01, "temperature": 1.0, "seed": 3}, OK),
    # seed
    *[("hi", {"seed": v}, (RequestError, "seed")) for v in (-1, 2**64, 2**63, 1.5, "7", True)],
    ("hi", {"seed": 2**63 - 1}, OK),
    # timeout
    *[("hi", {"timeout": v}, (RequestError, "timeout")) for v in (0, -1, math.nan, math.inf, "5", True)],
    ("hi", {"timeout": 1e-9}, (Exception, "timeout=")),  # RequestTimeout: the deadline passed at once
    # max_retries
    *[("hi", {"max_retries": v}, (RequestError, "max_retries")) for v in (-1, 1.5, "2", True, 101, None)],
    # stop
    *[
        ("hi", {"stop": v}, (RequestError, "stop must be a string or a list of strings"))
        for v in (123, [1], [None], ["a", 2], {"a"}, b"x", 4.5)
    ],
    ("hi", {"stop": ["\ud800"]}, (RequestError, "lone surrogate")),
    ("hi", {"stop": ""}, OK),
    ("hi", {"stop": [""]}, OK),
    ("hi", {"stop": ["a"] * 50}, OK),
    # unknown keyword
    ("hi", {"max_tokens": 4}, (TypeError, "max_tokens")),
    ("hi", {"tempreature": 0.5}, (TypeError, "tempreature")),
    # tools
    ("hi", {"tools": "get_weather"}, (RequestError, "tools must be a list")),
    ("hi", {"tools": {"a": 1}}, (RequestError, "tools must be a list")),
    ("hi", {"tools": [{}]}, (RequestError, "tool 0 must look like")),
    ("hi", {"tools": [None]}, (RequestError, "tool 0 must look like")),
    ("hi", {"tools": [{"type": "function"}]}, (RequestError, "tool 0 must look like")),
    ("hi", {"tools": [_tool("")]}, (RequestError, "tool 0 must look like")),
    ("hi", {"tools": [_tool(5)]}, (RequestError, "tool 0 must look like")),
    ("hi", {"tools": [TOOL, TOOL]}, (RequestError, "two tools are named")),
    ("hi", {"tools": [_tool("f", "a string")]}, (RequestError, "'parameters' must be a JSON Schema object")),
    ("hi", {"tools": [_tool("f", [1, 2])]}, (RequestError, "'parameters' must be a JSON Schema object")),
    ("hi", {"tools": [_tool("f", {"type": "object", "properties": "x"})]}, (RequestError, "not a valid JSON Schema")),
    ("hi", {"tools": [_tool("f", {"type": "objekt"})]}, (RequestError, "not a valid JSON Schema")),
    ("hi", {"tools": [_tool("f", {"type": "object", "required": "city"})]}, (RequestError, "not a valid JSON Schema")),
    (
        "hi",
        {"tools": [_tool("f", {"$defs": {"A": {"$ref": "#/$defs/A"}}, "$ref": "#/$defs/A"})], "tool_choice": "f"},
        (RequestError, r"\$ref"),
    ),
    (
        "hi",
        {
            "tools": [_tool("f", {"type": "object", "properties": {"x": {"$ref": "#/$defs/missing"}}})],
            "tool_choice": "f",
        },
        (RequestError, r"\$ref"),
    ),
    ("hi", {"tools": [TOOL], "tool_choice": "nope"}, (RequestError, "not among the tools")),
    ("hi", {"tools": [TOOL], "tool_choice": 5}, (RequestError, "tool_choice must be")),
    ("hi", {"tools": [TOOL], "tool_choice": {"type": "function"}}, (RequestError, "tool_choice dict names no tool")),
    (
        "hi",
        {"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "g"}}},
        (RequestError, "not among the tools"),
    ),
    ("hi", {"tool_choice": "required"}, (RequestError, "needs at least one tool")),
    ("hi", {"tool_choice": "get_weather"}, (RequestError, "not among the tools")),
    ("hi", {"tools": [TOOL], "raw": True}, (RequestError, "tools need a chat prompt")),
    ("hi", {"tools": []}, OK),
    # a forced call whose shortest form cannot fit the budget is refused, saying what it needs
    (
        "hi",
        {"tools": [_tool("noargs")], "tool_choice": "noargs", "max_new_tokens": 1},
        (RequestError, r"forced tool call needs at least \d+ tokens.*max_new_tokens\) is 1"),
    ),
    ("hi", {"tools": [_tool("noargs")], "tool_choice": "noargs", "max_new_tokens": 16}, OK),
    (
        "Weather in Paris?",
        {"tools": [TOOL], "tool_choice": "get_weather", "max_new_tokens": 3},
        (RequestError, r"needs at least \d+ tokens"),
    ),
    ("Weather in Paris?", {"tools": [TOOL], "tool_choice": "get_weather", "max_new_tokens": 24}, OK),
    (
        [{"role": "user", "content": "hi"}, {"role": "tool", "content": "42"}],
        {},
        (RequestError, r"message 1 \(tool\) has no tool_call_id"),
    ),
    (
        [{"role": "user", "content": "hi"}, {"role": "tool", "content": "42", "tool_call_id": ""}],
        {},
        (RequestError, "tool_call_id"),
    ),
    ("hi", {"tools": [TOOL], "tool_choice": "none", "max_new_tokens": 3}, OK),
    ("hi", {"tools": [TOOL], "tool_choice": "auto", "max_new_tokens": 3}, OK),
    # a schema's size is bounded before anything else reads it (OpenAI's limits, and unrolling's node budget)
    (
        "hi",
        {"response_format": _fmt(_doubling(16))},
        (RequestError, r"response_format: the JSON Schema grows past 10000"),
    ),
    ("hi", {"response_format": _fmt(_doubling(24))}, (RequestError, "grows past 10000 JSON objects")),
    (
        "hi",
        {"tools": [_tool("f", _doubling(20))], "tool_choice": "f"},
        (RequestError, r"tool 'f': the JSON Schema grows"),
    ),
    ("hi", {"tools": [_tool("f", _doubling(20))], "max_new_tokens": 3}, OK),  # never unrolled: no call is forced
    ("hi", {"response_format": _fmt(_nested(11))}, (RequestError, "nests objects 11 levels deep, more than the 10")),
    ("hi", {"response_format": _fmt(_nested(10)), "max_new_tokens": 48}, OK),
    ("hi", {"response_format": _fmt({"enum": list(range(1001))})}, (RequestError, "more than 1000 enum values")),
    (
        "hi",
        {"response_format": _fmt({"type": "object", "properties": {f"p{i}": {} for i in range(5001)}})},
        (RequestError, "more than 5000 object properties"),
    ),
    ("hi", {"response_format": _fmt({"enum": ["x" * 120_001]})}, (RequestError, "more than 120000 characters")),
    ("hi", {"response_format": _fmt(json.loads('{"not": ' * 70 + "{}" + "}" * 70))}, (RequestError, "64 levels")),
    (
        "hi",
        {"tools": [_tool("f", json.loads('{"not": ' * 70 + "{}" + "}" * 70))]},
        (RequestError, "tool 'f'.*64 levels"),
    ),
    # structured output whose shortest document cannot fit the budget: refused, saying what it needs
    (
        "hi",
        {"response_format": _fmt(NODE), "max_new_tokens": 8},
        (RequestError, r"structured output \(json_schema\) needs at least \d+ tokens.*max_new_tokens\) is 8"),
    ),
    ("hi", {"response_format": _fmt(NODE), "max_new_tokens": 40}, OK),
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("prompt, kw, expected", REQUESTS, ids=[f"req{i}" for i in range(len(REQUESTS))])
def test_request_corpus(engine, prompt, kw, expected):
    _expect(lambda: engine.generate(prompt, **kw), expected)
    _still_usable(engine)


def test_a_huge_max_new_tokens_ends_at_the_context_window(tiny_dirs):
    """max_new_tokens=10**6 is accepted and capped where the context window ends (a 64-token member)."""
    eng = Ensemble([tiny_dirs["smol_short"], tiny_dirs["gemma"]], method="unite", config={"weights": None})
    res = eng.generate("x" * 3, max_new_tokens=10**6)
    assert res.finish_reason in ("length", "stop") and res.usage.completion_tokens < 64
    _still_usable(eng)


@pytest.mark.parametrize(
    "kw, expected",
    [
        ({"top_p": 0.5}, (RequestError, "smc.*top_p")),
        ({"top_p": 1.0, "max_new_tokens": 2}, OK),
        ({"temperature": math.inf}, (RequestError, "temperature")),
    ],
)
def test_smc_request_corpus(smc_engine, kw, expected):
    _expect(lambda: smc_engine.generate("hi", **kw), expected)
    _still_usable(smc_engine)


def test_method_request_checks_run_before_queueing(smc_engine):
    # check_request alone raises: nothing was queued or loaded for it
    with pytest.raises(RequestError, match="top_p"):
        smc_engine.check_request("hi", top_p=0.9)


# ---- constructors ----------------------------------------------------------------------
def _ctor_cases(tiny):
    s, g = tiny["smol"], tiny["gemma"]
    pair = [s, g]
    cases = [
        (dict(members=[]), (ConfigError, "members is empty")),
        (dict(members=[123]), (ConfigError, "a member must be a model name")),
        (dict(members=[None, s]), (ConfigError, "a member must be a model name")),
        (dict(members=["no-such-model"]), (ModelNotFoundError, "unknown model 'no-such-model'")),
        (dict(members=["/nonexistent/m.gguf"]), (ModelNotFoundError, "does not exist")),
        (dict(members=["./relative/missing"]), (ModelNotFoundError, "unknown model")),
        (dict(members=[{"preamble": []}]), (ConfigError, "needs a 'model'")),
        (dict(members=[{"model": s, "extra": 1}]), (ConfigError, "needs a 'model' and may have")),
        (dict(members=[{"model": s, "preamble": "be nice"}, g]), (ConfigError, "preamble")),
        (dict(members=[{"model": s, "preamble": [{"role": "robot", "content": "x"}]}, g]), (ConfigError, "preamble")),
        (dict(members=pair, method="nope"), (ConfigError, "unknown method 'nope'")),
        (dict(members=pair, method=5), (ConfigError, "method must be a method name")),
        (dict(members=[s], method="safe"), (ConfigError, "2")),
        (dict(members=[s], method="unite"), (ConfigError, "2")),
        (dict(members=[s], method="specfuse"), (ConfigError, "2")),
        (dict(members=[s], method="smc"), (ConfigError, "K >= 2")),
        (dict(members=pair, method="unite", config=SafeConfig()), (ConfigError, "needs a UniteConfig")),
        (dict(members=pair, method="safe", config=5), (ConfigError, "needs a SafeConfig")),
        (dict(members=pair, method="safe", config={"bogus": 1}), (ConfigError, "no field.*bogus")),
        (dict(members=pair, device=["cpu"]), (ConfigError, "device lists 1 entries for 2 members")),
        (dict(members=pair, device="cuda:7"), (ConfigError, "cuda")),
        (dict(members=pair, device="tpu"), (ConfigError, "tpu")),
        (dict(members=pair, dtype="int8"), (ConfigError, "dtype 'int8'")),
        (dict(members=pair, method="single", config={"member": 5}), (ConfigError, "member")),
        (dict(members=pair, method="single", config={"member": -1}), (ConfigError, "member")),
        (dict(members=pair, method="single", config={"member": 1}), OK),
        (dict(members=pair, method="safe"), OK),
        (
            dict(
                members=[
                    {"model": s, "preamble": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]},
                    g,
                ]
            ),
            OK,
        ),
    ]
    bad_configs = {
        "safe": [
            {"lookahead": 0},
            {"lookahead": -2},
            {"top_k": 0},
            {"top_k": 10**9},
            {"consensus": 2},
            {"consensus": math.nan},
            {"weights": [1]},
            {"weights": [math.nan, 1]},
            {"weights": [math.inf, 1]},
            {"weights": [-1, 1]},
            {"weights": "uniform"},
            {"drafter": 5},
            {"drafter": -1},
            {"sharpen": "x"},
            {"max_lookahead": 0},
        ],
        "unite": [
            {"top_k": 0},
            {"top_k": 10**9},
            {"primary": 3},
            {"weights": [1, 2, 3]},
            {"weights": [math.nan, 1]},
            {"weights": [0, 0]},
        ],
        "specfuse": [
            {"segment_len": 0},
            {"hedge_lr": math.nan},
            {"hedge_lr": -1},
            {"score": "x"},
            {"exit_threshold": 2},
            {"weights": [0, 0]},
            {"weights": [math.inf, 1]},
        ],
        "smc": [
            {"f": "x"},
            {"f": "power"},
            {"tau": 1},
            {"n_particles": 0},
            {"ess_threshold": 2},
            {"beam_width": 0},
            {"prune_threshold": 1},
            {"greedy": "x"},
            {"max_bytes": 0},
            {"weights": [math.nan, 1]},
            {"weights": [1]},
        ],
    }
    for method, configs in bad_configs.items():
        for cfg in configs:
            field = next(iter(cfg))
            phrase = {"tau": "tau", "f": r"\bf\b|tau"}.get(field, field)
            cases.append((dict(members=pair, method=method, config=cfg), (ConfigError, phrase)))
    return cases


N_CTOR = 67  # cases listed by _ctor_cases (checked below so the ids stay stable)


@pytest.mark.parametrize("i", range(N_CTOR))
def test_constructor_corpus(tiny_dirs, engine, i):
    cases = _ctor_cases(tiny_dirs)
    assert len(cases) == N_CTOR
    kw, expected = cases[i]
    _expect(lambda: Ensemble(**kw), expected)  # nothing loads: every check needs no weights
    _still_usable(engine)


# ---- the facades ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def lc(engine):
    from langchain_ensemble_llm import EnsembleLLM

    return EnsembleLLM(engine=engine, max_tokens=2)


@pytest.fixture(scope="module")
def li(engine):
    from llama_index.llms.ensemble_llm import EnsembleLLM

    return EnsembleLLM(engine=engine, max_new_tokens=2)


def _lc_cases():
    from langchain_core.messages import AIMessage, HumanMessage, SystemMessage
    from langchain_ensemble_llm import EnsembleLLM
    from pydantic import ValidationError

    img = HumanMessage(content=[{"type": "image_url", "image_url": {"url": "http://x/y.png"}}])
    return [
        (lambda llm: llm.invoke(""), (RequestError, "no text content")),
        (lambda llm: llm.invoke("   "), (RequestError, "no text content")),
        (lambda llm: llm.invoke([]), (RequestError, "message list is empty")),
        (lambda llm: llm.invoke(None), (ValueError, "Invalid input type")),
        (lambda llm: llm.invoke("hi", stop=123), (RequestError, "stop must be")),
        (lambda llm: llm.invoke("hi", temperature=math.inf), (RequestError, "temperature")),
        (lambda llm: llm.invoke("hi", max_tokens=0), (RequestError, "max_new_tokens")),
        (lambda llm: llm.invoke("hi", seed=-1), (RequestError, "seed")),
        (lambda llm: llm.invoke("hi", top_p=2), (RequestError, "top_p")),
        (lambda llm: llm.invoke("hi", bogus=1), (ValueError, "unsupported call arguments.*bogus")),
        (lambda llm: llm.invoke("hi", model="other"), (ValueError, "cannot switch to model 'other'")),
        (lambda llm: llm.invoke([img]), (RequestError, "'image_url'")),
        (lambda llm: llm.invoke("hi\ud800"), (RequestError, "lone surrogate")),
        (lambda llm: llm.invoke("hi", tool_choice="f"), (RequestError, "not among the tools")),
        (lambda llm: llm.bind_tools([_tool("f", "a string")]).invoke("hi"), (Exception, "parameters|schema")),
        (
            lambda llm: llm.invoke([HumanMessage("hi"), {"role": "tool", "content": "42"}]),
            (RequestError, r"message 1 \(tool\) has no tool_call_id"),
        ),
        (lambda llm: llm.invoke([HumanMessage("hi"), ("tool", "42")]), (RequestError, "message 1.*tool_call_id")),
        (
            lambda llm: llm.bind_tools([TOOL], tool_choice="any").invoke("hi", max_tokens=3),
            (RequestError, r"needs at least \d+ tokens"),
        ),
        (lambda llm: llm.invoke([SystemMessage("x"), AIMessage("y")]), OK),
        (lambda llm: llm.invoke("hi", stop="i"), OK),
        (lambda llm: llm.invoke([HumanMessage("hi")], max_tokens=1), OK),
        (lambda llm: EnsembleLLM(engine=llm.engine, temperature=-1), (ValidationError, "temperature")),
        (lambda llm: EnsembleLLM(engine=llm.engine, max_tokens=0), (ValidationError, "max_tokens")),
        (lambda llm: EnsembleLLM(engine=llm.engine, top_p=0), (ValidationError, "top_p")),
        (lambda llm: EnsembleLLM(engine=llm.engine, timeout=0), (ValidationError, "timeout")),
        (lambda llm: EnsembleLLM(engine=llm.engine, max_retries=-1), (ValidationError, "max_retries")),
        (lambda llm: EnsembleLLM(engine=llm.engine, bogus=1), (ValidationError, "bogus")),
        (lambda llm: EnsembleLLM(members=[]), (ValidationError, "members is empty")),
        (lambda llm: EnsembleLLM(members=["no-such-model"]), (ValidationError, "unknown model")),
        (lambda llm: EnsembleLLM(engine="not an engine"), (ValidationError, "engine")),
        (lambda llm: EnsembleLLM(engine=llm.engine, max_retries=2).invoke("hi"), OK),
        (
            lambda llm: EnsembleLLM(engine=llm.engine, max_tokens=8).with_structured_output(Node).invoke("A tree."),
            (RequestError, r"structured output \(json_schema\) needs at least \d+ tokens.*is 8"),
        ),
    ]


def _li_cases():
    from llama_index.core.base.llms.types import ChatMessage
    from llama_index.core.prompts import PromptTemplate
    from llama_index.llms.ensemble_llm import EnsembleLLM
    from pydantic import ValidationError

    return [
        (lambda llm: llm.complete(""), (RequestError, "no text content")),
        (lambda llm: llm.complete("  "), (RequestError, "no text content")),
        (lambda llm: llm.chat([]), (RequestError, "message list is empty")),
        (lambda llm: llm.complete("hi", temperature=math.inf), (RequestError, "temperature")),
        (lambda llm: llm.complete("hi", max_new_tokens=-3), (RequestError, "max_new_tokens")),
        (lambda llm: llm.complete("hi", seed=2**64), (RequestError, "seed")),
        (lambda llm: llm.complete("hi", stop=123), (RequestError, "stop must be")),
        (lambda llm: llm.complete("hi", bogus=1), (TypeError, "unsupported call arguments.*bogus")),
        (lambda llm: llm.complete("hi\udc80"), (RequestError, "lone surrogate")),
        (lambda llm: llm.chat([ChatMessage(role="user", content=None)]), (RequestError, "no text content")),
        (
            lambda llm: llm.chat([ChatMessage(role="user", content="hi"), ChatMessage(role="tool", content="42")]),
            (RequestError, r"message 1 \(tool\) has no tool_call_id"),
        ),
        (lambda llm: llm.complete("hi", formatted=True), OK),
        (lambda llm: llm.complete("hi", stop="i"), OK),
        (lambda llm: EnsembleLLM(engine=llm.engine, temperature=-1), (ValidationError, "temperature")),
        (lambda llm: EnsembleLLM(engine=llm.engine, max_new_tokens=0), (ValidationError, "max_new_tokens")),
        (lambda llm: EnsembleLLM(engine=llm.engine, max_retries=-1), (ValidationError, "max_retries")),
        (lambda llm: EnsembleLLM(members=[]), (ValidationError, "members is empty")),
        (lambda llm: EnsembleLLM(engine=llm.engine, max_retries=1).complete("hi"), OK),
        (  # the issue's case: pydantic used to fail on a cut '{"name": "", "child": nul'
            lambda llm: EnsembleLLM(engine=llm.engine, max_new_tokens=8).structured_predict(
                Node, PromptTemplate("A tree named {name}."), name="root"
            ),
            (RequestError, r"structured output \(json_schema\) needs at least \d+ tokens.*is 8"),
        ),
    ]


N_LC, N_LI = 32, 19


@pytest.mark.parametrize("i", range(N_LC))
def test_langchain_corpus(lc, engine, i):
    cases = _lc_cases()
    assert len(cases) == N_LC
    call, expected = cases[i]
    _expect(lambda: call(lc), expected)
    assert lc.invoke("Say hi.").content is not None
    _still_usable(engine)


@pytest.mark.parametrize("i", range(N_LI))
def test_llamaindex_corpus(li, engine, i):
    cases = _li_cases()
    assert len(cases) == N_LI
    call, expected = cases[i]
    _expect(lambda: call(li), expected)
    assert li.complete("Say hi.").text is not None
    _still_usable(engine)


def test_corpus_size():
    assert len(REQUESTS) + 3 + N_CTOR + N_LC + N_LI >= 150


# ---- text-level cases from hypothesis -----------------------------------------------------------
ANY_CHAR = st.characters(codec=None, categories=None)  # every code point, surrogates and controls included


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(ANY_CHAR, max_size=30))
def test_arbitrary_unicode_prompts(engine, text):
    try:
        text.encode("utf-8")
        valid = True
    except UnicodeEncodeError:
        valid = False
    if not valid:
        expected = (RequestError, "lone surrogate")
    elif not text.strip():
        expected = (RequestError, "prompt is empty")
    else:
        expected = OK
    _expect(lambda: engine.generate(text, max_new_tokens=2), expected)
    _still_usable(engine)


@settings(max_examples=30, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(ANY_CHAR, min_size=1, max_size=12), stop=st.lists(st.text(ANY_CHAR, max_size=4), max_size=3))
def test_arbitrary_unicode_messages_and_stops(engine, text, stop):
    def valid(s):
        try:
            s.encode("utf-8")
            return True
        except UnicodeEncodeError:
            return False

    if not valid(text):
        expected = (RequestError, "lone surrogate")
    elif not text.strip():
        expected = (RequestError, "no text content")
    elif not all(valid(s) for s in stop):
        expected = (RequestError, "lone surrogate")
    else:
        expected = OK
    out = _expect(lambda: engine.generate(msg(text), max_new_tokens=3, stop=stop), expected)
    if out is not None:
        assert not any(s and s in out.text for s in stop)  # a stop string never shows
    _still_usable(engine)
