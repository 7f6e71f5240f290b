"""`ensemble-llm bench-constraints` (floor 5): grammar-constrained decoding measured per method.

Two sections, every method on the same prompts, interleaved:
- **forced calls**: each JSON Schema of the bundled corpus (`data/schemas.jsonl`: nested objects,
  arrays, enums, anyOf/oneOf, optional fields, $ref, recursive models, strings that need
  escapes, multi-line strings, bounded numbers, patterns) is the parameters of a tool the reply
  must call (`tool_choice=<name>`); the call's arguments are validated with `jsonschema`. Per
  call: time, output tokens, forward passes and prompt prefills per member, forced tokens.
- **constraint cost**: the same prompts answered freely and with the schema as `response_format`;
  time per output token of each, their ratio, and the share of the constrained time spent in the
  matchers themselves.
- **tight budget**: the schemas of `data/schemas_tight.jsonl` (unbounded strings, required
  nullable recursive fields, arrays of objects, the issue-23 Poem and Node models) as
  `response_format` at a small budget (64 tokens by default), where the members would run out in
  a string: valid/total per method, how many replies the budget-aware closing finished
  (`closed_early`), and how many schemas' shortest completion could not fit at all.
Writes results.json and results.md into the output folder.
"""

from __future__ import annotations

import json
import time
from importlib import resources
from pathlib import Path
from typing import Any, Sequence

import jsonschema

from ..engine import Ensemble
from ..errors import ConfigError
from .run import _progress
from .specs import MethodSpec

SECTIONS = ("calls", "cost", "tight")


def load_schemas(n: int | None = None, corpus: str = "schemas.jsonl") -> list[dict]:
    """The bundled schema corpus: [{"name", "prompt", "schema"}, ...] (the first n)."""
    path = resources.files("ensemble_llm") / "data" / corpus
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return rows if n is None else rows[:n]


def _tool(row: dict) -> dict:
    return {
        "type": "function",
        "function": {"name": row["name"], "description": row["prompt"], "parameters": row["schema"]},
    }


def run_constraint_bench(
    models: Sequence[str],
    methods: Sequence[MethodSpec],
    *,
    n_schemas: int | None = None,
    max_new_tokens: int = 160,
    cost_prompts: int = 6,
    cost_tokens: int = 48,
    device: str = "auto",
    progress: bool = True,
    sections: Sequence[str] = SECTIONS,
    tight_tokens: int = 64,
    n_tight: int | None = None,
) -> dict:
    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown or not sections:
        raise ConfigError(f"bench-constraints sections must be among {list(SECTIONS)}, got {list(sections)}")
    schemas = load_schemas(n_schemas) if "calls" in sections or "cost" in sections else []
    if not schemas and ("calls" in sections or "cost" in sections):
        raise ConfigError("no schemas to run: give --schemas >= 1")
    tight = load_schemas(n_tight, "schemas_tight.jsonl") if "tight" in sections else []
    engines = {
        s.label: Ensemble(list(s.members or models), s.method, s.config, device=device, progress=progress)
        for s in methods
    }
    for eng in engines.values():
        eng.load()
        eng.generate("Hello, who are you?", max_new_tokens=4)  # warm-up, outside the timings
        eng.generate("Say ok.", response_format={"type": "json_object"}, max_new_tokens=4)  # matchers built
    cost_rows = schemas[:cost_prompts] if "cost" in sections else []
    call_rows = schemas if "calls" in sections else []
    bar = _progress(len(engines) * (len(call_rows) + 2 * len(cost_rows) + len(tight)), progress)
    t_start = time.perf_counter()
    calls = _calls(engines, call_rows, max_new_tokens, bar)
    cost = _cost(engines, cost_rows, cost_tokens, bar)
    tight_rows = _tight(engines, tight, tight_tokens, bar)
    bar.close()
    results: dict[str, Any] = {
        "models": list(models),
        "schemas": len(call_rows),
        "cost_prompts": len(cost_rows),
        "max_new_tokens": max_new_tokens,
        "cost_tokens": cost_tokens,
        "sections": list(sections),
        "tight_schemas": len(tight),
        "tight_tokens": tight_tokens,
        "wall_time_s": round(time.perf_counter() - t_start, 1),
        "methods": {key: _calls_row(rows, cost[key]) for key, rows in calls.items() if rows},
        "tight": {key: _tight_row(rows) for key, rows in tight_rows.items() if rows},
    }
    return results


def schema_error(value: Any, schema: dict, finish_reason: str = "", parse: bool = False) -> str | None:
    """None when `value` (with `parse`: JSON text) validates against `schema`, else why not."""
    try:
        jsonschema.validate(json.loads(value) if parse else value, schema)
    except ValueError as exc:  # json.JSONDecodeError
        return f"not JSON ({finish_reason}): {exc}"
    except jsonschema.ValidationError as exc:
        return f"invalid: {exc.message}"
    return None


def _calls(engines: dict[str, Ensemble], rows: list[dict], max_new_tokens: int, bar) -> dict[str, list[dict]]:
    """Each schema as a forced tool call, every engine in turn; the call validated."""
    calls: dict[str, list[dict]] = {k: [] for k in engines}
    for row in rows:
        tool = _tool(row)
        for key, eng in engines.items():
            res = eng.generate(row["prompt"], tools=[tool], tool_choice=row["name"], max_new_tokens=max_new_tokens)
            if res.finish_reason != "tool_calls":
                error = f"no call ({res.finish_reason})"
            else:
                error = schema_error(res.tool_calls[0].arguments, row["schema"])
            st = res.stats
            calls[key].append(
                {
                    "schema": row["name"],
                    "valid": error is None,
                    "error": error,
                    "arguments": res.tool_calls[0].arguments if res.tool_calls else None,
                    "time_s": st["time_s"],
                    "tokens_out": st.get("tokens_out", 0),
                    "forced": st.get("forced", 0),
                    "constraint_time_s": st.get("constraint_time_s", 0.0),
                    "forward_passes": {n: f["forward_passes"] for n, f in st["members"].items()},
                    "prefills": {n: f["prefills"] for n, f in st["members"].items()},
                }
            )
            bar.update()
            bar.set_postfix_str(f"calls: {key}")
    return calls


def _cost(engines: dict[str, Ensemble], rows: list[dict], cost_tokens: int, bar) -> dict[str, dict[str, float]]:
    """The same prompts answered freely and with the schema as response_format."""
    cost: dict[str, dict[str, float]] = {
        k: {"free_s": 0.0, "free_tokens": 0, "json_s": 0.0, "json_tokens": 0, "matcher_s": 0.0, "json_valid": 0}
        for k in engines
    }
    for row in rows:
        fmt = {"type": "json_schema", "json_schema": {"name": row["name"], "schema": row["schema"]}}
        for key, eng in engines.items():
            free = eng.generate(row["prompt"], max_new_tokens=cost_tokens)
            bar.update()
            constrained = eng.generate(row["prompt"], response_format=fmt, max_new_tokens=cost_tokens)
            bar.update()
            c = cost[key]
            c["free_s"] += free.stats["time_s"]
            c["free_tokens"] += free.stats.get("tokens_out", 0)
            c["json_s"] += constrained.stats["time_s"]
            c["json_tokens"] += constrained.stats.get("tokens_out", 0)
            c["matcher_s"] += constrained.stats.get("constraint_time_s", 0.0)
            # within cost_tokens a long document may be cut (finish_reason "length")
            c["json_valid"] += schema_error(constrained.text, row["schema"], parse=True) is None
    return cost


def _tight(engines: dict[str, Ensemble], rows: list[dict], tight_tokens: int, bar) -> dict[str, list[dict]]:
    """The tight-budget schemas as response_format at `tight_tokens`; each reply validated."""
    tight_rows: dict[str, list[dict]] = {k: [] for k in engines}
    for row in rows:
        fmt = {"type": "json_schema", "json_schema": {"name": row["name"], "schema": row["schema"]}}
        for key, eng in engines.items():
            res = eng.generate(row["prompt"], response_format=fmt, max_new_tokens=tight_tokens)
            error = schema_error(res.text, row["schema"], res.finish_reason, parse=True)
            st = res.stats
            tight_rows[key].append(
                {
                    "schema": row["name"],
                    "valid": error is None,
                    "error": error,
                    "text": res.text,
                    "finish_reason": res.finish_reason,
                    "closed_early": bool(st.get("closed_early")),
                    "fits": not st.get("closing_short_by"),
                    "tokens_out": st.get("tokens_out", 0),
                    "time_s": st["time_s"],
                }
            )
            bar.update()
            bar.set_postfix_str(f"tight: {key}")
    return tight_rows


def _tight_row(rows: list[dict]) -> dict[str, Any]:
    fitting = [r for r in rows if r["fits"]]
    return {
        "valid": sum(r["valid"] for r in rows),
        "total": len(rows),
        "fitting": len(fitting),
        "valid_of_fitting": sum(r["valid"] for r in fitting),
        "closed_early": sum(r["closed_early"] for r in rows),
        "finish": {f: sum(r["finish_reason"] == f for r in rows) for f in sorted({r["finish_reason"] for r in rows})},
        "seconds_per_call": sum(r["time_s"] for r in rows) / len(rows),
        "tokens_per_call": sum(r["tokens_out"] for r in rows) / len(rows),
        "failures": [r for r in rows if not r["valid"]],
        "rows": rows,
    }


def _calls_row(rows: list[dict], c: dict[str, float]) -> dict[str, Any]:
    n = len(rows)
    free_tok = c["free_s"] / max(1, c["free_tokens"])
    json_tok = c["json_s"] / max(1, c["json_tokens"])
    return {
        "valid": sum(r["valid"] for r in rows),
        "calls": n,
        "seconds_per_call": sum(r["time_s"] for r in rows) / n,
        "tokens_per_call": sum(r["tokens_out"] for r in rows) / n,
        "forced_fraction": sum(r["forced"] for r in rows) / max(1, sum(r["tokens_out"] for r in rows)),
        "max_prefills_per_member": max(max(r["prefills"].values()) for r in rows),
        "forward_passes_per_call": {m: sum(r["forward_passes"][m] for r in rows) / n for m in rows[0]["prefills"]},
        "matcher_share_of_call_time": sum(r["constraint_time_s"] for r in rows)
        / max(1e-9, sum(r["time_s"] for r in rows)),
        "free_time_per_token_s": free_tok,
        "json_time_per_token_s": json_tok,
        "json_over_free": json_tok / free_tok if free_tok else None,
        "matcher_share_of_json_time": c["matcher_s"] / max(1e-9, c["json_s"]),
        "json_valid": c["json_valid"],
        "failures": [r for r in rows if not r["valid"]],
        "calls_detail": rows,
    }


def markdown(results: dict) -> str:
    if not results["methods"]:  # only the tight-budget section ran
        lines = [
            f"# ensemble-llm bench-constraints: {', '.join(results['models'])}",
            "",
            *([f"Command: `{results['command']}`", ""] if results.get("command") else []),
        ]
        return "\n".join(lines + _tight_markdown(results)) + "\n"
    lines = [
        f"# ensemble-llm bench-constraints: {', '.join(results['models'])}",
        "",
        f"{results['schemas']} JSON Schemas as forced tool calls, {results['cost_prompts']} of them also as "
        f"`response_format` against the same prompt answered freely ({results['cost_tokens']} tokens each); call "
        f"budget {results['max_new_tokens']} tokens; "
        f"whole run {results['wall_time_s'] / 60:.1f} min.",
        "",
        *([f"Command: `{results['command']}`", ""] if results.get("command") else []),
        "| method | valid calls | s/call | tokens/call | forced | prefills/member | fwd/call | "
        "matcher share | s/token free | s/token JSON | JSON / free | JSON valid |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for key, r in results["methods"].items():
        fwd = ", ".join(f"{v:.1f}" for v in r["forward_passes_per_call"].values())
        ratio = "" if r["json_over_free"] is None else f"{r['json_over_free']:.2f}"
        lines.append(
            f"| {key} | {r['valid']}/{r['calls']} | {r['seconds_per_call']:.2f} | {r['tokens_per_call']:.1f} | "
            f"{r['forced_fraction']:.0%} | {r['max_prefills_per_member']} | {fwd} | "
            f"{r['matcher_share_of_call_time']:.1%} | {r['free_time_per_token_s']:.4f} | "
            f"{r['json_time_per_token_s']:.4f} | {ratio} | {r['json_valid']}/{results['cost_prompts']} |"
        )
    lines += [
        "",
        "valid calls: the call's arguments validate against the schema (`jsonschema`). forced: share of "
        "output tokens the grammar forced (written without sampling). prefills/member: the most prompt "
        "prefills any member ran for one call. fwd/call: forward passes per call, one figure per member. "
        "matcher share: time inside the llguidance matchers over the request's time. s/token JSON / free: "
        "time per output token with the schema as `response_format` and without it, same prompts.",
    ]
    lines += _failure_lines(results["methods"])
    if results.get("tight"):
        lines += [""] + _tight_markdown(results)
    return "\n".join(lines) + "\n"


def _tight_markdown(results: dict) -> list[str]:
    lines = [
        f"## Tight budget: {results['tight_schemas']} schemas as `response_format` at {results['tight_tokens']} "
        f"tokens (whole run {results['wall_time_s'] / 60:.1f} min)",
        "",
        "| method | valid / total | shortest fits | valid of fitting | closed early | finish reasons | "
        "tokens/call | s/call |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for key, r in results["tight"].items():
        finish = ", ".join(f"{k} {v}" for k, v in r["finish"].items())
        lines.append(
            f"| {key} | {r['valid']}/{r['total']} | {r['fitting']}/{r['total']} | "
            f"{r['valid_of_fitting']}/{r['fitting']} | {r['closed_early']} | {finish} | "
            f"{r['tokens_per_call']:.1f} | {r['seconds_per_call']:.2f} |"
        )
    lines += [
        "",
        "valid: the reply parses and validates against the schema (`jsonschema`). shortest fits: the "
        "schema's shortest document fits the budget in the main member's tokens (else the reply cannot "
        "be complete). closed early: replies the budget-aware closing finished (finish_reason "
        '"length", stats closed_early).',
    ]
    return lines + _failure_lines(results["tight"])


def _failure_lines(rows: dict) -> list[str]:
    """A "Failures:" list (method / schema: error) for a results section's rows, or nothing."""
    failures = [(k, f) for k, r in rows.items() for f in r["failures"]]
    if not failures:
        return []
    return ["", "Failures:", ""] + [f"- {k} / {f['schema']}: {f['error']}" for k, f in failures]


def write(results: dict, out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2, default=str))
    (out / "results.md").write_text(markdown(results))
    return [out / "results.json", out / "results.md"]
