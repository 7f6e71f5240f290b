"""Log-probabilities in OpenAI's shapes, from `Ensemble.score`'s figures (scoring.py): the legacy
completions object (`tokens`, `token_logprobs`, `top_logprobs`, `text_offset`) and the chat
object (`content`: per token its text, log-probability, bytes and best alternatives). The
ensemble's own extra, each member's log-probability of every token, rides along in `members`.
Plain data: the server and the facades build their responses from it."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

from .errors import RequestError
from .scores import Score, TokenLogprob


def completion_logprobs(
    score: Score,
    *,
    lead: Sequence[TokenLogprob] = (),
    top: int = 0,
    offset: int = 0,
    end_text: str = "",
    hidden: bool = False,
) -> dict[str, Any]:
    """The completions `logprobs` object of `score`'s tokens. `lead`: tokens before them that
    were not scored (an echoed prompt's first token, which has no context, and the prompt before
    its answer label: log-probability null, as OpenAI and vLLM give the first token); `offset`:
    the characters before the first token (the prompt's, when it is not echoed); `end_text`: the
    EOS token's text, for the end of text when it was scored (`Score.end`); `hidden`: a last
    generated token whose bytes end no character, so no text shows it: an entry with no text and
    null figures."""
    end = [] if score.end is None else [dataclasses.replace(score.end, token=end_text, top=[])]
    unshown = [TokenLogprob(token="", bytes=b"", logprob=0.0, members={})] if hidden else []
    tokens = list(lead) + list(score.tokens) + end + unshown
    out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": [], "members": []}
    text = b""
    for i, t in enumerate(tokens):
        unscored = i < len(lead) or i >= len(tokens) - len(unshown)
        out["tokens"].append(t.token)
        out["token_logprobs"].append(None if unscored else finite(t.logprob))
        alts = {tok: finite(lp) for tok, lp in t.top} or {t.token: finite(t.logprob)}
        out["top_logprobs"].append(None if unscored or not top else alts)
        out["text_offset"].append(offset + len(text.decode("utf-8", errors="ignore")))
        out["members"].append(None if unscored else {n: finite(v) for n, v in t.members.items()})
        text += t.bytes
    return out


def chat_logprobs(score: Score, *, top: int = 0) -> dict[str, Any]:
    """The chat `logprobs` object: `content`, one entry per token of the reply."""
    return {"content": [_chat_token(t, top) for t in score.tokens], "refusal": None}


def _chat_token(t: TokenLogprob, top: int) -> dict[str, Any]:
    alts: Sequence[tuple[str, float]] = t.top[:top] if top else []
    return {
        "token": t.token,
        "logprob": finite(t.logprob),
        "bytes": list(t.bytes),
        "top_logprobs": [{"token": tok, "logprob": finite(lp), "bytes": list(_bytes_of(tok))} for tok, lp in alts],
        "members": {n: finite(v) for n, v in t.members.items()},
    }


def finite(x: float) -> float:
    """JSON has no -inf: a text a member cannot write gets -9999.0, vLLM's figure for it."""
    return x if math.isfinite(x) else -9999.0


def _bytes_of(token: str) -> bytes:
    """The bytes a token text stands for (`scoring.token_text`'s 'bytes:\\xNN' form included)."""
    if token.startswith("bytes:"):
        return bytes(int(h, 16) for h in token[len("bytes:") :].split("\\x")[1:])
    return token.encode("utf-8")


def reply_logprobs(engine: Any, prompt: Any, text: str, *, top: int = 0, raw: bool = False) -> dict[str, Any]:
    """The chat `logprobs` object of a reply `text` to `prompt`: the ensemble's score of it
    (`Ensemble.score`), as the facades put it in their responses."""
    (score,) = _scorer(engine)(prompt, [text], raw=raw, top=top)
    return chat_logprobs(score, top=top)


async def areply_logprobs(engine: Any, prompt: Any, text: str, *, top: int = 0, raw: bool = False) -> dict[str, Any]:
    """`reply_logprobs` for asyncio."""
    from .scoring import Scoring

    _scorer(engine)
    res = await engine.ascore(prompt, Scoring((text,), top=top), raw=raw)
    return chat_logprobs(res.scores[0], top=top)


def _scorer(engine: Any) -> Any:
    if not hasattr(engine, "score"):
        raise RequestError(
            "logprobs are read from a local engine's Ensemble.score; with base_url= the server scores "
            "(send logprobs in the request to it), so drop logprobs here or base_url"
        )
    return engine.score


def check_facade_options(logprobs: bool, top: int | None, client_mode: bool) -> None:
    """The LangChain and LlamaIndex facades' `logprobs`/`top_logprobs`, checked at construction."""
    if top and not logprobs:
        raise ValueError("top_logprobs needs logprobs=True")
    if logprobs and client_mode:
        raise ValueError("logprobs=True reads a local engine's scores; with base_url= drop logprobs (for now)")


def check_facade_call(logprobs: bool, params: Any) -> None:
    """A facade call with `logprobs`: a reply with tool calls is not scored."""
    if logprobs and params.tools:
        raise ValueError("logprobs=True with tools: a reply with tool calls is not scored; drop one of them")
