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
- raw prompts, in any line format: the prompt ends with a label the reply completes ("A:",
  " =>", "Answer:" and a newline: `_label`), and each earlier occurrence of that label shows an
  answer, the bytes after it up to and including the newline (`answer_spans`);
- chat requests: the earlier assistant turns' contents, each found in each member's rendered
  prompt after the turns before it (`chat_spans`).
A prompt that shows no answer keeps the prior weights.

The shot exam (`shot_exam`, on by default, at any `evidence` rate): from the same prefill, how far
each member is from writing each shown answer itself, greedily, given what comes before it: the
sum over the answer's tokens (its newline included) of the token's log-prob minus the best
token's (0 where the member would write the answer; `PromptScore.gap`), averaged over the
examined answers. The first shown answer is not examined (it comes before any shot: a question
of format, not of the task). A member whose mean is `EXAM_BEHIND` nats or more below another
member's cannot do the task as the prompt shows it (it copies the input, misses the script or the
form on every shot): it steps aside (`exam_aside`), and with one member left that member runs
alone. Only a wide gap acts: which member explains the shots a little better says little about
which is right next (routing by it chose the worse member on factual tasks), while a member that
is nowhere near writing any of them is at the floor.

The copy test, part of the exam (raw few-shot prompts, and chats whose earlier turns show
answers): a member can follow every shown answer and still answer the query with its question (a
demonym task's "France" for "French": the shown answers begin with their questions). Where no
shown answer is its own question, that reply contradicts the shots: the member whose greedy reply
is the question itself and nothing more (`query_copy`: the question and its newline; `chat_copy`:
the last user message and the member's end of turn, so "wetter" for "wet" is no copy;
`TokenLM.greedy_after` on the scored prompt's state: a forward only where the copy's first token
is the member's greedy one) steps aside, if another member's is not (`copy_aside`; where every
member copies, it says nothing).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

from .chat import content_text, render_chat
from .members import PromptScore

MAX_LABEL = 40  # a label is a short line prefix ("A:", "Answer:", "Past participle:")
MAX_POSITIONS = 96  # scored positions per member and request (the last answers are kept)
FLOOR = 1e-3  # the smallest weight a member keeps
EXAM_ANSWERS = 8  # shown answers examined per request (the last ones)
# nats per examined answer behind the best member: it steps aside (chosen by benchmarks/exam_rules.py,
# in git history: `git show 5e86875:benchmarks/exam_rules.py`)
EXAM_BEHIND = 3.0
COPY_TOKENS = 16  # a longer question is not tested as a copy (the test could extend by as much)


def _label(body: str) -> tuple[str, list[int]] | None:
    """The label the reply completes in `body` (the prompt after a newline, trailing spaces off)
    and where it occurs earlier: the longest suffix that begins after a whitespace character
    (which it includes), holds at most MAX_LABEL characters, ends in a sign ("A:", " =>",
    "Answer:" and a newline) and occurs earlier as often as the shortest such suffix that occurs
    earlier at all (a longer one would take in the query's own words). None: no label."""
    found, count = None, 0
    for i in range(len(body) - 1, max(0, len(body) - MAX_LABEL - 1), -1):
        if not body[i - 1].isspace() or body[i].isspace():
            continue
        label = body[i - 1 :]
        if label.rstrip()[-1:].isalnum():
            continue
        at, j = [], body.find(label)
        while 0 <= j < len(body) - len(label):
            at.append(j)
            j = body.find(label, j + len(label))
        if count and len(at) < count:  # a longer suffix that takes in the query's own words
            break
        if at:
            found, count = (label, at), len(at)
    return found


def _shots(text: str) -> tuple[str, list[tuple[int, int]], list[tuple[int, int]]] | None:
    """(body, the shown answers' character spans in it, the span of the question before each
    answer and the query's: from its line's start to the label) for a raw few-shot prompt; None
    where no label repeats (see `answer_spans`)."""
    body = "\n" + text.rstrip(" \t")
    found = _label(body)
    if found is None:
        return None
    label, at = found
    spans = []
    for j in at:
        s, e = j + len(label), body.find("\n", j + len(label))
        spans.append((s, len(body) if e < 0 else e + 1))  # the newline ends the answer: when to stop
    questions = [(body.rfind("\n", 0, j) + 1, j) for j in at + [len(body) - len(label)]]
    return body, spans, questions


def answer_spans(text: str) -> list[tuple[int, int]]:
    """Byte spans [start, end) of the answers a raw few-shot prompt shows, in any line format: the
    prompt ends with a label (`_label`: "A:", " =>", "Answer:" and a newline) that occurs earlier,
    and each earlier occurrence shows an answer, the bytes after it up to and including the
    newline (an empty answer is left out)."""
    shots = _shots(text)
    if shots is None:
        return []
    body, spans, _ = shots

    def byte(k: int) -> int:  # body's character k in text's bytes (body has a newline before text)
        return len(text[: k - 1].encode("utf-8"))

    return [(byte(s), byte(e)) for s, e in spans if body[s:e].strip()]


def context_end(text: str) -> int:
    """Where the context ends in a raw text that holds its answer at the end (an echoed
    multiple-choice prompt: the context, then a choice). The candidates: the end of the line
    before the last, where it ends in a sign (an answer on the next line), and the first sign on
    the last line that whitespace follows ("A:" in "A: 3:45", " =>" in "italy => Rome"). The first
    candidate where the text before it is a few-shot prompt (`_shots`: it ends with its shown
    answers' label); else the last line's candidate; else the last line's start (0 on one line).
    Whitespace before the answer goes with it, as lm-evaluation-harness splits."""
    line = text.rfind("\n") + 1
    first = next((c for c in range(max(line, 1), len(text)) if _sign(text[c - 1]) and text[c].isspace()), None)
    before = line - 1 if line >= 2 and _sign(text[line - 2]) else None
    shown = [c for c in (before, first) if c is not None and _shots(text[:c]) is not None]
    cut = shown[0] if shown else first if first is not None else line
    return len(text[:cut].rstrip())


def _sign(ch: str) -> bool:
    return not (ch.isalnum() or ch.isspace())


def query_copy(text: str) -> str | None:
    """The reply that would copy the query's question in a raw few-shot prompt: the shown answers'
    leading space, the text between the line's start and the final label (less the questions'
    own label, such as "Q:"), a newline. None where the prompt shows no answer, a question cannot
    be read (empty, or an earlier answer where it goes), or a shown answer copies its own question
    (then a copy may be what the task asks for)."""
    shots = _shots(text)
    if shots is None or not shots[1]:
        return None
    body, spans, where = shots
    if any(q0 < e for (_, e), (q0, _) in zip(spans, where[1:])):
        return None  # an answer where a question goes
    asked = [body[q0:q1] for q0, q1 in where]
    answers = [body[s:e].rstrip("\n") for s, e in spans]
    first = asked[0]
    qlabel = first[: first.find(":") + 1] if 0 <= first.find(":") < MAX_LABEL else ""
    if not all(q.startswith(qlabel) for q in asked):
        qlabel = ""
    questions = [q[len(qlabel) :].strip() for q in asked]
    if not all(questions) or any(a.strip() == q for a, q in zip(answers, questions)):
        return None
    last = answers[-1]
    return last[: len(last) - len(last.lstrip())] + questions[-1] + "\n"


def copy_aside(copies: Sequence[bool], aside: Sequence[int] = ()) -> list[int]:
    """The members that step aside for copying the question (`query_copy`; `copies[k]`: member k
    writes it greedily): of the members the shot exam left, those that write it, when one of them
    does not (where all of them copy, it says nothing about which is right)."""
    left = [k for k in range(len(copies)) if k not in aside]
    writers = [k for k in left if copies[k]]
    return writers if len(writers) < len(left) else []


def chat_spans(text: str, turns: Sequence[tuple[str, str]]) -> list[tuple[int, int]]:
    """Byte spans of the assistant turns' contents in a member's rendered chat prompt, in order,
    each anchored after the turns before it: every turn's content (system and user ones too) is
    found from where the previous one ended, so a short answer ("A", "4") is not taken from a
    preamble, a system text or its own question."""
    spans, at = [], 0
    for role, content in turns:
        c = content.strip()
        i = text.find(c, at) if c else -1
        if i < 0:
            continue
        if role == "assistant":
            b0 = len(text[:i].encode("utf-8"))
            spans.append((b0, b0 + len(c.encode("utf-8"))))
        at = i + len(c)
    return spans


def span_positions(ends: Sequence[int], spans: Sequence[tuple[int, int]], offset: int) -> list[int]:
    """Token positions (in the prompt ids, `offset` tokens of BOS before the text's tokens) of the
    tokens that end inside a span: `ends[j]` is the byte where text token j ends (the last
    MAX_POSITIONS of them)."""
    return _ending_inside(ends, spans, offset)[-MAX_POSITIONS:]


def _ending_inside(ends: Sequence[int], spans: Sequence[tuple[int, int]], offset: int) -> list[int]:
    out, starts = [], [0] + list(ends[:-1])
    for j, (s, e) in enumerate(zip(starts, ends)):
        if any(b0 < e <= b1 and s < b1 for b0, b1 in spans):
            out.append(j + offset)
    return [p for p in out if p >= 1]


def span_groups(member, text: str, ids: Sequence[int], spans: Sequence[tuple[int, int]]) -> list[list[int]]:
    """Per span, the positions in `ids` (member's prompt ids for `text`: its BOS, then the text's
    tokens) of the tokens that end inside it, uncapped; [] when there is no span or the ids are
    not the text's canonical tokens after a BOS (then nothing can be read from this prompt)."""
    toks, ends = member.encode_with_offsets(text)
    offset = len(ids) - len(toks)
    if not spans or offset < 0 or list(ids[offset:]) != toks:
        return []
    return [_ending_inside(ends, [s], offset) for s in spans]


def shot_exam(scores: Sequence[Sequence[PromptScore]]) -> float:
    """How far a member is from writing the examined answers (each one's tokens' scores): the
    mean over the answers of the sum of their tokens' gaps to the best token (0: it writes them)."""
    return sum(sum(x.gap for x in s) for s in scores) / max(1, len(scores))


def exam_aside(gaps: Sequence[float], behind: float = EXAM_BEHIND) -> list[int]:
    """The members that step aside: `behind` nats or more below the best member's shot exam."""
    best = max(gaps, default=0.0)
    return [k for k, g in enumerate(gaps) if best - g >= behind]


def answer_positions(member, text: str, ids: Sequence[int], spans: Sequence[tuple[int, int]]) -> list[int]:
    """The positions in `ids` of the tokens that end inside any of `spans` (`span_groups`, joined),
    the last MAX_POSITIONS of them; [] when the prompt cannot be read (see `span_groups`)."""
    return sorted({p for g in span_groups(member, text, ids, spans) for p in g})[-MAX_POSITIONS:]


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


def _turns(messages: list[dict]) -> list[tuple[str, str]]:
    """A chat's (role, content as text) pairs."""
    return [(m.get("role"), content_text(m.get("content"))) for m in messages]


def _plans(members, prompt, raw: bool, texts: list[str], prompt_ids: list[list[int]]) -> list[list[list[int]]]:
    """Per member, the positions of each shown answer's tokens in its prompt ids; [] when a
    member's prompt shows none (or its ids are not its text's tokens)."""
    turns = [] if raw or isinstance(prompt, str) else _turns(prompt)
    plans = []
    for m, text, ids in zip(members, texts, prompt_ids):
        groups = span_groups(m, text, ids, answer_spans(text) if raw else chat_spans(text, turns))
        if not groups or not all(groups):
            return []
        plans.append(groups)
    return plans if len({len(g) for g in plans}) == 1 else []


def _examined(plans: list[list[list[int]]]) -> list[list[list[int]]]:
    """Per member, the shown answers the exam reads, the same ones for every member: after the
    first (it comes before any shot), the last EXAM_ANSWERS whose tokens fit MAX_POSITIONS in
    every member's prompt (each scored row costs an output layer: long assistant turns in a chat
    would otherwise cost more than the request)."""

    def fitting(groups: list[list[int]]) -> int:
        n, rows = 0, 0
        for g in reversed(groups[1:][-EXAM_ANSWERS:]):
            if rows + len(g) > MAX_POSITIONS:
                break
            n, rows = n + 1, rows + len(g)
        return n

    n = min(fitting(g) for g in plans)
    return [g[len(g) - n :] if n else [] for g in plans]


@dataclass(frozen=True)
class MemberPrompts:
    """A request's prompt as given (text or messages, `raw` or chat) and as each member reads it:
    its text and token ids."""

    prompt: str | list[dict]
    raw: bool
    texts: list[str]
    ids: list[list[int]]


def chat_copy(turns: Sequence[tuple[str, str]]) -> str | None:
    """The reply that would copy the query's question in a chat whose earlier turns show answers:
    the last user turn's content (stripped). None where the conversation does not end with a user
    turn, no assistant turn answers a user turn, or a shown answer is its own question (then a
    copy may be what the task asks for)."""
    if not turns or turns[-1][0] != "user" or not turns[-1][1].strip():
        return None
    pairs = [(q, a) for (r0, q), (r1, a) in zip(turns, turns[1:]) if r0 == "user" and r1 == "assistant"]
    if not pairs or any(a.strip() == q.strip() for q, a in pairs):
        return None
    return turns[-1][1].strip()


def _chat_reply(member, copy: str) -> str | None:
    """`copy` as this member's whole assistant turn, from where its prompt ends: the template's
    rendering of the reply (its end-of-turn marker after it), or, in the plain transcript, the
    reply and the newline that ends it. None where the template does not render the turn after
    its generation prompt."""
    if not member.has_chat_template:
        return copy + "\n"
    asked = [{"role": "user", "content": "?"}]
    head = render_chat(member, asked)
    full = render_chat(member, asked + [{"role": "assistant", "content": copy}], add_generation_prompt=False)
    return full[len(head) :] if full.startswith(head) and copy in full[len(head) :] else None


def _through(member, tail: Sequence[int], n_bytes: int) -> list[int]:
    """The first tokens of `tail` that hold its first `n_bytes` bytes, and the token after them
    (the copy's end: its newline, or the template's end-of-turn marker)."""
    got = 0
    for j, t in enumerate(tail):
        if got >= n_bytes:
            return list(tail[: j + 1])
        got += len(member.vocab_bytes[t])
    return list(tail)


def _copy_text(member, prompts: MemberPrompts, k: int) -> tuple[str, int] | None:
    """Member k's prompt text followed by the copy, and the bytes of the copy before its end."""
    text = prompts.texts[k]
    if prompts.raw:
        copy = query_copy(text)
        return (text + copy, len(copy.encode("utf-8")) - 1) if copy else None
    copy = chat_copy(_turns(prompts.prompt))
    reply = _chat_reply(member, copy) if copy else None
    if reply is None:
        return None
    return text + reply, len(reply[: reply.find(copy) + len(copy)].encode("utf-8"))


def copy_tokens(members, prompts: MemberPrompts) -> list[list[int]] | None:
    """Per member, the tokens of the reply that copies the query's question after its prompt's:
    in a raw few-shot prompt `query_copy` (its newline included), in a chat `chat_copy` (the
    member's end-of-turn marker after it). None where there is none, it is over COPY_TOKENS tokens
    or past a member's context window, or a member's tokens of prompt and copy do not begin with
    its prompt's tokens (the copy is not a continuation)."""
    if not prompts.raw and isinstance(prompts.prompt, str):
        return None
    out = []
    for k, (m, ids) in enumerate(zip(members, prompts.ids)):
        found = _copy_text(m, prompts, k)
        ext = m.prompt_ids(found[0]) if found else []
        if not 0 < len(ext) - len(ids) <= COPY_TOKENS or len(ext) >= m.context_window or ext[: len(ids)] != list(ids):
            return None
        out.append(_through(m, ext[len(ids) :], found[1]))
    return out


def request_weights(
    method, members: Sequence[Any], prompts: MemberPrompts, prior: list[float], main: int, notes: dict[str, Any]
) -> tuple[list[float], int, tuple[int, ...]]:
    """With weights="auto", this request's member weights, main member and the members the shot
    exam stepped aside: the prior with the members that fail the shot exam or copy the question
    stepped aside (their weight FLOOR, `exam_aside`, `copy_aside`), then moved by how well each
    member explains the shown answers (rate `evidence`), all read from the prompt's own prefill
    (`TokenLM.score_prompt`; the copy from its state, `greedy_after`). Other weight settings, one member,
    a prompt that shows no answer: the given weights and main member, unchanged. Findings go
    into `notes`."""
    prompt, raw, texts, prompt_ids = prompts.prompt, prompts.raw, prompts.texts, prompts.ids
    rate, exam = method.evidence_rate(), method.exam_on()
    if not _auto(method) or len(members) < 2 or method.name == "single" or (rate == 0 and not exam):
        return prior, main, ()
    plans = _plans(members, prompt, raw, texts, prompt_ids)
    if not plans:
        return prior, main, ()
    examined = _examined(plans) if exam else [[] for _ in plans]
    weighed = [[p for g in groups for p in g][-MAX_POSITIONS:] if rate else [] for groups in plans]
    copies = copy_tokens(members, prompts) if exam else None
    scored: list[tuple | None] = [None] * len(members)

    def score(k: int) -> tuple[float, float, bool]:  # (shot exam, evidence, writes the copy)
        if scored[k] is None:
            want = sorted({p for g in examined[k] for p in g} | set(weighed[k]))
            sc = dict(zip(want, members[k].score_prompt(prompt_ids[k], want)))
            writes = bool(copies) and members[k].greedy_after(prompt_ids[k], copies[k])
            scored[k] = (sc, writes)
        sc, writes = scored[k]
        evidence = sum(sc[p].logprob for p in weighed[k]) / len(plans[k])
        return shot_exam([[sc[p] for p in g] for g in examined[k]]), evidence, writes

    settled = _solo_bound(method, members, prior, main, rate, score, notes, len(weighed[main]))
    if settled is not None:
        return settled, main, ()
    found = [score(k) for k in range(len(members))]
    weights, aside = list(prior), _aside(members, found, exam, len(examined[0]), notes)
    if aside:
        weights = [FLOOR if k in aside else w for k, w in enumerate(weights)]
    if rate:
        weights = posterior(weights, [e for _, e, _ in found], 1 / rate)
        notes["evidence"] = {m.name: round(e, 3) for m, (_, e, _) in zip(members, found)}
        notes["evidence_positions"] = {m.name: len(w) for m, w in zip(members, weighed)}
    if weights == list(prior):
        return prior, main, ()
    weights = [x / sum(weights) for x in weights]
    given_main = method.main_member()
    main = given_main if given_main is not None else max(range(len(members)), key=lambda i: (weights[i], -i))
    return weights, main, tuple(aside)


def _aside(members, found: list[tuple[float, float, bool]], exam: bool, n: int, notes: dict[str, Any]) -> list[int]:
    """The members that step aside (the shot exam, then the copy test), with the findings in `notes`."""
    if not exam:
        return []
    aside = exam_aside([g for g, _, _ in found])
    notes["exam"] = {m.name: round(g, 3) for m, (g, _, _) in zip(members, found)} | {"examined": n}
    copying = copy_aside([c for _, _, c in found], aside)
    if copying:
        notes["copy"] = [members[k].name for k in copying]
    aside = sorted(set(aside) | set(copying))
    if aside:
        notes["aside"] = [members[k].name for k in aside]
    return aside


def _solo_bound(method, members, prior, main, rate, score, notes, positions: int) -> list[float] | None:
    """The weights when the main member's own findings settle that it runs alone (`solo_member`),
    with the others' prompts unscored: a prior that gives it the solo weight, a shot exam within
    EXAM_BEHIND of 0 (no member's exam, at most 0, can be that far ahead of it), no copy of the
    question, and the weight it keeps even against others whose evidence were 0 (a
    log-probability's maximum; their weights are upper bounds). Else None."""
    solo = method.solo_weight()
    if solo is None or prior[main] < solo:
        return None
    gap, e, writes = score(main)
    if method.exam_on() and (gap <= -EXAM_BEHIND or writes):  # another member could be that far ahead
        return None
    bound = posterior(prior, [e if k == main else 0.0 for k in range(len(members))], 1 / rate) if rate else list(prior)
    if bound[main] < solo:
        return None
    if rate:
        notes["evidence"] = {members[main].name: round(e, 3)}
        notes["evidence_positions"] = {members[main].name: positions}
    return bound


def solo_member(
    method, prior: Sequence[float], weights: Sequence[float], main: int, aside: Sequence[int] = ()
) -> int | None:
    """The member this request runs alone, or None to ensemble. With weights="auto": the one
    member the shot exam left (`aside` holds all the others), or, with the method's
    `solo` weight s, the main member when the calibrated prior and this request's weights both
    give it at least s. Then the others together hold at most 1 - s everywhere, and every method
    would follow that member's text almost token for token at the cost of every member's
    forwards; a strong member paired with weak ones (the trio's Qwen) gets its own answer at its
    own cost. Both must agree: a prior alone (the calibration's 40 facts) is not this task, and
    one request's evidence alone is three shots."""
    if not _auto(method) or len(weights) < 2:
        return None
    if len(aside) == len(weights) - 1:
        return next(k for k in range(len(weights)) if k not in aside)
    s = method.solo_weight()
    if s is None:
        return None
    return main if prior[main] >= s and weights[main] >= s else None
