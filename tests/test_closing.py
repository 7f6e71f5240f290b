"""Budget-aware closing (issue 23): under a grammar, when the budget left is just what the
shortest completion needs, every method writes that completion, so a constrained reply that can
fit its budget always parses and validates; required recursive fields at every depth; tool
messages without an id; forced calls that cannot fit."""

from __future__ import annotations

import json
from typing import Literal, Optional

import jsonschema
import pytest
from helpers import TINY_METHODS, tiny_pair_for
from pydantic import BaseModel, Field

from ensemble_llm import Ensemble, RequestError
from ensemble_llm.constraints import MAX_RECURSION, Constraint
from ensemble_llm.guide import Guide
from ensemble_llm.tools import TOOL_CLOSE, TOOL_OPEN, parse_tool_calls, tool_call_constraint


class Poem(BaseModel):
    title: str
    lines: str = Field(description="two lines separated by a newline")
    mood: Literal["happy", "sad", "calm"]


class Node(BaseModel):
    name: str
    child: Optional["Node"]


ITEMS = {
    "type": "object",
    "properties": {
        "items": {
            "type": "array",
            "minItems": 2,
            "items": {
                "type": "object",
                "properties": {"label": {"type": "string", "minLength": 3}, "n": {"type": "integer"}},
                "required": ["label", "n"],
            },
        },
        "note": {"type": "string"},
    },
    "required": ["items", "note"],
}
CODE = {
    "type": "object",
    "properties": {
        "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["code", "tags"],
}
SCHEMAS = {"poem": Poem.model_json_schema(), "node": Node.model_json_schema(), "items": ITEMS, "code": CODE}


# ---- the shortest completion ------------------------------------------------------------------
@pytest.mark.parametrize(
    "name, prefix",
    [
        ("poem", b'{"title": "The Sea", "lines": "The sea is'),
        ("poem", b""),
        ("poem", b'{"title'),
        ("node", b'{"name": "root", "child'),
        ("node", b'{"name": "a", "child": {"name": "b", "child": {"na'),
        ("items", b'{"items": [{"label": "x'),
        ("items", b'{"items": [{"label": "abc", "n": 12'),
        ("code", b'{"code": "A'),
        ("code", b'{"code": "ABC-12", "tags": ["x'),
    ],
)
def test_shortest_completion_finishes_every_prefix_validly(name, prefix):
    c = Constraint.json_schema(SCHEMAS[name])
    tail = Guide(c, []).completion(prefix)
    assert tail is not None, prefix
    doc = json.loads((prefix + tail).decode())
    jsonschema.validate(doc, SCHEMAS[name])


def test_shortest_completion_is_the_shortest_where_it_is_known():
    g = Guide(Constraint.json_schema(SCHEMAS["poem"]), [])
    # close the string, fill the required enum with its shortest value, close the object
    assert g.completion(b'{"title": "The Sea", "lines": "The sea is') == b'", "mood": "sad"}'
    g = Guide(Constraint.json_schema(SCHEMAS["node"]), [])
    assert g.completion(b'{"name": "root", "child') == b'": null}'
    assert g.completion(b'{"name": "x", "child": null}') == b""


# ---- required recursive fields -----------------------------------------------------------------
def test_a_required_recursive_field_is_required_at_every_depth_and_null_at_the_bound():
    c = Constraint.json_schema(SCHEMAS["node"])
    assert not c.matches('{"name": "tree"}')  # "Field required" in pydantic: refused by the grammar
    doc = "null"
    for depth in range(MAX_RECURSION):
        doc = f'{{"name": "n{depth}", "child": {doc}}}'
        assert c.matches(doc), doc
        assert not c.matches(doc.replace(', "child": null', "")), doc  # missing at the deepest level
        Node.model_validate_json(doc)
    deeper = f'{{"name": "top", "child": {doc}}}'  # one level past the bound: only null was left
    assert not c.matches(deeper)


# ---- every method, tiny models, tight budgets ---------------------------------------------------
# smc's cases are the slowest (about 20 s): the full run keeps them, the fast tier skips them
METHODS = [pytest.param((m, c), id=m, marks=[pytest.mark.slow] if m == "smc" else []) for m, c in TINY_METHODS]


@pytest.fixture(scope="module", params=METHODS)
def engine(request, tiny_dirs):
    method, config = request.param
    members = tiny_pair_for(method, tiny_dirs)
    return Ensemble(members, method=method, config=config).load()


@pytest.mark.parametrize("name, budget", [("poem", 24), ("node", 30), ("items", 40), ("code", 20)])
def test_every_method_closes_a_constrained_reply_within_its_budget(engine, name, budget):
    """Random-weight members write strings that never end on their own: without closing, every
    one of these replies is cut mid-string."""
    res = engine.generate(
        "Write it.",
        response_format={"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name]}},
        max_new_tokens=budget,
    )
    jsonschema.validate(json.loads(res.text), SCHEMAS[name])
    assert res.stats["tokens_out"] <= budget and res.usage.completion_tokens <= budget + 1
    if res.finish_reason == "length":
        assert res.stats.get("closed_early") is True, res.stats
    else:
        assert res.finish_reason == "stop" and "closed_early" not in res.stats


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1, "maximum": 9}},
            "required": ["city", "days"],
        },
    },
}


def test_every_method_closes_a_forced_call_under_a_tight_budget(engine):
    res = engine.generate("Weather in Oslo?", tools=[WEATHER], tool_choice="required", max_new_tokens=26)
    assert res.finish_reason == "tool_calls" and res.text == "", res.raw_text
    (call,) = res.tool_calls
    jsonschema.validate(call.arguments, WEATHER["function"]["parameters"])
    assert TOOL_OPEN not in res.text and "{" not in res.text


def test_a_forced_call_that_cannot_fit_names_the_tokens_it_needs(engine):
    with pytest.raises(RequestError, match=r"needs at least (\d+) tokens.*max_new_tokens\) is 8"):
        engine.generate("Weather in Oslo?", tools=[WEATHER], tool_choice="get_weather", max_new_tokens=8)


def test_a_forced_call_is_a_bare_call_object_without_tags():
    c = tool_call_constraint([WEATHER], "required")
    call = '{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}'
    assert c.matches(call) and parse_tool_calls(call, [WEATHER])[1][0].arguments["city"] == "Oslo"
    assert not c.matches(TOOL_OPEN + "\n" + call + "\n" + TOOL_CLOSE) and c.whole


def test_llamaindex_tool_selection_closes_or_says_what_the_call_needs(tiny_dirs):
    from llama_index.core.tools import FunctionTool
    from llama_index.llms.ensemble_llm import EnsembleLLM as LI

    def get_weather(city: str, days: int) -> str:
        """The weather in a city for some days."""
        return "sunny"

    tool = FunctionTool.from_defaults(fn=get_weather)
    eng = Ensemble([tiny_dirs["smol"]], method="single")
    llm = LI(engine=eng, max_new_tokens=30)
    (sel,) = llm.get_tool_calls_from_response(llm.chat_with_tools([tool], "Weather in Oslo?", tool_required=True))
    assert sel.tool_name == "get_weather" and set(sel.tool_kwargs) == {"city", "days"}
    with pytest.raises(RequestError, match=r"needs at least \d+ tokens.*max_new_tokens\) is 6"):
        LI(engine=eng, max_new_tokens=6).chat_with_tools([tool], "Weather?", tool_required=True)


# ---- tool messages without an id -----------------------------------------------------------------
def test_a_tool_message_without_its_call_id_is_a_clear_error_everywhere(tiny_dirs):
    from langchain_core.messages import HumanMessage
    from langchain_ensemble_llm import EnsembleLLM as LC
    from llama_index.core.base.llms.types import ChatMessage
    from llama_index.llms.ensemble_llm import EnsembleLLM as LI

    from ensemble_llm.serve_requests import ApiError, chat_messages

    eng = Ensemble([tiny_dirs["smol"]], method="single")
    with pytest.raises(RequestError, match=r"message 1 \(tool\) has no tool_call_id"):
        eng.generate([{"role": "user", "content": "hi"}, {"role": "tool", "content": "42"}])
    with pytest.raises(RequestError, match=r"message 1 \(tool\) has no tool_call_id"):
        LC(engine=eng).invoke([HumanMessage("hi"), {"role": "tool", "content": "42"}])
    with pytest.raises(RequestError, match=r"message 1 \(tool\) has no tool_call_id"):
        LI(engine=eng).chat([ChatMessage(role="user", content="hi"), ChatMessage(role="tool", content="42")])
    with pytest.raises(ApiError, match=r"messages\[1\] \(tool\) has no tool_call_id") as err:
        chat_messages([{"role": "user", "content": "hi"}, {"role": "tool", "content": "42"}])
    assert err.value.status == 400


# ---- the bench's tight-budget section ----------------------------------------------------------
def test_bench_tight_section_counts_valid_replies_per_method(tiny_dirs, tmp_path):
    from ensemble_llm.bench import MethodSpec
    from ensemble_llm.bench.constraints import load_schemas, markdown, run_constraint_bench, write

    tight = load_schemas(corpus="schemas_tight.jsonl")
    assert len(tight) >= 8 and {"poem", "node"} <= {r["name"] for r in tight}
    for row in tight:  # every schema compiles, and its shortest document validates
        c = Constraint.json_schema(row["schema"])
        jsonschema.validate(json.loads(Guide(c, []).completion(b"")), row["schema"])
    specs = [MethodSpec("single", "single", {}, [tiny_dirs["smol"]]), MethodSpec("unite", "unite", {"weights": None})]
    res = run_constraint_bench(
        [tiny_dirs["smol"], tiny_dirs["gemma"]], specs, sections=["tight"], n_tight=3, tight_tokens=40, progress=False
    )
    assert res["methods"] == {} and set(res["tight"]) == {"single", "unite"}
    for r in res["tight"].values():
        assert r["total"] == 3 and r["fitting"] == 3 and r["valid_of_fitting"] == 3, r["failures"]
    paths = write(res, tmp_path)
    assert "valid / total" in markdown(res) and all(p.exists() for p in paths)


# ---- the real bundled pair: the cases through both facades -------------------------------
PAIR = ["smollm2-135m-instruct", "gemma-3-270m"]


@pytest.fixture(scope="module")
def real_pair(real_dirs):
    return Ensemble(PAIR, method="safe", progress=False).load()


@pytest.mark.real
def test_real_pair_poem_and_node_through_langchain(real_pair):
    from langchain_ensemble_llm import EnsembleLLM

    llm = EnsembleLLM(engine=real_pair, max_tokens=160)
    poem = llm.with_structured_output(Poem, method="json_schema").invoke("Write a two-line poem about the sea.")
    assert isinstance(poem, Poem) and poem.mood in ("happy", "sad", "calm")
    node = llm.with_structured_output(Node).invoke("Describe a small tree: a root node named 'root' with one child.")
    assert isinstance(node, Node)


@pytest.mark.real
def test_real_pair_poem_and_node_through_llamaindex(real_pair):
    from llama_index.core.prompts import PromptTemplate
    from llama_index.llms.ensemble_llm import EnsembleLLM

    llm = EnsembleLLM(engine=real_pair, max_new_tokens=160)
    poem = llm.structured_predict(Poem, PromptTemplate("Write a two-line poem about the {topic}."), topic="sea")
    assert isinstance(poem, Poem)
    node = llm.structured_predict(
        Node, PromptTemplate("Describe a small tree: a root node named '{name}' with one child."), name="root"
    )
    assert isinstance(node, Node)


@pytest.mark.real
@pytest.mark.parametrize("method", ["single", "unite", "specfuse"])  # smc: tiny models here, real in the bench
def test_real_pair_poem_with_every_method(real_dirs, method):
    eng = Ensemble(PAIR, method=method, progress=False)
    fmt = {"type": "json_schema", "json_schema": {"name": "Poem", "schema": SCHEMAS["poem"]}}
    res = eng.generate("Write a two-line poem about the sea.", response_format=fmt, max_new_tokens=64)
    Poem.model_validate_json(res.text)
    assert res.finish_reason == "stop" or res.stats.get("closed_early") is True
