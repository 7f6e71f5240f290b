"""One request's method run and its result (floor 3: imports the methods, guide, evidence, tools).

`run_method` runs the method on every member's prompt under the request's deadline, passing its
text through the stop matcher and the tool-markup filter to the caller; `make_result` gathers the
reply, its usage and the run's figures (per-member forwards, weights, the guide's, the trace).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from .chat import chat_stops, member_messages, render_chat, with_preamble
from .errors import ContextLengthError
from .evidence import MemberPrompts, request_weights, solo_member
from .guide import Guide
from .kvbudget import KVBudget
from .members.context import current_request
from .members.protocol import FULL_ROWS
from .methods import Method, Request
from .methods.base import check_capabilities
from .methods.single import Single, SingleConfig
from .requests import Job
from .results import GenerationResult, ToolCall, Usage
from .stopping import StopPolicy
from .streams import Output
from .tools import ToolTextFilter, tool_policy


class EngineView(Protocol):
    """What the pipeline reads of the engine (engine.py's `Ensemble`, which imports this module)."""

    members: list
    placement: str
    method_class: type
    method_name: str
    model_names: list[str]
    kv_budget: KVBudget

    def member_preamble(self, i: int) -> list[dict]: ...
    def member_weights(self, kind: str = "chat") -> tuple[list[float], int]: ...


def jsonable(entry: dict) -> dict:
    """A trace entry with byte strings as text (EOS as '<eos>'), ready for JSON."""
    out = {}
    for k, v in entry.items():
        if isinstance(v, bytes):
            v = v.decode("utf-8", errors="replace")
        elif v is not None and not isinstance(v, (str, int, float, bool, list, dict)):
            v = "<eos>"
        out[k] = v
    return out


@dataclass
class MethodRun:
    """One method run of a request: its Request (stats, finish reason) and the reply's parts."""

    req: Request
    filter: ToolTextFilter
    tail: str = ""
    text: str = ""
    calls: list[ToolCall] = field(default_factory=list)
    notes: dict[str, Any] = field(default_factory=dict)  # the engine's own figures (tool policy)


def member_prompts(engine: EngineView, job: Job, tool_choice: str) -> tuple[list[str], StopPolicy]:
    """Each member's prompt text (its own chat template or plain transcript, after its preamble)
    and the request's stops with every member's end-of-turn markers."""
    texts, stops = [], job.params.stops
    tools = list(job.params.tools) if job.params.tools else None
    for i, m in enumerate(engine.members):
        if job.params.raw:
            texts.append(job.prompt)
            continue
        msgs = [{"role": "user", "content": job.prompt}] if isinstance(job.prompt, str) else job.prompt
        msgs = with_preamble(engine.member_preamble(i), msgs)
        msgs, member_tools = member_messages(m, msgs, tools, tool_choice)
        texts.append(render_chat(m, msgs, tools=member_tools))
        stops = stops.plus(chat_stops(m))
    return [t + job.head for t in texts], stops


@dataclass(frozen=True)
class Prompted:
    """A request's members' prompts (`member_prompts`), its stops, and the engine's prior member
    weights and main member for its kind of prompt."""

    texts: list[str]
    stops: StopPolicy
    weights: list[float]
    main: int


def make_request(method: Method, members: list, job: Job, prompted: Prompted) -> tuple[Request, dict[str, Any]]:
    """The method's Request: every member's prompt ids (each within its context window), this
    request's member weights from its own evidence (evidence.py), the seed, the grammar."""
    p, texts, weights, main = job.params, prompted.texts, prompted.weights, prompted.main
    prompt_ids = [m.prompt_ids(t) for m, t in zip(members, texts)]
    room = []
    for m, ids in zip(members, prompt_ids):
        if len(ids) >= m.context_window:
            raise ContextLengthError(
                f"the prompt is {len(ids)} tokens for {m.name}, whose context window is "
                f"{m.context_window}; shorten the prompt or drop that member."
            )
        room.append(m.context_window - len(ids))
    notes: dict[str, Any] = {}
    prior = list(weights)
    prompts = MemberPrompts(job.prompt, p.raw, texts, prompt_ids)
    weights, main, aside = request_weights(method, members, prompts, weights, main, notes)
    generator = torch.Generator()
    generator.manual_seed(p.seed if p.seed is not None else int(torch.randint(0, 2**62, ()).item()))
    req = Request(
        prompt_ids,
        min(p.max_new_tokens, *room),
        p.temperature,
        p.top_p,
        generator,
        stops=prompted.stops,
        weights=weights,
        prior=prior,
        main=main,
        aside=aside,
        guide=Guide(p.constraint, members) if p.constraint else None,
        trace=[] if p.trace else None,
        turn_ends=[] if p.raw else [next(iter(chat_stops(m)), "") for m in members],
    )
    return req, notes


def run_method(
    method: Method,
    members: list,
    job: Job,
    prompted: Prompted,
    out: Output,
    cancel: threading.Event,
    budget: KVBudget | None = None,
) -> MethodRun:
    """The method's run on every member's prompt, once its KV bound fits the engine's `budget`
    (kvbudget.py), under the request's deadline, its text passed through the stop matcher and the
    tool-markup filter to the caller. A request whose prior and evidence both give one member the
    method's `solo` weight runs that member alone (`evidence.solo_member`; stats["solo"])."""
    constrained = frozenset({FULL_ROWS}) if job.params.constraint else frozenset()
    what = f"method {method.name!r}" + " with constrained output" * bool(constrained)
    check_capabilities(members, method.needs() | constrained, what)
    req, notes = make_request(method, members, job, prompted)
    planned, planned_ids = members, req.prompt_ids
    solo = solo_member(method, prompted.weights, req.weights, req.main, req.aside)
    if solo is not None:  # one member holds the prior and the evidence: it runs alone
        method = Single(members, SingleConfig(member=solo))
        notes["solo"] = members[solo].name
        for i, m in enumerate(members):
            if i != solo:
                m.forget_prompt(req.prompt_ids[i])
        planned, planned_ids = [members[solo]], [req.prompt_ids[solo]]
    if budget is None:
        return _run(method, job, req, notes, prompted.stops, out, cancel)
    res = budget.plan(planned, planned_ids, req.max_new_tokens, method.kv_rows())
    ctx = current_request()
    check = ctx.check if ctx is not None and ctx.check is not None else job.check_deadline
    with budget.hold(res, check):  # the request's deadline and cancel
        notes["kv_reserved_bytes"], notes["kv_wait_s"] = sum(budget.bound([res]).values()), round(res.waited_s, 4)
        return _run(method, job, req, notes, prompted.stops, out, cancel)


def _run(
    method: Method, job: Job, req: Request, notes: dict, stops: StopPolicy, out: Output, cancel: threading.Event
) -> MethodRun:
    p = job.params
    # holds back tool-call markup and passes content through; with tool_choice "none" a call
    # the model writes anyway (imitating its history) is cut from the content, not returned
    run = MethodRun(req, ToolTextFilter(list(p.tools) if p.tools else None), notes=notes)
    matcher = stops.matcher()
    if job.head:  # the reply's fixed start, given at the end of the prompts
        out.send(run.filter.feed(job.head))
    gen = method.run(req)
    try:
        for piece in gen:
            job.check_deadline()
            out.send(run.filter.feed(matcher.feed(piece)))
            if matcher.stopped or cancel.is_set():
                req.finish_reason = "stop"
                break
    finally:
        gen.close()
    out.send(run.filter.feed(matcher.flush()))
    run.tail, run.text, run.calls = run.filter.finish()
    out.send(run.tail)
    return run


def member_stats(engine: EngineView, before: list[tuple], tokens_out: int) -> dict[str, Any]:
    """Each member's forwards, forward time and prefills during the run, its KV bytes per token
    and the prompt tokens it took from a stored prompt (and, on Ray, the bytes moved to and from
    its actor and the round trips)."""
    stats: dict[str, Any] = {"members": {}}
    moved, ray = 0, engine.placement == "ray"
    for m, (n0, t0, p0, b0, r0) in zip(engine.members, before):
        n, t, p, b, r = m.counters()
        stats["members"][m.name] = {"forward_passes": n - n0, "forward_time_s": round(t - t0, 4), "prefills": p - p0}
        kv, reused = m.kv_account(), m.prompt_reused()
        if kv.per_token:  # its KV bytes per token of context (here or on its actor)
            stats["members"][m.name]["kv_bytes_per_token"] = kv.per_token
        if reused is not None:  # prompt tokens taken from a stored prompt (members/prefix.py)
            stats["members"][m.name]["prompt_tokens_reused"] = reused
        if ray:  # payload bytes to and from the member's actor, waits for its answers
            stats["members"][m.name].update(bytes_moved=b - b0, round_trips=r - r0)
            moved += b - b0
    if ray:
        stats["bytes_moved"] = moved
        stats["bytes_moved_per_token"] = round(moved / max(1, tokens_out), 1)
    return stats


def make_result(
    engine: EngineView,
    job: Job,
    run: MethodRun,
    calls: list[ToolCall],
    main_prompt: str,
    before: list[tuple[int, float, int, int, int]],
    out: Output,
) -> GenerationResult:
    """The reply, its usage (the main member's tokens, `main_prompt` its prompt) and the run's
    figures, with the request's own member weights and main member (evidence.py)."""
    members, req = engine.members, run.req
    weights, main = req.weights, req.main
    stats = {**req.stats.to_dict(), **run.notes}
    raw_text = run.filter.text
    written = raw_text.removeprefix(job.head)  # the head was in the prompt, not generated
    stats.update(member_stats(engine, before, req.stats.tokens_out))
    n_out = len(members[main].encode(written)) if written else 0
    cached = stats["members"][members[main].name].get("prompt_tokens_reused", 0)  # from a stored prompt
    usage = Usage(len(members[main].prompt_ids(main_prompt)), n_out, cached)
    if len(members) > 1 and engine.method_class.name != "single":
        stats["member_weights"] = {m.name: round(w, 4) for m, w in zip(members, weights)}
        stats["main_member"] = members[main].name
    if req.guide is not None:
        stats.update(req.guide.stats())
    if req.trace is not None:
        stats["trace"] = [jsonable(e) for e in req.trace]
    stats["time_s"] = round(time.perf_counter() - out.t0, 4)
    stats["time_to_first_chunk_s"] = None if out.first is None else round(out.first, 4)
    finish = "tool_calls" if calls else req.finish_reason
    return GenerationResult(
        run.text, finish, usage, stats, engine.method_name, engine.model_names, calls, raw_text, req.stats
    )


def run_request(engine: EngineView, method: Method, job: Job, out: Output, cancel: threading.Event) -> GenerationResult:
    """One generation request, step by step: every member's prompt, the member weights, the
    method's run, the tool policy (answered again without tools after a repeated call), the result."""
    before = [m.counters() for m in engine.members]
    choice, retried, method = job.params.tool_choice, None, method.for_kind(job.params.raw)
    while True:
        texts, stops = member_prompts(engine, job, choice)
        prompted = Prompted(texts, stops, *engine.member_weights("raw" if job.params.raw else "chat"))
        job.check_deadline()  # calibrating may have used it up
        run = run_method(method, engine.members, job, prompted, out, cancel, engine.kv_budget)
        calls, again = tool_policy(job.prompt, run.calls, run.text, choice, run.notes)
        if not again:
            break
        choice, retried = "none", run  # only a repeated call was written: answer again without tools
    result = make_result(engine, job, run, calls, texts[run.req.main], before, out)
    if method.name != engine.method_name:  # auto: the method of this request's kind
        result.stats["method"] = method.name
    if retried is not None:
        result.stats["answered_without_tools_after_repeated_call"] = True
        result.stats["repeated_tool_calls_dropped"] = retried.notes["repeated_tool_calls_dropped"]
    return result
