"""Grammar constraints on what the ensemble writes (JSON Schema, any JSON object, regex, a choice
list, a Lark grammar), matched by llguidance: the request-side value.

`Constraint` is frozen, hashable and checked once before queueing; the schema shaping that makes
small models finish a document (`styled`, `_bounded`, `_unrolled`) lives here too. Nothing here
needs torch: the HTTP client builds and checks constraints. A method run consults a `Guide`
(guide.py), the constraint's matchers for that run.
"""

from __future__ import annotations

import dataclasses
import json
import re
import threading
from dataclasses import dataclass
from typing import Any, Sequence

from .errors import RequestError

END = 256  # the byte vocabulary's end-of-text slot (EOS)
# the JSON the constrained members write: json.dumps's default separators, no free whitespace
# (free whitespace lets a small model pad forever; fixed separators are forced, not sampled)
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
KINDS = ("json_schema", "json_object", "regex", "choice", "lark")
# budget-aware closing (`Guide.closing`): the shortest completion is searched over the byte matcher

_BYTE_TOKENIZER = None
_LOCK = threading.Lock()


def _llguidance():
    try:
        import llguidance
    except ImportError as exc:  # a declared dependency; only a broken install lacks it
        raise RequestError("grammar constraints need the llguidance package: pip install llguidance") from exc
    return llguidance


class _Bytes:
    """A tokenizer whose tokens are the 256 bytes, plus an end token (what llguidance wraps)."""

    eos_token_id = END
    bos_token_id = None
    tokens = [bytes([i]) for i in range(256)] + [b""]
    special_token_ids = [END]

    def __call__(self, text):
        return list(text.encode("utf-8") if isinstance(text, str) else text)


def byte_tokenizer():
    global _BYTE_TOKENIZER
    with _LOCK:
        if _BYTE_TOKENIZER is None:
            llg = _llguidance()
            _BYTE_TOKENIZER = llg.LLTokenizer(llg.TokenizerWrapper(_Bytes()))
        return _BYTE_TOKENIZER


def _refs_cycle(schema: Any) -> str | None:
    """A `$ref` chain that leads back to itself before any JSON is written (`A -> A`, `A -> B
    -> A`), at the root or in any definition: such a definition has no instance at all. Returns
    the chain, or None."""
    if not isinstance(schema, dict):
        return None
    defs = {}
    for key in ("$defs", "definitions"):
        if isinstance(schema.get(key), dict):
            defs.update({f"#/{key}/{k}": v for k, v in schema[key].items()})

    def pure_ref(node: Any) -> str | None:  # a node that only refers elsewhere (annotations aside)
        if not isinstance(node, dict) or not isinstance(node.get("$ref"), str):
            return None
        rest = set(node) - {"$ref", "$defs", "definitions", "description", "title", "$comment"}
        return None if rest else node["$ref"]

    for start in [schema, *defs.values()]:
        seen: list[str] = []
        ref = pure_ref(start)
        while ref is not None:
            if ref in seen:
                return " -> ".join(seen + [ref])
            seen.append(ref)
            ref = pure_ref(defs.get(ref))
    return None


SAFE_INT = 2**53 - 1  # I-JSON (RFC 7493): integers every JSON parser reads exactly


def _bounded(schema: Any) -> Any:
    """A copy of `schema` that a small model cannot extend until its budget runs out:
    - an integer without bounds gets the I-JSON range (no value a parser reads exactly is lost);
    - an object that lists its `properties` and says nothing about others is closed
      (`additionalProperties: false`, as in OpenAI's strict mode): the keys are the listed ones."""
    if isinstance(schema, list):
        return [_bounded(x) for x in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for k, v in schema.items():
        if k in ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas") and isinstance(v, dict):
            out[k] = {name: _bounded(sub) for name, sub in v.items()}  # a map of names to schemas
        elif k in ("enum", "const", "default", "examples", "required"):
            out[k] = v  # values, not schemas
        else:
            out[k] = _bounded(v)
    if isinstance(schema.get("properties"), dict) and not any(
        k in schema for k in ("additionalProperties", "patternProperties", "unevaluatedProperties")
    ):
        out["additionalProperties"] = False
    kinds = schema.get("type")
    if kinds == "integer" or (isinstance(kinds, list) and "integer" in kinds):
        if "minimum" not in out and "exclusiveMinimum" not in out:
            out["minimum"] = -SAFE_INT
        if "maximum" not in out and "exclusiveMaximum" not in out:
            out["maximum"] = SAFE_INT
    return out


_REF_ONLY = {"$ref", "$defs", "definitions", "description", "title", "$comment"}
MAX_RECURSION = 4  # levels of a recursive definition (a tree's child, a list's next) a reply may nest

# A schema's size, checked before any other work on it. OpenAI's structured outputs take at most
# 5000 object properties in all, 10 levels of object nesting, 1000 enum values and 120,000
# characters of property names, definition names, enum and const values
# (platform.openai.com/docs/guides/structured-outputs, "Supported schemas"); the same bounds here.
MAX_PROPERTIES = 5000
MAX_NESTING = 10
MAX_ENUM_VALUES = 1000
MAX_NAME_CHARS = 120_000
# Ours: JSON containers (objects and arrays) in a schema as written and once its $refs are
# inlined (`_unrolled`). A definition referred to from two places is copied into both, so N
# definitions that each refer twice to the next grow as 2**N: 16 such levels (2 KB) unroll to
# 10 MB. The bound sits far above the largest schema of the bench corpora, and low enough that
# unrolling stops, and llguidance compiles what passes, before a client would notice.
MAX_SCHEMA_NODES = 10_000
MAX_SCHEMA_DEPTH = 64  # containers inside containers as written (the checks below recurse)


class _Sizes:
    """What `check_schema_size` counts while it walks a schema."""

    def __init__(self) -> None:
        self.nodes = self.properties = self.enums = self.names = 0


def check_schema_size(schema: Any, what: str = "the JSON Schema") -> None:
    """A RequestError naming the bound a schema passes (see MAX_PROPERTIES and after), found in
    one walk that stops at the first bound passed, before anything else reads the schema."""
    sizes, stack = _Sizes(), [(schema, 0, 0)]  # (node, containers above it, object levels)
    while stack:
        node, depth, objects = stack.pop()
        if not isinstance(node, (dict, list)):
            continue
        sizes.nodes += 1
        if sizes.nodes > MAX_SCHEMA_NODES or depth > MAX_SCHEMA_DEPTH:
            bound = (
                f"{MAX_SCHEMA_NODES} JSON objects and arrays"
                if depth <= MAX_SCHEMA_DEPTH
                else (f"{MAX_SCHEMA_DEPTH} levels of objects and arrays")
            )
            raise RequestError(f"{what} is too large (more than {bound}); send a smaller schema.")
        if isinstance(node, list):
            stack.extend((x, depth + 1, objects) for x in node)
            continue
        _count_node(node, sizes, objects, what)
        for key, value in node.items():
            if key == "properties" and isinstance(value, dict):  # a map of names to schemas, one level down
                stack.extend((sub, depth + 2, objects + 1) for sub in value.values())
            elif key in ("$defs", "definitions", "patternProperties", "dependentSchemas") and isinstance(value, dict):
                stack.extend((sub, depth + 2, objects) for sub in value.values())
            elif key not in ("enum", "const", "default", "examples", "required"):
                stack.append((value, depth + 1, objects))


def _count_node(node: dict, sizes: _Sizes, objects: int, what: str) -> None:
    """One schema object's share of OpenAI's limits (see `check_schema_size`)."""
    props = node.get("properties")
    if isinstance(props, dict):
        sizes.properties += len(props)
        sizes.names += sum(len(str(k)) for k in props)
        if objects + 1 > MAX_NESTING:
            raise RequestError(
                f"{what} nests objects {objects + 1} levels deep, more than the {MAX_NESTING} OpenAI's structured "
                "outputs allow; flatten it (or refer to a definition, which is expanded a bounded number of times)."
            )
    for key in ("$defs", "definitions"):
        if isinstance(node.get(key), dict):
            sizes.names += sum(len(str(k)) for k in node[key])
    if isinstance(node.get("enum"), list):
        sizes.enums += len(node["enum"])
        sizes.names += sum(len(str(v)) for v in node["enum"])
    if "const" in node:
        sizes.names += len(str(node["const"]))
    for count, bound, name in (
        (sizes.properties, MAX_PROPERTIES, "object properties"),
        (sizes.enums, MAX_ENUM_VALUES, "enum values"),
        (sizes.names, MAX_NAME_CHARS, "characters of property names, definition names, enum and const values"),
    ):
        if count > bound:
            raise RequestError(
                f"{what} has more than {bound} {name}, the most OpenAI's structured outputs allow; "
                "send a smaller schema."
            )


def _unrolled(schema: dict, depth: int = MAX_RECURSION) -> dict:
    """A copy of `schema` with its local `$ref`s inlined, where an `anyOf`/`oneOf` alternative that
    would enter a definition already open `depth` times on the way down is dropped (the other
    alternatives, typically `null`, stay). Small models otherwise nest a recursive model
    (`child: Optional[Node]`) until their budget runs out; this is the bound other grammar
    engines call a maximum recursion depth. A $ref that has no alternative to fall back on is
    kept as it is (its `$defs` stay in the root). The copy may hold `MAX_SCHEMA_NODES` objects
    and arrays: unrolling stops with a RequestError as soon as it would build more."""
    defs = {}
    for key in ("$defs", "definitions"):
        if isinstance(schema.get(key), dict):
            defs.update({f"#/{key}/{k}": v for k, v in schema[key].items()})
    if not defs:
        return schema
    return _Unroller(defs, depth).walk(schema, {}, 0)


class _Unroller:
    """One `_unrolled` run: the definitions, the recursion bound and the containers built so far."""

    def __init__(self, defs: dict[str, Any], depth: int) -> None:
        self.defs, self.depth, self.built = defs, depth, 0

    def walk(self, node: Any, open_: dict[str, int], level: int) -> Any:
        if not isinstance(node, (dict, list)):
            return node
        self.built += 1
        if self.built > MAX_SCHEMA_NODES or level > 4 * MAX_SCHEMA_DEPTH:
            raise RequestError(
                f"the JSON Schema grows past {MAX_SCHEMA_NODES} JSON objects and arrays (or "
                f"{4 * MAX_SCHEMA_DEPTH} levels) once its $refs are expanded (a definition referred to from "
                "several places is copied into each, so definitions that each refer twice to the next double "
                "the size at every level); refer to fewer definitions, or send a smaller schema."
            )
        if isinstance(node, list):
            return [self.walk(x, open_, level + 1) for x in node]
        ref = node.get("$ref")
        if isinstance(ref, str) and ref in self.defs and not set(node) - _REF_ONLY:
            if open_.get(ref, 0) >= self.depth:
                return node
            inner = self.walk(self.defs[ref], {**open_, ref: open_.get(ref, 0) + 1}, level + 1)
            kept = {k: node[k] for k in ("$defs", "definitions") if k in node}  # the root keeps its definitions
            return {**inner, **kept} if isinstance(inner, dict) else inner
        return self._object(node, open_, level)

    def _closed(self, x: Any, open_: dict[str, int]) -> bool:
        """An alternative that would enter a definition already open `depth` times."""
        return (
            isinstance(x, dict)
            and x.get("$ref") in self.defs
            and not set(x) - _REF_ONLY
            and open_.get(x["$ref"], 0) >= self.depth
        )

    def _object(self, node: dict, open_: dict[str, int], level: int) -> dict:
        out = {}
        for k, v in node.items():
            if k in ("$defs", "definitions"):
                out[k] = v
            elif k in ("anyOf", "oneOf") and isinstance(v, list):
                kept = [x for x in v if not self._closed(x, open_)]
                out[k] = self.walk(kept or v, open_, level + 1)
            elif k in ("properties", "patternProperties", "dependentSchemas") and isinstance(v, dict):
                out[k] = {name: self.walk(sub, open_, level + 1) for name, sub in v.items()}
            elif k in ("enum", "const", "default", "examples", "required"):
                out[k] = v
            else:
                out[k] = self.walk(v, open_, level + 1)
        return out


def styled(schema: dict) -> dict:
    """What llguidance compiles for a JSON Schema: recursion bounded (`_unrolled`), integers
    bounded and objects closed (`_bounded`), and the fixed JSON style."""
    out = _bounded(_unrolled(schema))
    out["x-guidance"] = {**JSON_STYLE, **(schema.get("x-guidance") or {})}
    return out


@dataclass(frozen=True)
class Constraint:
    """What the reply must match. Build one with a classmethod (`json_schema`, `json_object`,
    `regex`, `choice`, `lark`) or from an OpenAI `response_format` (`from_response_format`)."""

    kind: str
    source: str  # the schema as JSON text, the pattern, the options as JSON, the Lark text
    grammar: str  # llguidance's grammar text
    # a cut match is useless (a JSON document, a forced tool call): refuse a budget it cannot fit
    whole: bool = False
    # text the reply starts with that no member chooses (a call to the one allowed tool starts with
    # its name): it ends every member's prompt instead of being generated, so it costs no output
    # token and no forward of its own, and the reply's text starts with it; the grammar is the rest
    head: str = ""

    # ---- builders ------------------------------------------------------------------------
    @classmethod
    def json_schema(cls, schema: Any) -> "Constraint":
        """A JSON document valid under `schema` (a dict, or its JSON text)."""
        import jsonschema

        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as exc:
                raise RequestError(f"the JSON Schema is not valid JSON ({exc}); pass a dict or JSON text.") from None
        if not isinstance(schema, dict):
            raise RequestError(f"a JSON Schema must be a dict (JSON object), got {type(schema).__name__}")
        check_schema_size(schema)  # before the meta-schema check, whose time grows with the schema
        try:
            jsonschema.validators.validator_for(schema).check_schema(schema)
        except jsonschema.SchemaError as exc:
            where = "/".join(str(p) for p in exc.absolute_path) or "(root)"
            raise RequestError(f"not a valid JSON Schema at {where}: {exc.message}") from None
        cycle = _refs_cycle(schema)
        if cycle:
            raise RequestError(
                f"the JSON Schema's $ref chain {cycle} refers back to itself, so no JSON value "
                "matches it; give the definition a type or properties."
            )
        llg = _llguidance()
        return cls(
            "json_schema",
            json.dumps(schema),  # property order kept: it is the order written
            llg.LLMatcher.grammar_from_json_schema(styled(schema)),
            whole=True,  # a cut document does not parse: a budget it cannot fit is refused
        )

    @classmethod
    def json_object(cls) -> "Constraint":
        """Any JSON object (OpenAI's `json_object` mode)."""
        return cls.json_schema({"type": "object"})._replace_kind("json_object")

    @classmethod
    def regex(cls, pattern: str) -> "Constraint":
        if not isinstance(pattern, str) or not pattern:
            raise RequestError(f"a regex constraint needs a non-empty pattern string, got {pattern!r}")
        return cls("regex", pattern, _llguidance().LLMatcher.grammar_from_regex(pattern))

    @classmethod
    def choice(cls, options: Sequence[str]) -> "Constraint":
        if (
            isinstance(options, str)
            or not isinstance(options, (list, tuple))
            or not options
            or not all(isinstance(o, str) and o for o in options)
        ):
            raise RequestError(f"a choice constraint needs a list of non-empty strings, got {options!r}")
        pattern = "|".join(re.escape(o) for o in options)
        return cls("choice", json.dumps(list(options)), _llguidance().LLMatcher.grammar_from_regex(f"({pattern})"))

    @classmethod
    def lark(cls, grammar: str) -> "Constraint":
        """A Lark grammar in llguidance's dialect (`start: ...`; `%json {schema}` embeds a schema)."""
        if not isinstance(grammar, str) or not grammar.strip():
            raise RequestError(f"a Lark constraint needs the grammar text, got {grammar!r}")
        return cls("lark", grammar, _llguidance().LLMatcher.grammar_from_lark(grammar))

    @classmethod
    def from_response_format(cls, response_format: Any) -> "Constraint | None":
        """OpenAI's `response_format`: {"type": "text"}, {"type": "json_object"} or {"type":
        "json_schema", "json_schema": {"name": ..., "schema": {...}}}; also a Constraint."""
        if response_format is None or isinstance(response_format, Constraint):
            return response_format
        if not isinstance(response_format, dict) or "type" not in response_format:
            raise RequestError(
                "response_format must be {'type': 'text' | 'json_object' | 'json_schema', ...}, "
                f"got {response_format!r}"
            )
        kind = response_format["type"]
        if kind == "text":
            return None
        if kind == "json_object":
            return cls.json_object()
        if kind == "json_schema":
            spec = response_format.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
                raise RequestError(
                    "response_format {'type': 'json_schema'} needs 'json_schema': {'name': ..., "
                    f"'schema': {{...}}}}, got {spec!r}"
                )
            return cls.json_schema(spec["schema"])
        raise RequestError(
            f"response_format type {kind!r} is not supported; use 'text', 'json_object' or 'json_schema'."
        )

    def _replace_kind(self, kind: str) -> "Constraint":
        return dataclasses.replace(self, kind=kind)

    # ---- checks ----------------------------------------------------------------------------
    def check(self) -> None:
        """Compile the grammar and compute its first mask, with no model: a grammar llguidance
        refuses, or one that allows no output at all, is a RequestError now, before queueing."""
        m = self.byte_matcher()
        if not m.is_error():
            m.compute_bitmask()
        if m.is_error():
            raise RequestError(f"the {self.kind} constraint cannot be used: {_first_line(m.get_error())}")

    def byte_matcher(self):
        return _llguidance().LLMatcher(byte_tokenizer(), self.grammar, log_level=0)

    def matches(self, text: str) -> bool:
        """Whether `text` is a complete match (used to check outputs), its `head` included."""
        if not text.startswith(self.head):
            return False
        m = self.byte_matcher()
        data = list(text[len(self.head) :].encode("utf-8"))
        return m.try_consume_tokens(data) == len(data) and m.is_accepting()

    def __repr__(self) -> str:
        src = self.source if len(self.source) < 60 else self.source[:57] + "..."
        return f"Constraint.{self.kind}({src})" + (f" after {self.head!r}" if self.head else "")


def _first_line(error: str) -> str:
    line = (error or "unknown error").strip().splitlines()[0]
    if line in ("NoExtension", "NoExtensionBias") or line.startswith("<state>"):
        return "the grammar allows no output at all (an empty choice, or a rule that only refers to itself)"
    found = re.match(r"Pointer '(.*)' does not exist", line)
    if found:
        return f"a $ref points to '#{found.group(1)}', which does not exist; define it under $defs or fix the $ref"
    return line
