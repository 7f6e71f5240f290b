"""The ensemble as a scorer: the log-probability of a text after a prompt (`Ensemble.score`).

Definition (docs/scoring.md). Member k's probability of the continuation's bytes x is P_k(x),
its byte-level probability marginalised over its tokenizations from the prompt's tokens on
(`members/bytelm.py`; exact up to the byte LM's beam of tokenizations). The ensemble's next-byte
distribution is

    q(b | x) = psi(x b) / sum_b' psi(x b'),   psi = f(P_1, ..., P_K) with the member weights,

over 256 bytes and the end of text, where f is the method's weighted power mean
(`Method.scoring_f`: the mixture for unite and safe, which average probabilities; the
product for specfuse, whose segment scores add log-probabilities; smc's own f). That is smc's
proposal. The ensemble's log-probability of x is sum_i log q(x_i | x_<i): a distribution over
texts whatever the tokenizers, and with one member exactly that member's P(x), since the ratios
telescope.

Every continuation is scored byte by byte on a trie of the continuations: a prefix they share is
computed once, and each byte step asks every member once for all the prefixes at that depth (one
batched forward per member for all new token contexts).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import torch

from .errors import ContextLengthError, RequestError
from .members.protocol import BYTE_LM
from .methods.base import check_capabilities
from .methods.smc import f_ensemble
from .scores import Score, ScoreResult, TokenLogprob, token_spans, token_text
from .streams import async_channel, sync_channel
from .token_scoring import run_token_score

NEG_INF = float("-inf")


@dataclass
class ByteSteps:
    """Per byte of one continuation: the ensemble's log q(x_i | x_<i) and each member's own
    log p_k(x_i | x_<i) (its byte-level conditional)."""

    ensemble: list[float] = field(default_factory=list)
    members: list[list[float]] = field(default_factory=list)  # [K][bytes]
    end: tuple[float, list[float]] | None = None  # the end of text after it (ensemble, members), when asked


def byte_steps(
    lms: Sequence[Any],
    starts: Sequence[Any],
    texts: Sequence[bytes],
    tau: float,
    weights: Sequence[float],
    ends: Sequence[bool] = (),
) -> tuple[list[ByteSteps], list[list[bool]]]:
    """Every text's ByteSteps after the prompt (the byte LMs' `starts`), and per byte whether it
    was the ensemble's argmax; with `ends[i]`, text i's end of text too (`ByteSteps.end`).
    Prefixes the texts share are computed once; each depth is one `next_logprobs` per member for
    all its prefixes."""
    w = np.asarray(weights, dtype=np.float64)
    w = w / w.sum()
    K, ending = len(lms), {t for t, e in zip(texts, ends) if e}
    frontier: dict[bytes, tuple[list[Any], np.ndarray]] = {b"": (list(starts), np.zeros(K))}
    step_of: dict[bytes, tuple[float, np.ndarray, bool]] = {}  # prefix + byte -> its step
    end_of: dict[bytes, tuple[float, np.ndarray]] = {}  # text -> its end-of-text step
    for depth in range(max((len(t) + (t in ending) for t in texts), default=0)):
        rows = sorted({t[:depth] for t in texts if len(t) > depth} | {t for t in ending if len(t) == depth})
        need = [_read_after(texts, ending, x, depth) for x in rows]  # bytes (256: the end) read after each
        asks = [lm.next_logprobs_async([frontier[x][0][k] for x in rows], need) for k, lm in enumerate(lms)]
        logq = np.stack([a.get() for a in asks], axis=1)  # [rows, K, 257]
        following: dict[bytes, tuple[list[Any], np.ndarray]] = {}
        for r, x in enumerate(rows):
            states, lp = frontier[x]
            joint = lp[:, None] + logq[r]  # [K, 257]: log P_k(x b)
            psi = f_ensemble(joint, tau, w, axis=0)  # [257]: log psi(x b)
            total = np.logaddexp.reduce(psi)
            for b in sorted(need[r]):
                ens = float(psi[b] - total) if np.isfinite(total) else NEG_INF
                if b == 256:
                    end_of[x] = (ens, logq[r, :, b].copy())
                    continue
                step_of[x + bytes([b])] = (ens, logq[r, :, b].copy(), bool(psi[b] >= psi.max()))
                following[x + bytes([b])] = ([lm.advance(s, b) for lm, s in zip(lms, states)], joint[:, b].copy())
        frontier = following
        for k, lm in enumerate(lms):  # contexts no live prefix stands on are freed (llama.cpp sequences)
            lm.compact([states[k] for states, _ in frontier.values()])
    out, argmax = [], []
    for t in texts:
        steps = [step_of[t[: i + 1]] for i in range(len(t))]
        end = (end_of[t][0], [float(v) for v in end_of[t][1]]) if t in ending else None
        out.append(ByteSteps([s[0] for s in steps], [[float(s[1][k]) for s in steps] for k in range(K)], end))
        argmax.append([s[2] for s in steps])
    return out, argmax


def _read_after(texts: Sequence[bytes], ending: set[bytes], x: bytes, depth: int) -> set[int]:
    """The bytes some text reads after its prefix x (of length depth); 256 where a text in `ending` is x."""
    out = {t[depth] for t in texts if len(t) > depth and t[:depth] == x}
    return out | {256} if x in ending else out


def score_of(
    text: str,
    steps: ByteSteps,
    argmax: list[bool],
    names: Sequence[str],
    spans: list[tuple[int, int, int]],
    tops: list[list[tuple[str, float]]] | None = None,
) -> Score:
    """One continuation's Score from its byte steps: sums over the whole text and over each token
    of `spans` (a token's bytes get the steps of those bytes), with its alternatives `tops`."""
    data, tokens = text.encode("utf-8"), []
    for j, (_, a, b) in enumerate(spans):
        tokens.append(
            TokenLogprob(
                token=token_text(data[a:b]),
                bytes=data[a:b],
                logprob=float(sum(steps.ensemble[a:b])),
                members={n: float(sum(steps.members[k][a:b])) for k, n in enumerate(names)},
                top=tops[j] if tops else [],
            )
        )
    return Score(
        text=text,
        logprob=float(sum(steps.ensemble)),
        members={n: float(sum(s)) for n, s in zip(names, steps.members)},
        tokens=tokens,
        greedy=all(argmax),
        end=None if steps.end is None else _end_token(steps.end, names),
    )


def _end_token(end: tuple[float, list[float]], names: Sequence[str]) -> TokenLogprob:
    """The end of text as a token with no bytes (an EOS), with the ensemble's and each member's log-probability."""
    return TokenLogprob(token="", bytes=b"", logprob=end[0], members=dict(zip(names, end[1])))


def _names(members: Sequence[Any]) -> list[str]:
    """Member names, made unique (two members may share a model)."""
    names = [m.name for m in members]
    return [n if names.count(n) == 1 else f"{n}#{i}" for i, n in enumerate(names)]


# ---- a scoring request -----------------------------------------------------------------------
SCORE_BEAM = 5  # tokenization hypotheses per member and prefix (smc's default)
SCORE_PRUNE = 1e-3  # and none below this fraction of the best one (smc's default)
MAX_TOP = 20  # alternatives per token (OpenAI's top_logprobs limit)


@dataclass(frozen=True)
class Scoring:
    """What a scoring request asks (`Job.scoring`): the continuations; optionally the prompt whose
    shown answers set the member weights (default: the prompt itself), each continuation's tokens
    in the reporting member's vocabulary (default: its canonical ones), and how many alternatives
    per token to score (the reporting member's most probable next tokens)."""

    continuations: tuple[str, ...]
    weigh: Any = None
    token_ids: tuple[tuple[int, ...] | None, ...] | None = None
    top: int = 0
    ends: tuple[bool, ...] = ()  # per continuation: score the end of text after it too (an EOS)
    greedy_next: bool = False  # one member: its most probable token after each continuation too


def check_top(k: Any, name: str = "top") -> int:
    """Alternatives per token: an integer from 0 to MAX_TOP (`name`: the option as the caller spells it)."""
    if not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= MAX_TOP:
        raise RequestError(f"{name} must be an integer from 0 to {MAX_TOP}, got {k!r}")
    return k


def check_continuations(continuations: Any) -> tuple[str, ...]:
    """The continuations to score: a non-empty list of strings."""
    if isinstance(continuations, str) or not isinstance(continuations, (list, tuple)) or not continuations:
        raise RequestError(
            f"continuations must be a non-empty list of strings, got {continuations!r}; "
            "score one text with continuations=[text]"
        )
    for i, c in enumerate(continuations):
        if not isinstance(c, str):
            raise RequestError(f"continuation {i} must be a string, got {type(c).__name__}")
    return tuple(continuations)


def run_score(engine: Any, job: Any) -> ScoreResult:
    """Score `job.scoring` after `job.prompt` (see the module): each member's prompt as a request
    of that kind would have it, the request's member weights (evidence.py: the shot exam and the
    evidence of a few-shot prompt), the method's f, then every continuation (and alternative)
    byte by byte. Tokens are reported in the engine's main member for this kind of prompt."""
    members, sc = engine.members, job.scoring
    check_capabilities(members, frozenset({BYTE_LM}), "scoring (log-likelihoods of given text)")
    prior, main = engine.member_weights("raw" if job.params.raw else "chat")
    texts, prompt_ids = _prompts(engine, job)
    _check_window(members, prompt_ids, sc.continuations)
    if sc.greedy_next and len(members) > 1:
        raise RequestError("greedy_next reads one member's next token; an ensemble's next token is its method's")
    if len(members) == 1:  # nothing to reconcile: the member's own token log-probabilities
        return run_token_score(engine, job, prompt_ids[0], _names(members))
    tau, w, notes = _combination(engine, job, prior, main, texts, prompt_ids)
    spans = [
        token_spans(members[main], c, None if sc.token_ids is None else sc.token_ids[i])
        for i, c in enumerate(sc.continuations)
    ]
    datas = [c.encode("utf-8") for c in sc.continuations]
    # keep_fresh: a token may always end at a byte, so no member gives a text probability 0 for its
    # beam's sake; "lazy": its forward only where a continuation's byte needs it
    lms = [m.byte_lm(SCORE_BEAM, SCORE_PRUNE, 1.0, keep_fresh="lazy") for m in members]
    starts = [lm.start(ids) for lm, ids in zip(lms, prompt_ids)]
    # the main member's alternatives on the prompt its byte LM prefilled (one in this process)
    state = getattr(lms[main], "prompt_state", None)
    alts = _alternatives(members[main], prompt_ids[main], spans, datas, sc.top, state) if sc.top else []
    steps, argmax = byte_steps(lms, starts, datas + [a[3] for a in alts], tau, w, sc.ends)
    names = _names(members)
    tops = _tops(len(datas), spans, datas, alts, steps, sc.top)
    scores = [score_of(c, steps[i], argmax[i], names, spans[i], tops[i]) for i, c in enumerate(sc.continuations)]
    stats = {"weights": [round(x, 4) for x in w], "power": tau, "tokens_of": members[main].name, **notes}
    return ScoreResult(scores, stats)


def _prompts(engine: Any, job: Any) -> tuple[list[str], list[list[int]]]:
    from .pipeline import member_prompts

    texts, _ = member_prompts(engine, job, job.params.tool_choice)
    return texts, [m.prompt_ids(t) for m, t in zip(engine.members, texts)]


def _check_window(members: Sequence[Any], prompt_ids: list[list[int]], conts: Sequence[str]) -> None:
    for m, ids in zip(members, prompt_ids):
        longest = max(len(m.encode(c)) for c in conts)
        if len(ids) + longest >= m.context_window:
            raise ContextLengthError(
                f"the prompt and the longest continuation are {len(ids) + longest} tokens for {m.name}, whose "
                f"context window is {m.context_window}; shorten them or drop that member."
            )


def _combination(engine, job, prior, main, texts, prompt_ids) -> tuple[float, list[float], dict]:
    """(power of the mean, member weights, findings): the request's weights from the prompt that
    weighs (`Scoring.weigh`, else the prompt), combined as the method combines members."""
    import dataclasses

    from .evidence import MemberPrompts, request_weights

    members, method, notes = engine.members, engine._method.for_kind(job.params.raw), {}
    if job.scoring.weigh is not None:
        weigh = dataclasses.replace(job, prompt=job.scoring.weigh)
        texts, prompt_ids = _prompts(engine, weigh)
    else:
        weigh = job
    prompts = MemberPrompts(weigh.prompt, job.params.raw, texts, prompt_ids)
    weights, _, aside = request_weights(method, members, prompts, list(prior), main, notes)
    tau, w = method.scoring_f(weights, prior, aside)
    return tau, w, notes


def _alternatives(member, prompt_ids, spans, datas, k: int, state=None) -> list[tuple[int, int, int, bytes]]:
    """(continuation, token index, candidate id, text to score) for the member's k most probable
    tokens at each token of each continuation, other than the token there (its own distribution,
    one forward over the continuation's tokens, after `state`: the prompt prefilled, else here)."""
    out, vb, special = [], member.vocab_bytes, member.special_ids
    state = state if state is not None else member.prefill(prompt_ids)
    first = member.ensure_next(state)
    for c, (sp, data) in enumerate(zip(spans, datas)):
        ids = [t for t, _, _ in sp]
        with member.scratch(state):
            rows = member.extend(state, ids) if ids else None
        for j, (tok, a, _) in enumerate(sp):
            row = first if j == 0 else rows[j - 1]
            picked = 0
            for cand in torch.topk(row, min(len(row), k + 8)).indices.tolist():
                if picked == k:
                    break
                if cand in special or not vb[cand]:
                    continue
                picked += 1
                if cand != tok:
                    out.append((c, j, cand, data[:a] + vb[cand]))
    return out


def _tops(n, spans, datas, alts, steps, k: int) -> list[list[list[tuple[str, float]]] | None]:
    """Per continuation and token: the k best of the token there and its alternatives, by the
    ensemble's log-probability of their bytes (the token there always listed)."""
    if not k:
        return [None] * n
    found: dict[tuple[int, int], list[tuple[str, float]]] = {}
    for i, (c, j, _, text) in enumerate(alts):
        a = spans[c][j][1]
        found.setdefault((c, j), []).append((token_text(text[a:]), float(sum(steps[n + i].ensemble[a:]))))
    out = []
    for c in range(n):
        per = []
        for j, (_, a, b) in enumerate(spans[c]):
            here = (token_text(datas[c][a:b]), float(sum(steps[c].ensemble[a:b])))
            best = sorted(found.get((c, j), []) + [here], key=lambda x: -x[1])[:k]
            per.append(best if here in best else best + [here])
        out.append(per)
    return out


class Scorer:
    """`Ensemble`'s scoring entry points: a scoring request goes through the engine's queue like
    any other (its deadline, its retries, batched with the running requests' steps)."""

    def score(
        self,
        prompt: str | list[dict],
        continuations: Sequence[str],
        *,
        raw: bool = True,
        top: int = 0,
        timeout: float | None = None,
    ) -> list[Score]:
        """Each continuation's log-likelihood after `prompt` under the ensemble, each member's own,
        and per token of the main member, with its `top` best alternatives (docs/scoring.md).
        Continuations that begin alike share their work; the members' prompts are prefilled once.
        `raw=True` (the default): the prompt is plain text, as in log-likelihood benchmarks;
        `raw=False`: chat messages, the continuation being the reply."""
        job = self._score_job(prompt, Scoring(check_continuations(continuations), top=top), raw, timeout)
        stream = self._open(job, sync_channel())
        for _ in stream:
            pass
        return stream.result.scores

    async def ascore(
        self, prompt: str | list[dict], scoring: Scoring, *, raw: bool = True, timeout: float | None = None
    ) -> ScoreResult:
        """`score` for asyncio, with every option of a scoring request (`Scoring`) and the
        request's figures: never blocks the event loop."""
        stream = self._open(self._score_job(prompt, scoring, raw, timeout), async_channel())
        async for _ in stream:
            pass
        return stream.result

    def _score_job(self, prompt: Any, scoring: Scoring, raw: bool, timeout: float | None) -> Any:
        check_top(scoring.top)
        job = self._job(prompt, None, {"raw": raw, "timeout": timeout})
        job.scoring, job.shows_text = scoring, False
        return job
