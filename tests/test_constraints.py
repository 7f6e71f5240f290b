"""Grammar constraints (ensemble_llm.constraints, llguidance): masks exact against brute force,
matchers that follow rollback exactly, SMC and beam search exact on a constrained target, and every
method writing schema-valid JSON and tool calls."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math

import jsonschema
import numpy as np
import pytest
import torch
from helpers import NODE_SCHEMA, TINY_METHODS, tiny_pair_for
from hypothesis import given, settings
from hypothesis import strategies as st
from test_smc import TableLM  # byte LMs over {a, b} whose distribution can be enumerated

from ensemble_llm import Ensemble, GenerationParams, RequestError
from ensemble_llm.constraints import END, Constraint
from ensemble_llm.guide import Guide
from ensemble_llm.methods.smc import EOS, beam_search, f_ensemble, smc_sample
from ensemble_llm.tools import TOOL_CLOSE, TOOL_OPEN, tool_call_constraint

OPTIONS = ["yes", "no", "maybe", "yesterday"]


# ---- the constraint values -------------------------------------------------------------------
def test_builders_match_exactly_what_they_describe():
    c = Constraint.choice(OPTIONS)
    assert all(c.matches(o) for o in OPTIONS) and not c.matches("ye") and not c.matches("yes!")
    r = Constraint.regex(r"\d{3}-[a-z]+")
    assert r.matches("123-ab") and not r.matches("12-ab") and not r.matches("123-")
    j = Constraint.json_schema({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})
    assert j.matches('{"a": 5}') and not j.matches('{"a": "5"}') and not j.matches("{}")
    assert Constraint.json_object().matches('{"x": [1, {"y": null}]}') and not Constraint.json_object().matches("[1]")
    lark = Constraint.lark('start: "a"+ "b"')
    assert lark.matches("aab") and not lark.matches("b")
    assert Constraint.from_response_format({"type": "text"}) is None
    rf = Constraint.from_response_format(
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string"}}}
    )
    assert rf.kind == "json_schema" and rf.matches('"hi"')


@pytest.mark.parametrize(
    "make, phrase",
    [
        (lambda: Constraint.json_schema({"type": "strin"}), "not a valid JSON Schema"),
        (lambda: Constraint.json_schema("{not json"), "not valid JSON"),
        (lambda: Constraint.json_schema([1]), "must be a dict"),
        (
            lambda: Constraint.json_schema(
                {"$defs": {"A": {"$ref": "#/$defs/B"}, "B": {"$ref": "#/$defs/A"}}, "$ref": "#/$defs/A"}
            ),
            "refers back to itself",
        ),
        (lambda: Constraint.json_schema({"properties": {"x": {"$ref": "#/$defs/nope"}}}).check(), "does not exist"),
        (lambda: Constraint.regex(""), "non-empty pattern"),
        (lambda: Constraint.regex("(unclosed").check(), "cannot be used"),
        (lambda: Constraint.choice([]), "list of non-empty strings"),
        (lambda: Constraint.choice("yes"), "list of non-empty strings"),
        (lambda: Constraint.lark("start: (").check(), "cannot be used"),
        (lambda: Constraint.from_response_format({"type": "xml"}), "not supported"),
        (lambda: Constraint.from_response_format({"type": "json_schema"}), "needs 'json_schema'"),
        (lambda: Constraint.from_response_format("json"), "response_format must be"),
    ],
)
def test_bad_constraints_are_clear_errors(make, phrase):
    with pytest.raises(RequestError, match=phrase):
        make()


def test_generation_params_are_frozen_and_validated():
    p = GenerationParams(max_new_tokens=8, stop="x", response_format={"type": "json_object"})
    assert p.stop == ("x",) and p.response_format.kind == "json_object" and p.constraint is p.response_format
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.max_new_tokens = 3  # frozen
    assert p.replace(temperature=0.5).temperature == 0.5 and p.temperature == 0.0
    with pytest.raises(RequestError, match="temperature"):
        p.replace(temperature=-1)
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    with pytest.raises(RequestError, match="both constrain the reply"):
        GenerationParams(tools=(tool,), tool_choice="f", response_format={"type": "json_object"})


# ---- masks against brute force ---------------------------------------------------------------
def _brute_next_bytes(prefix: bytes, options: list[bytes]) -> set[int]:
    out = {o[len(prefix)] for o in options if o.startswith(prefix) and len(o) > len(prefix)}
    if prefix in options:
        out.add(END)
    return out


def test_byte_mask_equals_brute_force_for_every_prefix():
    opts = [o.encode() for o in OPTIONS]
    guide = Guide(Constraint.choice(OPTIONS), [])
    prefixes = {o[:i] for o in opts for i in range(len(o) + 1)}
    for prefix in sorted(prefixes, key=lambda p: (len(p), p), reverse=True):  # out of order: rollback each time
        assert set(np.flatnonzero(guide.byte_mask(prefix))) == _brute_next_bytes(prefix, opts), prefix
        assert guide.accepting(prefix) == (prefix in opts)
    assert not guide.allows(b"", b"x") and guide.allows(b"ye", b"s") and guide.allows(b"yes", None)
    assert not guide.byte_mask(b"nope").any()  # a text the grammar rejects allows nothing


@pytest.mark.parametrize("key", ["smol", "gemma"])
def test_token_mask_is_sound_and_complete_against_brute_force(tiny_members, key):
    """Over the whole vocabulary: every token the mask allows spells a valid continuation
    (sound), and each option's own canonical next token is allowed (nothing is ruled out).
    llguidance's mask may leave out a non-canonical split of forced text ("b" + "e" after "may"
    when "be" is one token): the brute-force set is a superset, never a smaller set."""
    m = tiny_members[key]
    opts = [o.encode() for o in OPTIONS]
    guide = Guide(Constraint.choice(OPTIONS), [m])
    vb = m.vocab_bytes
    for prefix_text in ("", "ye", "yes", "may"):
        ids = m.encode(prefix_text) if prefix_text else []
        prefix = b"".join(vb[i] for i in ids)
        allowed = set(np.flatnonzero(guide.token_mask(0, ids)).tolist())
        brute = {
            t for t, b in enumerate(vb) if b and t not in m.special_ids and any(o.startswith(prefix + b) for o in opts)
        }
        if prefix in opts:
            brute |= set(m.eos_ids)
        assert allowed and allowed <= brute, prefix_text
        for o in OPTIONS:
            if o.startswith(prefix_text) and o != prefix_text:
                nxt = m.encode(o)[len(ids)] if m.encode(o)[: len(ids)] == ids else None
                assert nxt is None or nxt in allowed, (prefix_text, o, vb[nxt])
        if prefix in opts:
            assert set(m.eos_ids) & allowed


@settings(max_examples=40, deadline=None, derandomize=True)
@given(steps=st.lists(st.tuples(st.integers(0, 6), st.sampled_from(list(b'{}"a1:, ['))), max_size=25))
def test_mirror_follows_any_sync_sequence_exactly(steps):
    """Whatever sequence of rollbacks and extensions the matcher is synced through, its mask is
    that of a fresh matcher fed the final text."""
    c = Constraint.json_object()
    guide = Guide(c, [])
    text = b""
    for back, byte in steps:
        text = text[: max(0, len(text) - back)]
        if guide.allows(text, bytes([byte])):
            text += bytes([byte])
        fresh = Guide(c, [])
        assert (guide.byte_mask(text) == fresh.byte_mask(text)).all()


# ---- SMC and beam search on a constrained target, exact ------------------------------------------
PATTERN = r"(ab|ba)a?b?"  # 8 strings out of the 31 the table LMs can write


def _constrained_target(lms, tau, a):
    c = Constraint.regex(PATTERN)
    strings = [b"".join(t) for n in range(lms[0].L + 1) for t in itertools.product([b"a", b"b"], repeat=n)]
    strings = [x for x in strings if c.matches(x.decode())]
    logp = [[sum(lm.logq(x[:i])[x[i]] for i in range(len(x))) + lm.logq(x)[EOS] for x in strings] for lm in lms]
    psi = f_ensemble(np.array(logp), tau, a)
    return strings, psi


@pytest.mark.parametrize("tau", [0.0, 1.0, -math.inf], ids=["product", "mixture", "min"])
def test_constrained_smc_converges_to_the_grammar_restricted_ensemble(tau):
    lms = [TableLM(s, L=4) for s in (1, 2, 3)]
    a = np.array([0.2, 0.3, 0.5])
    strings, psi = _constrained_target(lms, tau, a)
    exact = dict(zip(strings, np.exp(psi - np.logaddexp.reduce(psi))))
    guide = Guide(Constraint.regex(PATTERN), [])
    run = None
    for run in smc_sample(  # noqa: B007 (the last run is read after the loop)
        lms,
        [b""] * 3,
        tau=tau,
        weights=a,
        n_particles=3000,
        ess_threshold=0.5,
        generator=torch.Generator().manual_seed(0),
        finished=lambda p: None,
        allowed=guide.byte_mask,
    ):
        pass
    est = run.posterior()
    assert set(est) <= set(strings)  # no particle ever leaves the grammar
    tv = 0.5 * sum(abs(est.get(x, 0.0) - p) for x, p in exact.items())
    assert tv < 0.05, tv
    assert abs(run.log_z - float(np.logaddexp.reduce(psi))) < 0.05  # Z of the restricted target


@pytest.mark.parametrize("tau", [0.0, 1.0, -math.inf, 2.0], ids=["product", "mixture", "min", "power2"])
def test_constrained_beam_search_finds_the_exact_mode_among_grammar_strings(tau):
    for seeds in ((1, 2, 3), (4, 5, 6), (7, 8, 9)):
        lms = [TableLM(s, L=4) for s in seeds]
        a = np.array([0.2, 0.3, 0.5])
        strings, psi = _constrained_target(lms, tau, a)
        guide = Guide(Constraint.regex(PATTERN), [])
        run = None
        for run in beam_search(  # noqa: B007 (the last run is read after the loop)
            lms, [b""] * 3, tau=tau, weights=a, width=16, finished=lambda p: None, allowed=guide.byte_mask
        ):
            pass
        assert run.best().text == strings[int(np.argmax(psi))]
        assert abs(run.best().logw - float(psi.max())) < 1e-9


# ---- every method writes what the grammar allows (tiny random-weight models) ---------------------
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "ok"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 5},
                "days": {"type": "integer", "minimum": 1, "maximum": 9},
            },
            "required": ["city", "days"],
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {
                "a": {"type": "integer", "minimum": 0, "maximum": 99},
                "b": {"type": "integer", "minimum": 0, "maximum": 99},
            },
            "required": ["a", "b"],
        },
    },
}
METHODS = TINY_METHODS


@pytest.fixture(scope="module", params=METHODS, ids=[m for m, _ in METHODS])
def tiny_engine(request, tiny_dirs):
    method, config = request.param
    members = tiny_pair_for(method, tiny_dirs)
    return Ensemble(members, method=method, config=config).load()


def test_every_method_writes_schema_valid_json(tiny_engine):
    res = tiny_engine.generate(
        "Describe a user.",
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}},
        max_new_tokens=60,
    )
    assert res.finish_reason == "stop", res.text  # the grammar ended the reply, not the budget
    jsonschema.validate(json.loads(res.text), PERSON)
    assert res.stats["constraint"] == "json_schema"


def test_every_method_writes_a_valid_forced_tool_call(tiny_engine):
    res = tiny_engine.generate(
        "Weather in Oslo for 2 days?", tools=[WEATHER, ADD], tool_choice="required", max_new_tokens=60
    )
    assert res.finish_reason == "tool_calls", res.raw_text
    (call,) = res.tool_calls
    spec = {"get_weather": WEATHER, "add": ADD}[call.name]["function"]["parameters"]
    jsonschema.validate(call.arguments, spec)
    # a forced call is a bare call object (no <tool_call> tags: their tokens go to the arguments)
    raw = res.raw_text
    assert res.text == "" and raw.startswith('{"name": ') and raw.endswith("}}") and TOOL_OPEN not in raw, raw


def test_choice_and_regex_through_the_engine(tiny_engine):
    res = tiny_engine.generate("Yes or no?", response_format=Constraint.choice(OPTIONS), max_new_tokens=10)
    assert res.text in OPTIONS
    res = tiny_engine.generate("A code?", response_format=Constraint.regex(r"[A-Z]{2}-\d{2}"), max_new_tokens=12)
    assert Constraint.regex(r"[A-Z]{2}-\d{2}").matches(res.text), res.text


def test_forced_bytes_are_written_without_sampling(tiny_dirs):
    eng = Ensemble([tiny_dirs["smol"]], method="single").load()
    res = eng.generate("Weather?", tools=[WEATHER], tool_choice="get_weather", max_new_tokens=60)
    st = res.stats
    # '{"city": "', '", "days": ' and the closing are forced: they cost no sampling step, and
    # several forced tokens share one forward
    assert st["forced"] >= 4 and st["members"][eng.members[0].name]["forward_passes"] < st["tokens_out"]
    # the call's fixed start ('{"name": "get_weather", "arguments": ') ends the prompt: it is in
    # the reply's text but is neither generated nor counted as output
    head = '{"name": "get_weather", "arguments": '
    assert res.raw_text.startswith(head) and res.tool_calls[0].name == "get_weather"
    assert res.usage.completion_tokens == len(eng.members[0].encode(res.raw_text[len(head) :]))
    assert st["tokens_out"] == res.usage.completion_tokens


def test_tool_call_grammar_is_exact():
    c = tool_call_constraint([WEATHER, ADD, {"type": "function", "function": {"name": "ping"}}], "required")
    head = ""  # a bare call object (no tags)
    assert c.matches(head + '{"name": "add", "arguments": {"a": 1, "b": 2}}')
    assert c.matches(head + '{"name": "ping", "arguments": {}}')
    assert not c.matches(head + '{"name": "ping", "arguments": {"x": 1}}')
    assert not c.matches(head + '{"name": "mul", "arguments": {"a": 1, "b": 2}}')
    assert not c.matches(head + '{"name": "add", "arguments": {"a": "1", "b": 2}}')
    assert not c.matches(TOOL_OPEN + '\n{"name": "ping", "arguments": {}}\n' + TOOL_CLOSE)
    only = tool_call_constraint([WEATHER, ADD], "add")
    assert not only.matches(head + '{"name": "get_weather", "arguments": {"city": "x", "days": 1}}')
    # one allowed tool: its name is fixed, so the call's start is the constraint's head (it ends
    # the prompts); the grammar is the arguments and the closing brace
    assert c.head == "" and only.head == '{"name": "add", "arguments": '
    assert only.matches('{"name": "add", "arguments": {"a": 1, "b": 2}}') and not only.matches('{"a": 1, "b": 2}}')
    assert only.byte_matcher().try_consume_tokens(list(b'{"a": 1, "b": 2}}')) == 17


# ---- the real bundled pair: a representative subset of the schema corpus (the bench runs all) ----
REAL_SCHEMAS = ("weather", "quote_escapes", "recursive_tree", "ref", "any_of")


@pytest.fixture(scope="module")
def real_engines(real_dirs):
    from ensemble_llm import DEFAULT_MODELS

    return {
        method: Ensemble(
            list(DEFAULT_MODELS) if method != "single" else [DEFAULT_MODELS[0]],
            method=method,
            config=config if method == "smc" else None,
        ).load()
        for method, config in [
            ("single", None),
            ("unite", None),
            ("safe", None),
            ("specfuse", None),
            ("smc", {"n_particles": 2}),
        ]
    }


@pytest.mark.real
@pytest.mark.parametrize("method", ["single", "unite", "safe", "specfuse"])  # smc: tiny models here, real in the bench
def test_real_pair_forced_calls_validate(real_engines, method):
    from ensemble_llm.bench.constraints import _tool, load_schemas

    eng = real_engines[method]
    rows = [r for r in load_schemas() if r["name"] in REAL_SCHEMAS]
    assert len(rows) == len(REAL_SCHEMAS)
    for row in rows:
        res = eng.generate(row["prompt"], tools=[_tool(row)], tool_choice=row["name"], max_new_tokens=120)
        assert res.finish_reason == "tool_calls", (row["name"], res.raw_text)
        jsonschema.validate(res.tool_calls[0].arguments, row["schema"])
        # one prompt prefill per member, however many fields the call has
        assert all(f["prefills"] == 1 for f in res.stats["members"].values()), res.stats["members"]


@pytest.mark.real
def test_real_pair_five_field_call_costs_one_prefill_per_member(real_engines):
    five = {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "city": {"type": "string"},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "job": {"type": "string"},
            "married": {"type": "boolean"},
        },
        "required": ["name", "city", "age", "job", "married"],
    }
    tool = {"type": "function", "function": {"name": "record", "parameters": five}}
    res = real_engines["safe"].generate(
        "Record a person: Anna, 34, a teacher from Oslo, married.",
        tools=[tool],
        tool_choice="record",
        max_new_tokens=120,
    )
    assert res.finish_reason == "tool_calls"
    jsonschema.validate(res.tool_calls[0].arguments, five)
    assert [f["prefills"] for f in res.stats["members"].values()] == [1, 1]


def test_forbidden_tokens_lend_their_mass_to_their_longest_valid_prefix(tiny_members):
    """Prefix mass, exactly: a token that starts right but runs past the grammar moves its
    probability to the allowed token spelling its longest valid prefix."""
    m = tiny_members["smol"]
    by = m.vocab.index().by_bytes
    pair = next(
        (p, p + x)
        for p in (b"ab", b"ac", b"ad", b"al", b"an")
        for x in (b"s", b"le", b"out", b"c")
        if p in by and p + x in by
    )
    short, long = by[pair[0]], by[pair[1]]
    guide = Guide(Constraint.choice([pair[0].decode()]), [m])
    row = torch.full((m.vocab_size,), -20.0)
    row[long], row[short] = -0.1, -5.0
    out = guide.mask_row(0, [], row)
    assert out[short].item() == pytest.approx(math.log(math.exp(-5.0) + math.exp(-0.1)), abs=1e-5)
    assert out[long].item() == -math.inf and guide.healed == 1
    keys = [pair[1], pair[0], b"zz", None]
    logp = torch.tensor([-0.1, -5.0, -1.0, -2.0])
    kl = guide.key_logprobs(b"", keys, logp)
    assert kl[1].item() == pytest.approx(math.log(math.exp(-5.0) + math.exp(-0.1)), abs=1e-5)
    assert kl[0].item() == kl[2].item() == kl[3].item() == -math.inf  # "zz" and the end are not allowed at the start


def test_a_token_the_grammar_must_extend_lends_its_mass_to_the_longer_token(tiny_members):
    """' ' before a JSON string is always followed by the forced '"': ' ' and ' "' are one
    continuation, and their masses merge on ' "' (the tokenization the models saw in training)."""
    m = tiny_members["smol"]
    by = m.vocab.index().by_bytes
    assert b" " in by and b' "' in by
    guide = Guide(
        Constraint.json_schema({"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}), [m]
    )
    ids = m.encode('{"a":')
    assert guide.token_mask(0, ids)[by[b" "]]  # the separator's space alone is allowed...
    assert guide.forced_bytes(b'{"a": ') == b'"'  # ...and the string's quote is forced after it
    row = torch.full((m.vocab_size,), -30.0)
    row[by[b" "]], row[by[b' "']] = -0.5, -2.0
    out = guide.mask_row(0, ids, row)
    assert out[by[b' "']].item() == pytest.approx(math.log(math.exp(-0.5) + math.exp(-2.0)), abs=1e-5)
    assert out[by[b" "]].item() == -math.inf and guide.merged >= 1
    kl = guide.key_logprobs(b'{"a":', [b" ", b' "'], torch.tensor([-0.5, -2.0]))
    assert kl[0].item() == -math.inf and kl[1].item() == pytest.approx(
        math.log(math.exp(-0.5) + math.exp(-2.0)), abs=1e-5
    )


def test_recursive_definitions_are_bounded_only_where_an_alternative_remains():
    node = NODE_SCHEMA
    c = Constraint.json_schema(node)

    def tree(depth):
        out = None
        for i in range(depth):
            out = {"name": str(i), "child": out}
        return json.dumps(out)

    from ensemble_llm.constraints import MAX_RECURSION

    assert all(c.matches(tree(d)) for d in range(1, MAX_RECURSION + 1))
    assert not c.matches(tree(MAX_RECURSION + 1))
    # a recursion with no alternative to stop on is left as it is (no instance is lost to the bound)
    chain = {"$defs": {"A": {"type": "array", "items": {"$ref": "#/$defs/A"}}}, "$ref": "#/$defs/A"}
    deep = "[[[[[[[]]]]]]]"
    assert Constraint.json_schema(chain).matches(deep)
