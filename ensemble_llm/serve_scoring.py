"""What `serve` adds for log-probabilities (scoring.py, logprobs.py): chat `logprobs` and
`top_logprobs`, completions `logprobs`, `echo` and `max_tokens: 0`, and prompts given as token
ids. The figures are `Ensemble.score`'s: the reply (and, with `echo`, the prompt) scored by the
ensemble after generation, reported in the tokens of the engine's main member for that kind of
prompt, whose tokenizer a client such as lm-evaluation-harness uses for token-id prompts. An
option this server cannot honour is refused with a 400 naming it, never answered with null."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .errors import RequestError
from .logprobs import chat_logprobs, completion_logprobs
from .results import GenerationResult, Usage
from .scoring import Scoring, TokenLogprob, check_top


@dataclass(frozen=True)
class Wants:
    """The log-probability options of one request, checked."""

    logprobs: bool = False
    top: int = 0
    echo: bool = False
    generate: bool = True  # max_tokens: 0 with echo scores the prompt alone
    ids: tuple[int, ...] | None = None  # a completions prompt given as token ids


def reporting_member(engine: Any, raw: bool) -> Any:
    """The member whose tokens the figures are reported in (and token-id prompts are read in)."""
    return engine.members[engine.member_weights("raw" if raw else "chat")[1]]


def completion_prompt(engine: Any, prompt: Any) -> tuple[str, tuple[int, ...] | None]:
    """A completions prompt as text: a string, or token ids of the reporting member (one list,
    or a list of one list), as lm-evaluation-harness sends them."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt, None
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        member = reporting_member(engine, raw=True)
        vb = member.vocab_bytes
        bad = [t for t in prompt if not 0 <= t < len(vb) or t in member.special_ids]
        if bad:
            raise RequestError(
                f"prompt token ids {bad[:5]} are not text tokens of {member.name}, whose tokenizer this "
                "server reads token ids with; send text, or ids of that tokenizer without special tokens."
            )
        try:
            return b"".join(vb[t] for t in prompt).decode("utf-8"), tuple(prompt)
        except UnicodeDecodeError:
            raise RequestError("prompt token ids do not spell whole UTF-8 characters; send text") from None
    raise RequestError("prompt must be a string, one list of token ids, or a list of one of them")


def wants(body: Any, chat: bool, max_tokens: Any, ids: tuple[int, ...] | None = None) -> Wants:
    """The request's log-probability options, or a RequestError naming the one it cannot have."""
    if chat:
        top = body.top_logprobs
        if top is not None and not body.logprobs:
            raise RequestError("top_logprobs needs logprobs: true")
        w = Wants(logprobs=bool(body.logprobs), top=check_top(top or 0, "top_logprobs"))
    else:
        lp = body.logprobs
        w = Wants(logprobs=lp is not None, top=check_top(lp or 0, "logprobs"), echo=bool(body.echo), ids=ids)
        if max_tokens == 0:
            if not body.echo:
                raise RequestError("max_tokens: 0 generates nothing; it needs echo: true (to score the prompt)")
            w = Wants(w.logprobs, w.top, True, False, ids)
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


async def scored(engine: Any, w: Wants, prompt: Any, result: GenerationResult, chat: bool) -> dict | None:
    """The choice's `logprobs` object (None when not asked for)."""
    if not w.logprobs:
        return None
    if chat:
        res = await engine.ascore(prompt, Scoring((result.text,), top=w.top), raw=False)
        return chat_logprobs(res.scores[0], top=w.top)
    if not w.echo:
        res = await engine.ascore(prompt, Scoring((result.text,), top=w.top))
        return completion_logprobs(res.scores[0], top=w.top, offset=len(prompt))
    return await _echoed(engine, w, prompt, result.text)


async def _echoed(engine: Any, w: Wants, prompt: str, text: str) -> dict:
    """Prompt and reply scored as one text after the prompt's first token (which has no context:
    null, as OpenAI gives it), with the prompt's shown answers setting the member weights."""
    member = reporting_member(engine, raw=True)
    ids = list(w.ids) if w.ids is not None else member.encode(prompt)
    if not ids:
        raise RequestError("echo with logprobs needs a prompt with at least one token")
    vb = member.vocab_bytes
    head = vb[ids[0]]
    whole = (prompt + text).encode("utf-8")
    if not whole.startswith(head) or len(head) == 0:
        raise RequestError("the prompt's first token does not begin its text; send the prompt as text")
    try:
        rest, head_text = whole[len(head) :].decode("utf-8"), head.decode("utf-8")
    except UnicodeDecodeError:
        raise RequestError("the prompt's first token is not whole UTF-8 characters; send the prompt as text") from None
    tokens = tuple(ids[1:]) + tuple(member.encode(text)) if text else tuple(ids[1:])
    scoring = Scoring((rest,), weigh=prompt, token_ids=(tokens,), top=w.top)
    res = await engine.ascore(head_text, scoring)
    first = TokenLogprob(token=head_text, bytes=head, logprob=0.0, members={})
    return completion_logprobs(res.scores[0], first=first, top=w.top)
