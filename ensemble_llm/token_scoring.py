"""Scoring with one member (`Ensemble.score` on a one-member engine): the member's own token
log-probabilities, as llama.cpp or transformers compute them, over its whole vocabulary. There is
no tokenizer to reconcile, so no byte walk: the prompt is prefilled once and every continuation's
tokens are scored in one forward (their alternatives: one forward each). A harness that scores
with the member on its own (llama-cpp-python, lm-evaluation-harness's `gguf` or `hf` models)
gets the same figures, and the same ranking of choices. The alternatives are the member's own
next-token distribution, so a token is greedy exactly when it is the member's argmax."""

from __future__ import annotations

from typing import Any, Sequence

import torch

from .scores import Score, ScoreResult, TokenLogprob, token_spans, token_text


def run_token_score(engine: Any, job: Any, prompt_ids: list[int], names: Sequence[str]) -> ScoreResult:
    """`job.scoring` after the member's prompt ids: each continuation's tokens (given, else its
    canonical ones), their log-probabilities, the end of text where asked, and the alternatives."""
    (member,), sc = engine.members, job.scoring
    spans = [
        token_spans(member, c, None if sc.token_ids is None else sc.token_ids[i])
        for i, c in enumerate(sc.continuations)
    ]
    state = member.prefill(prompt_ids)
    ends = sc.ends or (False,) * len(spans)
    rows = _rows(member, state, spans) if sc.top > 0 or any(ends) or sc.greedy_next else None
    values = [[float(r[t]) for r, (t, _, _) in zip(rs, sp)] for rs, sp in zip(rows, spans)] if rows else None
    values = values or _values(member, state, spans)
    scores = []
    for i, (c, sp) in enumerate(zip(sc.continuations, spans)):
        data = c.encode("utf-8")
        tokens = []
        for j, (t, a, b) in enumerate(sp):
            alts = _alternatives(member, rows[i][j], t, data[a:b], values[i][j], sc.top) if sc.top else []
            tokens.append(TokenLogprob(token_text(data[a:b]), data[a:b], values[i][j], {names[0]: values[i][j]}, alts))
        end = _end(member, rows[i][len(sp)], names[0]) if ends[i] else None
        greedy = None if rows is None else all(int(torch.argmax(rows[i][j])) == t for j, (t, _, _) in enumerate(sp))
        total = float(sum(values[i]))
        after = _next(member, rows[i][len(sp)], sc.top, names[0]) if sc.greedy_next else None
        scores.append(Score(c, total, {names[0]: total}, tokens, greedy, end, after))
    return ScoreResult(scores, {"weights": [1.0], "level": "tokens", "tokens_of": member.name})


def _rows(member: Any, state: Any, spans: list) -> list[list[torch.Tensor]]:
    """Per continuation, the member's log-probability rows before each of its tokens and after the
    last (one forward per continuation)."""
    first, out = member.ensure_next(state), []
    for sp in spans:
        ids = [t for t, _, _ in sp]
        if not ids:
            out.append([first])
            continue
        with member.scratch(state):
            got = member.extend(state, ids)
        out.append([first, *got])
    return out


def _values(member: Any, state: Any, spans: list) -> list[list[float]]:
    """Per continuation, its tokens' log-probabilities: all continuations in one forward."""
    cands = [[t for t, _, _ in sp] for sp in spans]
    live = [c for c in cands if c]
    scored = iter(member.score_inline(state, live) if live else [])
    return [[float(v) for v in next(scored)] if c else [] for c in cands]


def _alternatives(member: Any, row: torch.Tensor, tid: int, data: bytes, lp: float, k: int) -> list[tuple[str, float]]:
    """The member's k most probable next tokens with their log-probabilities, and the token there."""
    best = torch.topk(row, k).indices.tolist()
    alts = [(token_text(member.vocab_bytes[t]) or member.decode([t], False), float(row[t])) for t in best]
    return alts if tid in best else alts + [(token_text(data), lp)]


def _next(member: Any, row: torch.Tensor, top: int, name: str) -> TokenLogprob:
    """The member's most probable token after a continuation (a special token: its text, no bytes)."""
    t = int(torch.argmax(row))
    data = b"" if t in member.special_ids else member.vocab_bytes[t]
    text = token_text(data) if data else member.decode([t], skip_special_tokens=False)
    alts = _alternatives(member, row, t, data, float(row[t]), top) if top else []
    return TokenLogprob(text, data, float(row[t]), {name: float(row[t])}, alts)


def _end(member: Any, row: torch.Tensor, name: str) -> TokenLogprob:
    """The end of text after a continuation: the member's EOS, as a token with no bytes."""
    lp = float(torch.logsumexp(row[sorted(member.eos_ids)], 0))
    return TokenLogprob(token="", bytes=b"", logprob=lp, members={name: lp})
