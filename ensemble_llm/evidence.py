"""Per-request member weights: what the request itself shows about each member's competence.

A few-shot prompt carries the sharpest evidence there is about which member knows the task: the
answers it already shows. For member k, the evidence is the mean log-probability of those
answers' bytes given everything before each of them, per shown answer,
    e_k = (1/J) sum_j log p_k(answer_j | prompt before answer_j),
read from the prompt's own prefill (the logits of the answer positions; `TokenLM.score_prompt`),
so it costs one lm_head product per scored position and no extra forward. Every member scores the
same bytes, so the figures are comparable across tokenizers.

The request's weights are a tempered posterior of "member k is the one that knows this task", with
the calibrated weights (`calibrate.py`) as the prior:
    log w_k = log prior_k + e_k + const.
The plain posterior (Bayesian model averaging) would add the sum over answers, J * e_k; neither
member is the true model of the task, and with three shots that sum is overconfident (on
qa_wikidata's first shots it gave SmolLM2 0.999 where the members are about equal), so each
answer counts as one observation at learning rate 1/J (a "power posterior"), the geometric mean
of the answers' likelihoods. A member that explains the shown answers far better still takes
nearly all the weight (the ensemble follows it where the other member is weak); members that
explain them about equally keep weights near the prior and are ensembled. A floor keeps every
member's weight above `FLOOR` so that a weight is never exactly zero.

Where the evidence comes from:
- raw prompts: the prompt's last line is a label the reply completes ("A:", "Answer:",
  "German:"); each earlier line that starts with the same label shows an answer: the bytes after
  the label up to and including the line's newline (`answer_spans`);
- chat requests: the earlier assistant turns' contents, found in each member's rendered prompt
  (`chat_spans`).
A prompt that shows no answer keeps the prior weights.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

from .chat import content_text

MAX_LABEL = 40  # a label is a short line prefix ("A:", "Answer:", "Past participle:")
MAX_POSITIONS = 96  # scored positions per member and request (the last answers are kept)
FLOOR = 1e-3  # the smallest weight a member keeps


def answer_spans(text: str) -> list[tuple[int, int]]:
    """Byte spans [start, end) of the answers a raw few-shot prompt shows (see the module doc)."""
    head, sep, label = text.rpartition("\n")
    label = label.rstrip()
    if not sep or not label.strip() or len(label) > MAX_LABEL:
        return []
    spans, pos = [], 0
    data = head.encode("utf-8") + b"\n"
    lab = label.encode("utf-8")
    for line in data.split(b"\n")[:-1]:
        end = pos + len(line) + 1  # the newline ends the answer: a member that knows when to stop
        if line.startswith(lab) and line[len(lab) :].strip():
            spans.append((pos + len(lab), end))
        pos = end
    return spans


def chat_spans(text: str, answers: Sequence[str]) -> list[tuple[int, int]]:
    """Byte spans of the given assistant contents in a member's rendered chat prompt, in order."""
    spans, at = [], 0
    for a in answers:
        a = a.strip()
        if not a:
            continue
        i = text.find(a, at)
        if i < 0:
            continue
        b0 = len(text[:i].encode("utf-8"))
        spans.append((b0, b0 + len(a.encode("utf-8"))))
        at = i + len(a)
    return spans


def span_positions(ends: Sequence[int], spans: Sequence[tuple[int, int]], offset: int) -> list[int]:
    """Token positions (in the prompt ids, `offset` tokens of BOS before the text's tokens) of the
    tokens that end inside a span: `ends[j]` is the byte where text token j ends."""
    out, starts = [], [0] + list(ends[:-1])
    for j, (s, e) in enumerate(zip(starts, ends)):
        if any(b0 < e <= b1 and s < b1 for b0, b1 in spans):
            out.append(j + offset)
    return [p for p in out if p >= 1][-MAX_POSITIONS:]


def answer_positions(member, text: str, ids: Sequence[int], spans: Sequence[tuple[int, int]]) -> list[int]:
    """The positions in `ids` (member's prompt ids for `text`: its BOS, then the text's tokens)
    of the tokens that end inside `spans`; [] when there is no span or the ids are not the text's
    canonical tokens after a BOS (then the evidence cannot be read from this prompt)."""
    toks, ends = member.encode_with_offsets(text)
    offset = len(ids) - len(toks)
    if not spans or offset < 0 or list(ids[offset:]) != toks:
        return []
    return span_positions(ends, spans, offset)


def posterior(prior: Sequence[float], evidence: Sequence[float], temperature: float = 1.0) -> list[float]:
    """log w_k = log prior_k + evidence_k / temperature, normalised, floored at FLOOR."""
    logs = [math.log(max(p, 1e-300)) + e / temperature for p, e in zip(prior, evidence)]
    top = max(logs)
    w = [math.exp(x - top) for x in logs]
    total = sum(w)
    w = [max(x / total, FLOOR) for x in w]
    total = sum(w)
    return [x / total for x in w]


def _auto(method) -> bool:
    """Whether the method's weights are "auto" (the only setting the evidence and solo apply to)."""
    given = method.member_weights()
    return isinstance(given, str) and given == "auto"


def request_weights(
    method,
    members: Sequence[Any],
    prompt: str | list[dict],
    raw: bool,
    texts: list[str],
    prompt_ids: list[list[int]],
    prior: list[float],
    main: int,
    notes: dict[str, Any],
) -> tuple[list[float], int]:
    """With weights="auto", this request's member weights and main member: the prior updated by
    how well each member explains the answers the prompt already shows (scored in the prompt's
    own prefill, `TokenLM.score_prompt`). Other weight settings, one member, a prompt that shows
    no answer: the given weights and main member, unchanged. The evidence goes into `notes`."""
    rate = method.evidence_rate()
    if not _auto(method) or len(members) < 2 or method.name == "single" or rate == 0:
        return prior, main  # (rate 0: the calibrated weights; no answer is scored)
    answers = (
        []
        if raw or isinstance(prompt, str)
        else [content_text(m.get("content")) for m in prompt if m.get("role") == "assistant"]
    )
    plans = []
    for m, text, ids in zip(members, texts, prompt_ids):
        spans = answer_spans(text) if raw else chat_spans(text, answers)
        positions = answer_positions(m, text, ids, spans)
        if not positions:
            return prior, main
        plans.append((positions, len(spans)))

    def score(k: int) -> float:  # each shown answer is one observation: the mean log-prob per answer
        positions, n = plans[k]
        return float(sum(members[k].score_prompt(prompt_ids[k], positions))) / n

    given_main = method.main_member()
    evidence: list[float | None] = [None] * len(members)
    solo = method.solo_weight()
    if solo is not None and prior[main] >= solo:
        # the others' evidence is a log-probability, at most 0: if the main member keeps the solo
        # weight even against that, no evidence of theirs can change that it runs alone
        # (`solo_member`), and their prompts are not scored (their weights are upper bounds)
        evidence[main] = score(main)
        bound = posterior(prior, [0.0 if e is None else e for e in evidence], 1 / rate)
        if bound[main] >= solo:
            notes["evidence"] = {members[main].name: round(evidence[main], 3)}
            notes["evidence_positions"] = {members[main].name: len(plans[main][0])}
            return bound, main
    evidence = [score(k) if e is None else e for k, e in enumerate(evidence)]
    weights = posterior(prior, evidence, 1 / rate)
    main = given_main if given_main is not None else max(range(len(members)), key=lambda i: (weights[i], -i))
    notes["evidence"] = {m.name: round(e, 3) for m, e in zip(members, evidence)}
    notes["evidence_positions"] = {m.name: len(p) for m, (p, _) in zip(members, plans)}
    return weights, main


def solo_member(method, prior: Sequence[float], weights: Sequence[float], main: int) -> int | None:
    """The member this request runs alone, or None to ensemble. With weights="auto" and the
    method's `solo` weight s: the main member, when the calibrated prior and this request's
    weights (its evidence, `request_weights`) both give it at least s. Then the others together
    hold at most 1 - s everywhere, and every method would follow that member's text almost
    token for token at the cost of every member's forwards; a strong member paired with weak
    ones (the trio's Qwen) gets its own answer at its own cost. Both must agree: a prior alone
    (the calibration's 40 facts) is not this task, and one request's evidence alone is three
    shots."""
    s = method.solo_weight()
    if s is None or not _auto(method) or len(weights) < 2:
        return None
    return main if prior[main] >= s and weights[main] >= s else None
