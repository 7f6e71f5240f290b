"""What scoring returns (scoring.py, token_scoring.py): a continuation's `Score`, with one
`TokenLogprob` per token of the reporting member, and the request's `ScoreResult`; and how a
text splits into that member's tokens."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from .errors import RequestError


@dataclass
class TokenLogprob:
    """One token of the main member's tokenization of the continuation: its text and bytes, the
    ensemble's log-probability of those bytes, each member's, and the best other tokens."""

    token: str
    bytes: bytes
    logprob: float
    members: dict[str, float]
    top: list[tuple[str, float]] = field(default_factory=list)


@dataclass
class Score:
    """One continuation's log-likelihood after the prompt: the ensemble's, each member's own
    (byte-level, marginalised over its tokenizations; one member alone: its tokens'
    log-probabilities), and per token of the main member."""

    text: str
    logprob: float
    members: dict[str, float]
    tokens: list[TokenLogprob]
    greedy: bool | None  # every byte was the ensemble's most probable next byte (one member: every token
    # was its argmax; None where only the tokens' own log-probabilities were computed)
    end: TokenLogprob | None = None  # the end of text after it, when asked (`Scoring.ends`)
    next: TokenLogprob | None = None  # one member's most probable token after it (`Scoring.greedy_next`)

    def to_dict(self) -> dict[str, Any]:
        return {
            "text": self.text,
            "logprob": self.logprob,
            "members": self.members,
            "greedy": self.greedy,
            "tokens": [
                {"token": t.token, "bytes": list(t.bytes), "logprob": t.logprob, "members": t.members, "top": t.top}
                for t in self.tokens
            ],
        }


@dataclass
class ScoreResult:
    """What a scoring request returns through the worker: the scores and the request's figures."""

    scores: list[Score]
    stats: dict[str, Any] = field(default_factory=dict)


def token_spans(member: Any, text: str, ids: Sequence[int] | None = None) -> list[tuple[int, int, int]]:
    """(token id, first byte, end byte) of each token of `text` in its UTF-8 bytes: `ids` (the
    member's tokens for it, checked to spell it) or the member's canonical tokenization."""
    if ids is None:
        ids, ends = member.encode_with_offsets(text)
    else:
        vb, ends, pos = member.vocab_bytes, [], 0
        for t in ids:
            if not 0 <= int(t) < len(vb):
                raise RequestError(f"token id {t} is outside {member.name}'s vocabulary (0..{len(vb) - 1})")
            pos += len(vb[int(t)])
            ends.append(pos)
        if b"".join(vb[int(t)] for t in ids) != text.encode("utf-8"):
            raise RequestError(f"the token ids do not spell the text in {member.name}'s vocabulary")
    out, start = [], 0
    for tok, end in zip(ids, ends):
        out.append((int(tok), start, end))
        start = end
    return out


def token_text(data: bytes) -> str:
    """A token's bytes as text; bytes that are not whole UTF-8 characters as 'bytes:\\xNN' (vLLM's form)."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in data)
