"""What `serve` adds for log-probabilities (scoring.py, logprobs.py): chat `logprobs` and
`top_logprobs`, completions `logprobs`, `echo` and `max_tokens: 0`, and prompts given as token
ids. The figures are `Ensemble.score`'s: the reply (and, with `echo`, the prompt) scored by the
ensemble after generation, reported in the tokens of the engine's main member for that kind of
prompt, whose tokenizer a client such as lm-evaluation-harness uses for token-id prompts. An
option this server cannot honour is refused with a 400 naming it, never answered with null."""

from __future__ import annotations

import asyncio
import bisect
import dataclasses
import itertools
from dataclasses import dataclass
from typing import Any

from .defaults import MAX_NEW_TOKENS
from .errors import RequestError
from .evidence import context_end
from .logprobs import chat_logprobs, completion_logprobs
from .results import GenerationResult, Usage
from .scoring import Scoring, TokenLogprob, check_top, token_text


@dataclass(frozen=True)
class Wants:
    """The log-probability options of one request, checked."""

    logprobs: bool = False
    top: int = 0
    echo: bool = False
    generate: bool = True  # max_tokens: 0 with echo scores the prompt alone
    max_tokens: int = 0  # the budget, in the reporting member's tokens (echo's entries for the reply)
    ids: tuple[int, ...] | None = None  # a completions prompt given as token ids


def reporting_member(engine: Any, raw: bool) -> Any:
    """The member whose tokens the figures are reported in (and token-id prompts are read in)."""
    return engine.members[engine.member_weights("raw" if raw else "chat")[1]]


MAX_PROMPTS = 64  # prompts in one completions request (a harness's batch)


def completion_prompts(engine: Any, prompt: Any) -> list[tuple[str, tuple[int, ...] | None]]:
    """A completions `prompt` as (text, token ids or None) per prompt: a string, a list of
    strings, token ids of the reporting member, or a list of such lists (a batch, one choice
    each, as lm-evaluation-harness sends them with batch_size > 1)."""
    if isinstance(prompt, str) or _ids(prompt):
        return [completion_prompt(engine, prompt)]
    if not isinstance(prompt, list) or not prompt:
        raise RequestError("prompt must be a string, a list of token ids, or a non-empty list of either")
    if len(prompt) > MAX_PROMPTS:
        raise RequestError(f"{len(prompt)} prompts in one request; send at most {MAX_PROMPTS}")
    return [completion_prompt(engine, p) for p in prompt]


def _ids(x: Any) -> bool:
    return isinstance(x, list) and bool(x) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)


def completion_prompt(engine: Any, prompt: Any) -> tuple[str, tuple[int, ...] | None]:
    """One completions prompt as text: a string, or token ids of the reporting member. A
    special token may lead them (the EOS or BOS lm-evaluation-harness puts before an empty
    context): the text is then the rest, scored from the start of a text."""
    if isinstance(prompt, str):
        return prompt, None
    if _ids(prompt):
        member = reporting_member(engine, raw=True)
        vb, special = member.vocab_bytes, member.special_ids
        bad = [t for i, t in enumerate(prompt) if not 0 <= t < len(vb) or (t in special and i > 0)]
        if bad:
            raise RequestError(
                f"prompt token ids {bad[:5]} are not text tokens of {member.name}, whose tokenizer this "
                "server reads token ids with (GET /tokenizer_info); send text, or ids of that tokenizer "
                "with no special token but a leading one."
            )
        lead = 1 if prompt[0] in special else 0
        try:
            return b"".join(vb[t] for t in prompt[lead:]).decode("utf-8"), tuple(prompt)
        except UnicodeDecodeError:
            raise RequestError("prompt token ids do not spell whole UTF-8 characters; send text") from None
    raise RequestError("prompt must be a string, a list of token ids, or a non-empty list of either")


def wants(body: Any, chat: bool, max_tokens: Any, ids: tuple[int, ...] | None = None) -> Wants:
    """The request's log-probability options, or a RequestError naming the one it cannot have."""
    if chat:
        top = body.top_logprobs
        if top is not None and not body.logprobs:
            raise RequestError("top_logprobs needs logprobs: true")
        w = Wants(logprobs=bool(body.logprobs), top=check_top(top or 0, "top_logprobs"))
    else:
        lp = body.logprobs
        budget = max_tokens if isinstance(max_tokens, int) else MAX_NEW_TOKENS
        w = Wants(lp is not None, check_top(lp or 0, "logprobs"), bool(body.echo), ids=ids, max_tokens=budget)
        if max_tokens == 0:
            if not body.echo:
                raise RequestError("max_tokens: 0 generates nothing; it needs echo: true (to score the prompt)")
            w = dataclasses.replace(w, echo=True, generate=False)
    if (w.logprobs or w.echo) and body.stream:
        raise RequestError("logprobs and echo are not streamed here; send them with stream: false")
    if w.logprobs and chat and body.tools:
        raise RequestError("logprobs with tools: a reply with tool calls is not scored here; drop one of them")
    return w


def prompt_only(engine: Any, prompt: str) -> GenerationResult:
    """The result of a request that generates nothing (max_tokens: 0 with echo)."""
    tokens = len(reporting_member(engine, raw=True).prompt_ids(prompt))
    return GenerationResult(
        text="", finish_reason="length", usage=Usage(tokens, 0), method=engine.method_name, models=engine.model_names
    )


async def scored(
    engine: Any, w: Wants, prompt: Any, result: GenerationResult, chat: bool, stops: tuple[str, ...] = ()
) -> tuple[dict | None, GenerationResult]:
    """The choice's `logprobs` object (None when not asked for), and the result (with echo, its
    text cut to the budget in the reporting member's tokens)."""
    if not w.logprobs:
        return None, result
    if chat:
        res = await engine.ascore(prompt, Scoring((result.text,), top=w.top), raw=False)
        return chat_logprobs(res.scores[0], top=w.top), result
    if not w.echo:
        res = await engine.ascore(prompt, Scoring((result.text,), top=w.top))
        return completion_logprobs(res.scores[0], top=w.top, offset=len(prompt)), result
    return (await echoed(engine, [w], [prompt], [result], stops))[0]


def reply_in_scoring(engine: Any, w: Wants, params: Any) -> bool:
    """Whether an echoed request's reply is read off its scoring rather than generated apart: one
    member, greedy, one token, no stop strings (lm-evaluation-harness's log-likelihood request).
    The reply is then the member's most probable next token, what `single` writes, without
    prefilling the prompt a second time."""
    one = len(engine.members) == 1 and params.temperature == 0 and not params.stop
    return one and w.echo and w.logprobs and w.generate and w.max_tokens == 1


@dataclass
class _Echo:
    """One echoed prompt's scoring, planned: the context it is scored after, the text scored (the
    rest of the prompt and the reply), and what its entries need afterwards."""

    context: str
    rest: str
    token_ids: tuple[int, ...]
    eos: bool
    weigh: str | None
    read: bool  # the reply is read off the scoring (`reply_in_scoring`)
    prompt_tokens: int
    unscored: list[TokenLogprob]
    result: GenerationResult
    hidden: bool = False  # the reply is bytes that end no character: one entry with no figure


async def echoed(
    engine: Any, ws: list[Wants], prompts: list[str], results: list[GenerationResult | None], stops: tuple[str, ...]
) -> list[tuple[dict, GenerationResult]]:
    """Prompts and replies as one text each: one entry per prompt token, then one per generated
    token (an EOS included, as OpenAI and vLLM give them). Each is scored from where
    `_scored_from` says, after a context that also sets the member weights; the tokens before it
    are null. Prompts scored after the same context (a harness's choices of one question, sent in
    one batch) are one scoring request: their shared work done once. A result None: the reply is
    read off the scoring (`reply_in_scoring`)."""
    plans = [_plan(engine, w, p, r, stops) for w, p, r in zip(ws, prompts, results)]
    groups: dict[tuple, list[int]] = {}
    for i, pl in enumerate(plans):
        groups.setdefault((pl.context, pl.weigh, pl.read), []).append(i)

    async def one(idx: list[int]) -> tuple[list[int], list[Any]]:
        first = plans[idx[0]]
        scoring = Scoring(
            tuple(plans[i].rest for i in idx),
            weigh=first.weigh,
            token_ids=tuple(plans[i].token_ids for i in idx),
            top=ws[idx[0]].top,
            ends=tuple(plans[i].eos for i in idx),
            greedy_next=first.read,
        )
        return idx, (await engine.ascore(first.context, scoring)).scores

    out: list[Any] = [None] * len(plans)
    for idx, scores in await asyncio.gather(*(one(idx) for idx in groups.values())):
        for i, score in zip(idx, scores):
            out[i] = _finish(engine, ws[i], plans[i], score)
    return out


def _plan(engine: Any, w: Wants, prompt: str, result: GenerationResult | None, stops: tuple[str, ...]) -> _Echo:
    """What one echoed prompt's scoring is (see `echoed`), or a RequestError naming why it has none."""
    member = reporting_member(engine, raw=True)
    vb = member.vocab_bytes
    ids = list(w.ids) if w.ids is not None else member.encode(prompt)
    if not ids:
        raise RequestError("echo with logprobs needs a prompt with at least one token")
    lead = 1 if ids[0] in member.special_ids else 0
    if b"".join(vb[t] for t in ids[lead:]) != prompt.encode("utf-8"):
        raise RequestError(f"the prompt's tokens in {member.name} do not spell it; send it as token ids")
    read = result is None
    gen, result = ([], GenerationResult("", "length", Usage(len(ids), 0))) if read else _generated(member, w, result)
    j = _scored_from(member, prompt, ids, lead, w.generate)
    context = b"".join(vb[t] for t in ids[lead:j]).decode("utf-8")
    if not context:
        raise RequestError(
            f"echo with logprobs scores a text after a context; this prompt has none in {member.name}'s "
            "tokens (send at least one text token before what is scored)"
        )
    eos = w.generate and result.finish_reason == "stop" and not stops and len(gen) < w.max_tokens
    weigh = prompt if j == lead + 1 else None  # scored from its start: the whole prompt weighs, as before
    unscored = [TokenLogprob(token=token_text(vb[t]), bytes=vb[t], logprob=0.0, members={}) for t in ids[:j]]
    rest, token_ids = prompt[len(context) :] + result.text, tuple(ids[j:]) + tuple(gen)
    hidden = _hidden(w, read, gen, result)
    return _Echo(context, rest, token_ids, eos, weigh, read, len(ids), unscored, result, hidden)


def _hidden(w: Wants, read: bool, gen: list[int], result: GenerationResult) -> bool:
    """Whether the reply is a token of half a character, which a method never shows as text
    (methods/text.py's Utf8Releaser): its entry is still given, null, so that a client that counts
    entries (lm-evaluation-harness drops the last one) drops none of the prompt's."""
    wrote = result.usage.completion_tokens > 0
    return w.generate and not read and not gen and result.finish_reason == "length" and wrote


def _finish(engine: Any, w: Wants, plan: _Echo, score: Any) -> tuple[dict, GenerationResult]:
    """One echoed prompt's logprobs object from its score, and its result."""
    member = reporting_member(engine, raw=True)
    result = plan.result
    if plan.read:
        score, result = _read_reply(score, plan.prompt_tokens, engine)
    end = member.decode([member.eos_id], skip_special_tokens=False) if member.eos_id is not None else ""
    return completion_logprobs(score, lead=plan.unscored, top=w.top, end_text=end, hidden=plan.hidden), result


def _read_reply(score: Any, prompt_tokens: int, engine: Any) -> tuple[Any, GenerationResult]:
    """The score with the read reply token as its last entry (a special token: as the end of
    text), and the result that reply makes."""
    nxt = score.next
    usage = Usage(prompt_tokens, 1)
    info = {"method": engine.method_name, "models": engine.model_names}
    if not nxt.bytes:  # EOS: the reply ends before any text
        return dataclasses.replace(score, end=nxt), GenerationResult("", "stop", usage, **info)
    text = nxt.bytes.decode("utf-8", errors="replace")  # half a character shows as U+FFFD, as vLLM does
    return dataclasses.replace(score, tokens=[*score.tokens, nxt]), GenerationResult(text, "length", usage, **info)


def _generated(member: Any, w: Wants, result: GenerationResult) -> tuple[list[int], GenerationResult]:
    """The reply's tokens in the reporting member, at most max_tokens of them, and the result with
    its text cut to them (a reply that re-encodes into more tokens than it was allowed)."""
    gen = member.encode(result.text) if result.text else []
    if not w.generate or len(gen) <= w.max_tokens:
        return gen, result
    gen = gen[: w.max_tokens]
    data = b"".join(member.vocab_bytes[t] for t in gen)
    while gen and not _whole(data):
        gen.pop()
        data = b"".join(member.vocab_bytes[t] for t in gen)
    return gen, dataclasses.replace(result, text=data.decode("utf-8"), finish_reason="length")


def _whole(data: bytes) -> bool:
    try:
        data.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


def _scored_from(member: Any, prompt: str, ids: list[int], lead: int, generate: bool) -> int:
    """The first prompt token scored. A request that generates (lm-evaluation-harness's
    log-likelihoods: the context, then a choice) is scored from its context's end
    (`evidence.context_end`), so that its figures and its member weights are the context's, the
    same for every choice; one whose prompt begins with a special token (the harness's rolling
    windows and empty contexts), and one that only scores its prompt (max_tokens: 0), from their
    first text token. Never the first token: it has no context."""
    if lead or not generate:
        return 1
    cut = len(prompt[: context_end(prompt)].encode("utf-8"))
    j = bisect.bisect_right(list(itertools.accumulate(len(member.vocab_bytes[t]) for t in ids)), cut)
    while j > 1 and not _whole(b"".join(member.vocab_bytes[t] for t in ids[:j])):
        j -= 1
    return max(j, 1)
